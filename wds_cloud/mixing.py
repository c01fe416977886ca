"""Weighted mixing of several sources into one stream, resumable exactly (``WebDataset("train.yaml")``).

Each source of a :class:`~wds_cloud.spec.DatasetSpec` is a :class:`~wds_cloud.compat.WebDataset` of its
own (its shards split over ranks and DataLoader workers like any dataset's, its own storage options,
shuffle and reader); :class:`MixSource` draws the next sample from one of them with probability
proportional to its weight.  The draws come from one RNG per (seed, epoch, rank, worker), so a run
is reproducible; a source that runs out leaves the mix (its weight shared among the others) when the
spec gives ``samples_per_epoch``, and otherwise ends the epoch, so the shares stay what the weights say.

Resume: the state holds every source's own state (reader position, shuffle buffer) and, for the mix,
the samples drawn this pass, the RNG draws made (the RNG is replayed that far, a few ms per 100k
samples) and the sources that ran out.  Every sample carries ``__source__``, the name of its source.
"""

from __future__ import annotations

import bisect
import itertools
import random
from typing import Any, Iterator, Optional

from . import compat, config, shardlists
from .errors import StateMismatchError
from .handlers import reraise_exception
from .io.profiles import named_profile
from .pipeline import DataPipeline
from .spec import load_spec
from .stages import PipelineStage
from .utils import make_seed, pytorch_worker_info

__all__ = ["MixSource", "MixStats", "MixedDataset", "from_spec", "STATE_FORMAT"]

STATE_FORMAT = "wds_cloud.mix/1"


class MixStats:
    """What a mix drew in this process: per source its samples, payload bytes, share, and target share."""

    def __init__(self, names: list[str], weights: list[float]) -> None:
        total = sum(weights)
        self.names = names
        self.targets = [w / total for w in weights]
        self.samples = [0] * len(names)
        self.bytes = [0] * len(names)

    def snapshot(self) -> dict:
        """``{"sources": {name: {"samples", "bytes", "share", "target"}}, "samples", "bytes"}``."""
        total = sum(self.samples)
        return {
            "sources": {name: {"samples": n, "bytes": b, "share": (n / total) if total else 0.0, "target": t}
                        for name, n, b, t in zip(self.names, self.samples, self.bytes, self.targets)},
            "samples": total, "bytes": sum(self.bytes)}

    def __repr__(self) -> str:
        snap = self.snapshot()
        shares = ", ".join(f"{name} {s['share']:.1%} (target {s['target']:.1%})" for name, s in snap["sources"].items())
        return f"<MixStats {snap['samples']} samples: {shares}>"


class _Pass:
    """Where the current pass stands (the live counters a state is taken from)."""

    __slots__ = ("number", "count", "draws", "dropped")

    def __init__(self, number: int, count: int = 0, draws: int = 0, dropped: Optional[list] = None) -> None:
        self.number, self.count, self.draws, self.dropped = number, count, draws, list(dropped or ())


class MixSource(PipelineStage):
    """The source stage of a mixed dataset: samples drawn from ``datasets`` by ``weights``.

    ``resampled[i]``: source i never runs out (its shards are drawn with replacement).
    ``samples_per_epoch``: the epoch's samples over all ranks and workers (each slot yields its share);
    None: a pass ends when a source that is not resampled ends.
    """

    def __init__(self, names: list[str], datasets: list[Any], weights: list[float], resampled: list[bool],
                 seed: int, samples_per_epoch: Optional[int] = None) -> None:
        self.names = names
        self.datasets = datasets
        self.weights = weights
        self.resampled = resampled
        self.seed = seed
        self.samples_per_epoch = samples_per_epoch
        self.stats = MixStats(names, weights)
        self._passes = 0  # the number of the next pass
        self._live: Optional[_Pass] = None
        self._resume: Optional[dict] = None

    # the SampleSource role: nothing to wire (a shuffle after the mix is fed by several readers)
    def feeding_source(self) -> None:
        return None

    def _quota(self) -> Optional[int]:
        if self.samples_per_epoch is None:
            return None
        rank, world_size, worker, num_workers = pytorch_worker_info()
        slots = max(1, world_size) * max(1, num_workers)
        slot = rank * max(1, num_workers) + worker
        return self.samples_per_epoch // slots + (1 if slot < self.samples_per_epoch % slots else 0)

    def run(self, *args: Any) -> Iterator[dict]:
        resume, self._resume = self._resume, None
        if resume is not None:
            live = _Pass(resume["pass"], resume["count"], resume["draws"], resume["dropped"])
        else:
            live = _Pass(self._passes)
        self._passes = live.number + 1
        self._live = live
        return self._mix(live)

    def _mix(self, live: _Pass) -> Iterator[dict]:
        rank, _, worker, _ = pytorch_worker_info()
        rng = random.Random(make_seed(self.seed, live.number, rank, worker))
        for _ in range(live.draws):  # the draws made before the state was taken
            rng.random()
        quota = self._quota()
        names, stats_samples, stats_bytes = self.names, self.stats.samples, self.stats.bytes
        iterators = [iter(ds) for ds in self.datasets]
        active = [i for i in range(len(names)) if i not in live.dropped]

        def table() -> list[float]:
            total = sum(self.weights[i] for i in active)
            return list(itertools.accumulate(self.weights[i] / total for i in active))

        bounds = table()
        while active and (quota is None or live.count < quota):
            live.draws += 1
            k = bisect.bisect_right(bounds, rng.random())
            i = active[min(k, len(active) - 1)]
            try:
                sample = next(iterators[i])
            except StopIteration:
                if quota is None and not self.resampled[i]:
                    return  # no samples_per_epoch: the epoch ends with the first source to end
                live.dropped.append(i)
                active.remove(i)
                if active:
                    bounds = table()
                continue
            live.count += 1
            stats_samples[i] += 1
            stats_bytes[i] += sum(len(v) for v in sample.values() if isinstance(v, (bytes, bytearray)))
            sample["__source__"] = names[i]
            yield sample

    # the Resumable protocol (wds_cloud.resume.protocol)
    def state_dict(self) -> dict:
        if self._resume is not None:
            return dict(self._resume)
        live = self._live
        if live is None:
            return self.next_pass_state()
        return {"format": STATE_FORMAT, "names": list(self.names), "pass": live.number, "count": live.count,
                "draws": live.draws, "dropped": list(live.dropped),
                "sources": [ds.state_dict(strict=True) for ds in self.datasets]}

    def next_pass_state(self) -> dict:
        if self._resume is not None:
            return dict(self._resume)
        return {"format": STATE_FORMAT, "names": list(self.names), "pass": self._passes, "count": 0, "draws": 0,
                "dropped": [], "sources": [ds.state_dict(strict=True) for ds in self.datasets]}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise StateMismatchError(f"not the state of a mixed dataset ({STATE_FORMAT}): {str(state)[:80]!r}")
        if state.get("names") != list(self.names):
            raise StateMismatchError(f"the state was saved by a mix of the sources {state.get('names')!r}; this one "
                                     f"mixes {list(self.names)!r}: resume with the spec the state was saved with")
        for key in ("pass", "count", "draws"):
            if type(state.get(key)) is not int or state[key] < 0:
                raise StateMismatchError(f"the mix state's {key!r} is {state.get(key)!r}, not a count")
        dropped = state.get("dropped")
        if not isinstance(dropped, list) or not all(type(i) is int and 0 <= i < len(self.names) for i in dropped):
            raise StateMismatchError(f"the mix state's 'dropped' is {dropped!r}, not a list of source numbers")
        sources = state.get("sources")
        if not isinstance(sources, list) or len(sources) != len(self.datasets):
            raise StateMismatchError("the mix state does not hold one state per source")
        for ds, source_state in zip(self.datasets, sources):
            ds.load_state_dict(source_state)
        self._resume = dict(state)


