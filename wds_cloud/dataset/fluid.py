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
        return self.compose(filters.batched(batchsize, collation_fn=collation_fn, partial=partial))

    def unbatched(self) -> Any:
        return self.compose(filters.unbatched())

    def listed(self, batchsize: int, partial: bool = True) -> Any:
        return self.compose(filters.batched(batchsize, collation_fn=None, partial=partial))

    def unlisted(self) -> Any:
        return self.compose(filters.unlisted())

    def log_keys(self, logfile: Optional[str] = None) -> Any:
        return self.compose(filters.log_keys(logfile))

    def shuffle(self, size: int, **kw: Any) -> Any:
        """A sample shuffle of ``size`` samples.  In a dataset given a seed (``WebDataset(url, seed=S)``,
        ``WDS_SEED``, or a spec's ``seed:``), a shuffle given neither ``seed`` nor ``rng`` is seeded from it and
        from the epoch, so the same ``S`` gives the same order (webdataset seeds it from the clock)."""
        # a plain int before it is compared or saved in a state (numpy's, 1e3); 0: no shuffle, as in webdataset;
        # a negative size is refused, as every negative count is (issue 41)
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
        return self.compose(filters.map_dict(handler=handler, **kw))

    def select(self, predicate: Callable, **kw: Any) -> Any:
        return self.compose(filters.select(predicate, **kw))

    def to_tuple(self, *args: str, **kw: Any) -> Any:
        return self.compose(filters.to_tuple(*args, **kw))

    def map_tuple(self, *args: Optional[Callable], handler: Callable = reraise_exception) -> Any:
        return self.compose(filters.map_tuple(*args, handler=handler))

    def slice(self, *args: Any) -> Any:
        return self.compose(filters.slice(*args))

    def rename(self, **kw: Any) -> Any:
        return self.compose(filters.rename(**kw))

    def rsample(self, p: float = 0.5) -> Any:
        return self.compose(filters.rsample(p))

    def rename_keys(self, *args: Any, **kw: Any) -> Any:
        return self.compose(filters.rename_keys(*args, **kw))

    def extract_keys(self, *args: Any, **kw: Any) -> Any:
        return self.compose(filters.extract_keys(*args, **kw))

    def xdecode(self, *args: Any, **kw: Any) -> Any:
        return self.compose(filters.xdecode(*args, **kw))

    def mcached(self) -> Any:
        return self.compose(filters.Cached())

    def lmdb_cached(self, *args: Any, **kw: Any) -> Any:
        return self.compose(filters.LMDBCached(*args, **kw))


class FluidWrapper(DataPipeline, FluidInterface):
    """Give any iterable the fluent methods: ``FluidWrapper(dataset).batched(16)``."""

    def __init__(self, initial: Any) -> None:
        super().__init__()
        self.append(initial)
