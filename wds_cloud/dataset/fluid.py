"""The fluent methods: ``WebDataset(url).shuffle(1000).decode("rgb").to_tuple("png", "json")``.

Every fluent method returns a new pipeline with one more stage.  ``FluidWrapper`` gives any iterable
the fluent methods.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

from .. import autodecode, filters, utils
from ..handlers import reraise_exception
from ..pipeline import DataPipeline
from ..resume.arguments import as_count

__all__ = ["FluidInterface", "FluidWrapper"]


class FluidInterface:
    """Fluent methods shared by ``WebDataset``, ``FluidWrapper`` and ``WebLoader``."""

    if TYPE_CHECKING:  # provided by DataPipeline, which every class using this mixin also is

        def compose(self, *stages: Callable) -> Any: ...

    def batched(
        self, batchsize: int, collation_fn: Optional[Callable] = filters.default_collation_fn, partial: bool = True
    ) -> Any:
        """Group samples into batches: yields what ``collation_fn`` makes of each ``batchsize`` samples (by default
        a tuple of columns for tuple samples, a dict of columns for dict samples).  For example
        ``ds.to_tuple("jpg", "cls").batched(64)``; see :func:`wds_cloud.filters.batched`.

        :param batchsize: the samples per batch.
        :param collation_fn: turns a list of samples into a batch (None: the list itself).
        :param partial: yield the last, shorter batch (False: drop it).
        """
        return self.compose(filters.batched(batchsize, collation_fn=collation_fn, partial=partial))

    def unbatched(self) -> Any:
        """Split batches back into samples: yields one sample per row.  For example ``ds.batched(64).unbatched()``;
        see :func:`wds_cloud.filters.unbatched`."""
        return self.compose(filters.unbatched())

    def listed(self, batchsize: int, partial: bool = True) -> Any:
        """Group samples into lists: yields a plain list per ``batchsize`` samples (``batched`` without collation).
        For example ``ds.listed(8)``.

        :param batchsize: the samples per list.
        :param partial: yield the last, shorter list (False: drop it).
        """
        return self.compose(filters.batched(batchsize, collation_fn=None, partial=partial))

    def unlisted(self) -> Any:
        """Flatten lists back into samples: yields each item of each list.  For example ``ds.listed(8).unlisted()``."""
        return self.compose(filters.unlisted())

    def log_keys(self, logfile: Optional[str] = None) -> Any:
        """Record each sample's ``__url__`` and ``__key__``; yields the samples unchanged.  For example
        ``ds.log_keys("keys.tsv")``.

        :param logfile: the file to append a line per sample to; None logs them at DEBUG level.
        """
        return self.compose(filters.log_keys(logfile))

    def shuffle(self, size: int, **kw: Any) -> Any:
        """A sample shuffle of ``size`` samples.  In a dataset given a seed (``WebDataset(url, seed=S)``,
        ``WDS_SEED``, or a spec's ``seed:``), a shuffle given neither ``seed`` nor ``rng`` is seeded from it and
        from the epoch, so the same ``S`` gives the same order (webdataset seeds it from the clock)."""
        # a plain int before it is compared or saved in a state (numpy's, 1e3); 0: no shuffle, as in webdataset;
        # a negative size is refused, as every negative count is (it would otherwise mean no shuffle, silently)
        size = as_count("shuffle size", size, least=0)
        if size < 1:
            return self
        base = getattr(self, "sample_seed", None)
        if base is not None and kw.get("seed") is None and kw.get("rng") is None:
            number = sum(isinstance(stage, filters.Shuffle) for stage in getattr(self, "pipeline", ()))
            return self.compose(
                filters.Shuffle(
                    size,
                    kw.get("initial", 100),
                    handler=kw.get("handler"),
                    seed=utils.make_seed(base, "sample shuffle", number),
                    epoch_seeded=True,
                )
            )
        return self.compose(filters.shuffle(size, **kw))

    def map(self, f: Callable, handler: Callable = reraise_exception) -> Any:
        """Apply ``f`` to each sample: yields ``f(sample)``, skipping None.  For example
        ``ds.map(lambda s: {**s, "n": len(s["txt"])})``; see :func:`wds_cloud.filters.map`.

        :param f: a function of a sample returning the new sample, or None to drop it.
        :param handler: called with the exception ``f`` raised: true skips the sample, false stops.
        """
        return self.compose(filters.map(f, handler=handler))

    def decode(
        self,
        *args: Any,
        pre: Optional[list] = None,
        post: Optional[list] = None,
        only: Any = None,
        partial: bool = False,
        handler: Callable = reraise_exception,
        allow_pickle: Optional[bool] = None,
    ) -> Any:
        """Decode fields by extension; string arguments are image specs (``"rgb8"``, ``"torchrgb"``, ``"pil"``)."""
        handlers = [autodecode.ImageHandler(x) if isinstance(x, str) else x for x in args]
        decoder = autodecode.Decoder(
            handlers, pre=pre, post=post, only=only, partial=partial, allow_pickle=allow_pickle
        )
        return self.map(decoder, handler=handler)

    def map_dict(self, handler: Callable = reraise_exception, **kw: Callable) -> Any:
        """Apply a function to named fields: yields each sample with those fields replaced.  For example
        ``ds.map_dict(jpg=preprocess, cls=int)``; see :func:`wds_cloud.filters.map_dict`.

        :param handler: called with the exception a function raised: true skips the sample, false stops.
        :param kw: ``field=function`` pairs.
        """
        return self.compose(filters.map_dict(handler=handler, **kw))

    def select(self, predicate: Callable, **kw: Any) -> Any:
        """Keep the samples for which ``predicate(sample)`` is true; yields them unchanged.  For example
        ``ds.select(lambda s: s["cls"] < 10)``; see :func:`wds_cloud.filters.select`.

        :param predicate: a function of a sample; a true result keeps it.
        """
        return self.compose(filters.select(predicate, **kw))

    def to_tuple(self, *args: str, **kw: Any) -> Any:
        """Turn dict samples into tuples: yields one tuple per sample, its elements the fields named.  For example
        ``ds.to_tuple("jpg;png", "cls")`` gives ``(image, label)``; see :func:`wds_cloud.filters.to_tuple` for
        the shapes a field may take and the options (``handler``, ``missing_is_error``, ``none_is_error``).

        :param args: one field per element (alternatives joined by ``;``), or one string of space-separated fields.
        """
        return self.compose(filters.to_tuple(*args, **kw))

    def map_tuple(self, *args: Optional[Callable], handler: Callable = reraise_exception) -> Any:
        """Apply a function per element of tuple samples: yields each tuple with element ``i`` replaced by
        ``args[i](element)``.  For example ``ds.to_tuple("jpg", "cls").map_tuple(preprocess, int)``.

        :param args: a function per element, or None to leave that element alone.
        :param handler: called with the exception a function raised: true skips the sample, false stops.
        """
        return self.compose(filters.map_tuple(*args, handler=handler))

    def slice(self, *args: Any) -> Any:
        """Yields the samples ``itertools.islice`` gives.  For example ``ds.slice(100)`` (the first 100),
        ``ds.slice(10, None, 2)``.

        :param args: ``stop``, or ``start, stop`` and an optional ``step``.
        """
        return self.compose(filters.slice(*args))

    def rename(self, **kw: Any) -> Any:
        """Rename fields: yields each sample with its fields renamed.  For example
        ``ds.rename(image="jpg;png", label="cls")``; see :func:`wds_cloud.filters.rename` (``keep=False`` keeps
        only the renamed fields).

        :param kw: ``new=old`` pairs: the new name and the old name or its alternatives.
        """
        return self.compose(filters.rename(**kw))

    def rsample(self, p: float = 0.5, seed: Any = None) -> Any:
        """Keep each sample with probability ``p``; yields those kept.  For example ``ds.rsample(0.1)``.

        :param p: the probability of keeping a sample, from 0 to 1.
        :param seed: with a seed the stage is resumable (see :func:`wds_cloud.filters.rsample`).
        """
        return self.compose(filters.rsample(p, seed=seed))

    def rename_keys(self, *args: Any, **kw: Any) -> Any:
        """Rename fields by glob pattern: yields each sample with the matching fields renamed.  For example
        ``ds.rename_keys(image="*.jpg", label="*.cls")``; see :func:`wds_cloud.filters.rename_keys` for the
        options."""
        return self.compose(filters.rename_keys(*args, **kw))

    def extract_keys(self, *args: Any, **kw: Any) -> Any:
        """A tuple per sample, of the fields that glob patterns match.  For example
        ``ds.extract_keys("*.jpg;*.png", "cls")``; see :func:`wds_cloud.filters.extract_keys` for the options."""
        return self.compose(filters.extract_keys(*args, **kw))

    def xdecode(self, *args: Any, **kw: Any) -> Any:
        """Decode fields by glob pattern: yields each sample with its fields decoded.  For example
        ``ds.xdecode(png=my_png_reader)``; see :func:`wds_cloud.filters.xdecode`."""
        return self.compose(filters.xdecode(*args, **kw))

    def mcached(self) -> Any:
        """Keep the samples of the first pass in memory and replay them on later passes; yields the samples.  For
        example ``ds.slice(1000).mcached()`` (only for what fits in memory)."""
        return self.compose(filters.Cached())

    def lmdb_cached(self, *args: Any, **kw: Any) -> Any:
        """Cache the samples of the first pass in an LMDB file and replay them from it on later passes (needs the
        ``lmdb`` module; samples are stored with pickle, so this is refused under ``WDS_SECURE=1``).  For example
        ``ds.lmdb_cached("/tmp/cache.lmdb")``; the arguments are :class:`wds_cloud.filters.LMDBCached`'s."""
        return self.compose(filters.LMDBCached(*args, **kw))


class FluidWrapper(DataPipeline, FluidInterface):
    """Give any iterable the fluent methods: ``FluidWrapper(dataset).batched(16)``."""

    def __init__(self, initial: Any) -> None:
        super().__init__()
        self.append(initial)