def _source_options(source: Any, storage_options: Optional[dict]) -> Optional[dict]:
    """A source's storage options: its named profile, then its own options, then the dataset's."""
    options: dict = {}
    if source.profile:
        options.update(named_profile(source.profile, config.current()))
    options.update(source.storage_options or {})
    options.update(storage_options or {})
    return options or None


class MixedDataset(compat.WebDataset):
    """Samples of several sources mixed by weight, from a spec (``WebDataset("train.yaml")``,
    :func:`wds_cloud.from_spec`); chain stages on it as on any WebDataset.

    ``seed=`` applies where the spec has none (then ``WDS_SEED``, then 0).  The other keyword arguments
    of WebDataset (handler, cache_dir, timeout, ...) apply to every source; ``storage_options=``
    over each source's own.  ``stats`` reports samples, bytes and share per source.
    """

    def __init__(self, urls: Any, handler: Any = reraise_exception, seed: Optional[int] = None,
                 storage_options: Optional[dict] = None, nodesplitter: Any = shardlists.split_by_node,
                 **kwargs: Any) -> None:
        DataPipeline.__init__(self)
        spec = load_spec(urls, storage_options)
        settings = config.current()
        base_seed = spec.seed if spec.seed is not None else (
            seed if seed is not None else (settings.seed if settings.seed is not None else 0))
        self.seed = base_seed
        self.spec = spec
        self.storage_options = storage_options
        kwargs.pop("shardshuffle", None)  # per source, in the spec
        kwargs.pop("resampled", None)
        datasets = []
        for number, source in enumerate(spec.sources):
            ds = compat.WebDataset(list(source.urls), handler=handler, resampled=source.resampled,
                                   shardshuffle=source.shardshuffle and not source.resampled,
                                   seed=make_seed(base_seed, number, source.name), nodesplitter=nodesplitter,
                                   storage_options=_source_options(source, storage_options), **kwargs)
            if source.shuffle:
                ds = ds.shuffle(source.shuffle, seed=make_seed(base_seed, "shuffle", source.name))
            datasets.append(ds)
        self.sources = datasets
        self._mix = MixSource([s.name for s in spec.sources], datasets, [s.weight for s in spec.sources],
                              [s.resampled for s in spec.sources], base_seed, spec.samples_per_epoch)
        self.append(self._mix)

    @property
    def stats(self) -> Any:  # type: ignore[override]
        """Per source: samples, payload bytes, share and target share drawn in this process (each
        DataLoader worker counts its own; every sample also names its source in ``__source__``), and
        each source's transfer figures under ``"transfer"``."""
        snap = self._mix.stats.snapshot()
        for name, ds in zip(self._mix.names, self.sources):
            snap["sources"][name]["transfer"] = ds.stats
        return snap

    def close(self) -> None:
        for ds in self.sources:
            ds.close()
        super().close()

    def __repr__(self) -> str:
        return f"<MixedDataset {self.spec.where}: {', '.join(s.name for s in self.spec.sources)}>"


def from_spec(spec: Any, **kwargs: Any) -> MixedDataset:
    """A mixed dataset from a spec: a dict (trusted, as code), or the URL/path of a YAML/JSON file (data).

    ``kwargs`` are WebDataset's (``handler``, ``seed``, ``cache_dir``, ``storage_options``, ...).
    """
    return MixedDataset(spec, **kwargs)
