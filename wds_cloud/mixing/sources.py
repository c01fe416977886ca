"""Weighted mixing of several sources into one stream, resumable exactly (``WebDataset("train.yaml")``).

The dataset class, :class:`~wds_cloud.compat.MixedDataset`, lives beside WebDataset (which opens a spec
as one); this module holds the stage that draws the samples.

Each source of a :class:`~wds_cloud.mixing.spec.DatasetSpec` is a :class:`~wds_cloud.dataset.webdataset.WebDataset` of its
own (its shards split over ranks and DataLoader workers like any dataset's, its own storage options,
shuffle and reader); :class:`MixSource` draws the next sample from one of them with probability
proportional to its weight.  The draws come from one RNG per (seed, epoch, rank, worker), so a run
is reproducible; a source that runs out leaves the mix (its weight shared among the others) when the
spec gives ``samples_per_epoch``, and otherwise ends the epoch, so the shares stay what the weights say.

Resume: the state holds every source's own state (reader position, shuffle buffer) and, for the mix,
the samples drawn this pass, the RNG draws made (a counted generator: restored by re-seeding and skipping
fewer than 4,096 draws, whatever the count) and the sources that ran out.  A state is input: its counts
must agree with each other (draws = samples + sources ended) and with the spec before anything is replayed.  Every sample carries ``__source__``, the name of its source.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from typing import Any, Optional

from ..errors import StateMismatchError
from ..io.datafile import shown
from ..resume.arguments import as_count, as_seed, as_weights
from ..resume.rng import MAX_COUNT, CountedRandom
from ..resume.state import SEAL, check_seal, refuse_unknown, seal
from ..stages import PassHolder, PipelineStage, for_pipeline
from ..utils import make_seed, pytorch_worker_info

__all__ = ["MixSource", "MixStats", "ReplayedSources", "STATE_FORMAT"]

STATE_FORMAT = "wds_cloud.mix/2"  # 2: draws from a CountedRandom (bounded replay)


class MixStats:
    """What a mix drew in this process: per source its samples, payload bytes, share, and target share."""

    def __init__(self, names: list[str], weights: list[float]) -> None:
        total = sum(weights)
        self.names = names
        self.targets = [w / total for w in weights]
        self.earlier = [0] * len(names)  # samples of the passes before the current one
        self.current = [0] * len(names)  # the current pass's (the live list the mix counts in)
        self.before = [0] * len(names)  # what ``current`` held when the pass began (a resumed pass's counts)
        self.bytes = [0] * len(names)

    def new_pass(self, taken: list[int]) -> None:
        """Count in ``taken`` from now on (a resumed pass's list starts at the counts of its state, which
        were drawn by the process that saved it: they are left out here)."""
        self.earlier = [a + b - c for a, b, c in zip(self.earlier, self.current, self.before)]
        self.before = list(taken)
        self.current = taken

    @property
    def samples(self) -> list[int]:
        return [a + b - c for a, b, c in zip(self.earlier, self.current, self.before)]

    def snapshot(self) -> dict:
        """``{"sources": {name: {"samples", "bytes", "share", "target"}}, "samples", "bytes"}``."""
        samples = self.samples
        total = sum(samples)
        return {
            "sources": {
                name: {"samples": n, "bytes": b, "share": (n / total) if total else 0.0, "target": t}
                for name, n, b, t in zip(self.names, samples, self.bytes, self.targets)
            },
            "samples": total,
            "bytes": sum(self.bytes),
        }

    def __repr__(self) -> str:
        snap = self.snapshot()
        shares = ", ".join(f"{name} {s['share']:.1%} (target {s['target']:.1%})" for name, s in snap["sources"].items())
        return f"<MixStats {snap['samples']} samples: {shares}>"


class _Pass:
    """Where the current pass stands (the live counters a state is taken from): the samples taken from each
    source, the draws that met a source already ended, and the sources that ran out."""

    __slots__ = ("number", "taken", "misses", "dropped", "quota")

    def __init__(
        self,
        number: int,
        taken: list[int],
        misses: int = 0,
        dropped: Optional[list] = None,
        quota: Optional[int] = None,
    ) -> None:
        self.number, self.taken, self.misses, self.dropped = number, taken, misses, list(dropped or ())
        #: after an elastic resume: what this rank and worker draws in the rest of the pass (else None)
        self.quota = quota

    @property
    def count(self) -> int:
        return sum(self.taken)

    @property
    def draws(self) -> int:
        return sum(self.taken) + self.misses


class ReplayedSources(PassHolder):
    """The sample-source role of a stage that mixes datasets (:class:`MixSource`, :class:`~wds_cloud.mix.RandomMix`):
    a sample shuffle after the mix records where each sample came from through ``cursor`` (the cursor of
    the reader of the source drawn last, its shard refs made unique over the sources), and gets its buffer
    back through ``set_replay`` (each source's reader fetches its own samples again, and the mix yields them
    in buffer order, from ``_replay``, before drawing on).  The class sets ``datasets``, ``_cursor = None``,
    ``_replay = None``, and calls ``_replayed`` at the start of each pass.

    A pipeline holds a copy of its own, with copies of the datasets (see :class:`~wds_cloud.stages.PassHolder`):
    a mix put in two pipelines never shares a pass, its own or a source's."""

    PASS_FIELDS = {"_live": None, "_cursor": None}
    COPIED_FIELDS = ("_resume", "_replay", "_elastic", "stats")

    def __copy__(self) -> Any:
        made = super().__copy__()
        made.datasets = [for_pipeline(ds) for ds in self.datasets]
        return made

    datasets: list
    names: list
    _cursor: Optional[_MixCursor]
    _replay: Optional[list]

    #: what a sample shuffle after the mix should be instead (said when its state cannot be exact: a source
    #: keeps a shuffle buffer of its own, whose samples no reader's cursor names)
    shuffle_after_fix = (
        "shuffle in one place: either after the mix (drop 'shuffle: N' from the spec's sources) "
        "or inside each source (give each source 'shuffle: N', see docs/specs.md, and no "
        "sample shuffle after the mix)"
    )

    @property
    def replayable(self) -> bool:
        """Whether every source's output comes straight from its shard reader (no buffer of its own)."""
        return all(_reader_of(ds) is not None for ds in self.datasets)

    @property
    def cursor(self) -> Optional[_MixCursor]:
        if self._cursor is None and self.replayable:
            self._cursor = _MixCursor([_reader_of(ds) for ds in self.datasets])
        return self._cursor

    def set_replay(self, locations: Any) -> None:
        """Yield the samples at ``locations`` (``(url, start, end, compressed, ref)``, refs of this mix's cursor)
        first on the next pass, in that order, without drawing."""
        n = len(self.datasets)
        per: list[list] = [[] for _ in range(n)]
        order = []
        for url, start, end, compressed, ref in locations:
            if type(ref) is not int or ref < 0:
                raise StateMismatchError(
                    f"the saved shuffle state names the shard ref {shown(ref)}, which no mix "
                    "gives: the state was changed",
                    field="buffer",
                )
            source = ref % n
            per[source].append((url, start, end, compressed, ref // n))
            order.append(source)
        for ds, replay in zip(self.datasets, per):
            if replay:
                reader = _reader_of(ds)
                if reader is None:
                    raise StateMismatchError(
                        "the saved state has samples of a mix in a shuffle buffer, but a source "
                        f"of this mix keeps a buffer of its own: {self.shuffle_after_fix}"
                    )
                reader.set_replay(replay)
        self._replay = order

    def shard_urls(self) -> dict:
        """The shard URLs the sources' shard lists name, by text (to check a replayed state against)."""
        urls: dict = {}
        for ds in self.datasets:
            if callable(getattr(ds, "shard_urls", None)):
                urls.update(ds.shard_urls())
        return urls

    @staticmethod
    def _confirm_ended(nexts: list, sources: list, what: str, every: bool = True) -> int:
        """How many of ``sources`` (left out of the mix by a loaded state, as ended) have ended; with ``every``,
        one that still gives a sample is refused: a state sealed again after a source was taken out of the mix
        would otherwise drop that source's samples, silently."""
        ended = 0
        for i in sources:
            try:
                nexts[i]()
            except StopIteration:
                ended += 1
                continue
            if every:
                raise StateMismatchError(
                    f"the saved {what} state leaves source {i} out of the mix as ended, but it still has "
                    "samples: the state was changed (that source's samples would never come); load the state "
                    "that state_dict() returned",
                    field="active",
                )
        return ended

    def _replayed(self, nexts: list, label: Optional[list] = None) -> Iterator[dict]:
        """The samples of a resumed shuffle's buffer, fetched again by the sources' readers, in buffer order (not
        drawn, not counted); ``label``: the names to put in ``__source__``."""
        cursor = self._cursor
        replay, self._replay = self._replay, None
        for i in replay or ():
            try:
                sample = nexts[i]()
            except StopIteration:
                raise StateMismatchError(
                    f"source {i} of the mix gave fewer samples than the saved shuffle buffer "
                    "holds from it: the state was changed"
                ) from None
            if cursor is not None:
                cursor.current = i
            if label is not None:
                sample["__source__"] = label[i]
            yield sample


class MixSource(ReplayedSources, PipelineStage):
    """The source stage of a mixed dataset: samples drawn from ``datasets`` by ``weights``.

    ``resampled[i]``: source i never runs out (its shards are drawn with replacement).
    ``samples_per_epoch``: the epoch's samples over all ranks and workers (each slot yields its share);
    None: a pass ends when a source that is not resampled ends.
    """

    def __init__(
        self,
        names: list[str],
        datasets: list[Any],
        weights: list[float],
        resampled: list[bool],
        seed: int,
        samples_per_epoch: Optional[int] = None,
    ) -> None:
        self.names = names
        self.datasets = datasets
        self.weights = as_weights("weights", weights, len(names))
        self.resampled = [bool(r) for r in resampled]
        self.seed = as_seed("seed", seed)
        self.samples_per_epoch = (
            None if samples_per_epoch is None else as_count("samples_per_epoch", samples_per_epoch, 1)
        )
        self.stats = MixStats(names, weights)
        self._passes = 0  # the number of the next pass
        self._live: Optional[_Pass] = None
        self._resume: Optional[dict] = None
        self._cursor: Optional[_MixCursor] = None
        self._replay: Optional[list] = None  # the source of each sample to yield again first (see set_replay)
        self._elastic: Optional[tuple] = None  # (pass, quota) of an elastic resume's share, for the next pass

    def _quota(self) -> Optional[int]:
        if self.samples_per_epoch is None:
            return None
        rank, world_size, worker, num_workers = pytorch_worker_info()
        slots = max(1, world_size) * max(1, num_workers)
        slot = rank * max(1, num_workers) + worker
        return self.samples_per_epoch // slots + (1 if slot < self.samples_per_epoch % slots else 0)

    def run(self, *args: Any) -> Iterator[dict]:
        resume, self._resume = self._resume, None
        elastic, self._elastic = self._elastic, None
        if resume is not None:
            live = _Pass(
                resume["pass"],
                list(resume["taken"]),
                resume["draws"] - resume["count"],
                resume["dropped"],
                resume.get("quota"),
            )
        elif elastic is not None:
            live = _Pass(elastic[0], [0] * len(self.names), quota=elastic[1])
        else:
            live = _Pass(self._passes, [0] * len(self.names))
        self._passes = live.number + 1
        self.stats.new_pass(live.taken)
        self._live = live
        return self._mix(live)

    def _mix(self, live: _Pass) -> Iterator[dict]:
        rank, _, worker, _ = pytorch_worker_info()
        # a counted generator: the draws made before a state was taken are restored by re-seeding a block and
        # skipping fewer than 4,096, whatever count a state claims (a replay is bounded)
        # after an elastic resume the draws of this share are its own (another sequence than the slot's first)
        salt = () if live.quota is None else ("elastic",)
        rng = CountedRandom(make_seed(self.seed, live.number, rank, worker, *salt), live.draws)
        quota = self._quota() if live.quota is None else live.quota
        if quota is not None and live.count > quota:
            raise StateMismatchError(
                f"the mix state counts {live.count} samples taken this pass, more than this "
                f"worker's share of samples_per_epoch ({quota}): load the state state_dict() "
                "returned, into a loader of the same shape",
                field="count",
            )
        names, taken, stats_bytes = self.names, live.taken, self.stats.bytes
        iterators = [iter(ds) for ds in self.datasets]
        active = [i for i in range(len(names)) if i not in live.dropped]

        def table() -> list[float]:
            total = sum(self.weights[i] for i in active)
            return list(itertools.accumulate(self.weights[i] / total for i in active))

        bounds = table()
        last = len(active) - 1
        nexts = [it.__next__ for it in iterators]
        cursor = self._cursor
        later = set(self._replay or ()) if live.dropped else set()
        self._confirm_ended(nexts, [i for i in live.dropped if i not in later], "mix")
        yield from self._replayed(nexts, names)
        self._confirm_ended(nexts, [i for i in live.dropped if i in later], "mix")
        draw = rng.random
        bytes_type = bytes
        # one loop, its names local: this runs once per sample (bench_mix.py measures it against no mix)
        count = live.count
        limit = quota if quota is not None else -1
        while last >= 0 and count != limit:
            k = bisect.bisect_right(bounds, draw())
            i = active[k if k <= last else last]
            try:
                sample = nexts[i]()
            except StopIteration:
                if quota is None and not self.resampled[i]:
                    return  # no samples_per_epoch: the epoch ends with the first source to end
                live.misses += 1
                live.dropped.append(i)
                active.remove(i)
                last -= 1
                if active:
                    bounds = table()
                continue
            count += 1
            taken[i] += 1
            size = 0
            for value in sample.values():
                if type(value) is bytes_type:
                    size += len(value)
            stats_bytes[i] += size
            sample["__source__"] = names[i]
            if cursor is not None:
                cursor.current = i
            yield sample

    # the Resumable protocol (wds_cloud.resume.protocol)
    def state_dict(self) -> dict:
        if self._resume is not None:
            return dict(self._resume)
        live = self._live
        if live is None:
            return self.next_pass_state()
        state = {
            "format": STATE_FORMAT,
            "names": list(self.names),
            "pass": live.number,
            "count": live.count,
            "draws": live.draws,
            "taken": list(live.taken),
            "dropped": list(live.dropped),
            "sources": [ds.state_dict(strict=True) for ds in self.datasets],
        }
        if live.quota is not None:
            state["quota"] = live.quota
        return seal(state)

    # elastic resume (wds_cloud.resume.elastic)
    def check_merged_mix(self, mix: dict) -> None:
        """Refuse the mix part of a merged state taken from another spec, naming what differs."""
        if mix.get("names") != list(self.names):
            raise StateMismatchError(
                f"the merged state was taken from a mix of the sources {shown(mix.get('names'))}; "
                f"this one mixes {list(self.names)!r}: resume with the spec it was saved with",
                field="names",
            )
        for ds, level in zip(self.datasets, mix["sources"]):
            ds.check_level(level)

    def mix_start(self, mix: dict, rank: int, world_size: int, worker: int, workers: int) -> dict:
        """A rank and worker's start in a merged mix: each source's start, and its share of what the epoch still
        owes (``samples_per_epoch``, or the shares of an earlier elastic resume, less what was drawn, plus the
        samples a shuffle after the mix held, which are drawn again from the front of their sources)."""
        sources = [
            ds.start_of_level(level, rank, world_size, worker, workers)
            for ds, level in zip(self.datasets, mix["sources"])
        ]
        quota = None
        if self.samples_per_epoch is not None:
            owed = mix.get("quota", self.samples_per_epoch)
            left = max(0, owed - mix["count"]) + sum(level.get("outer") or 0 for level in mix["sources"])
            slot, slots = rank * workers + worker, world_size * workers
            quota = left // slots + (1 if slot < left % slots else 0)
        return {"names": list(self.names), "pass": mix["pass"], "quota": quota, "sources": sources}

    def apply_mix_start(self, start: dict) -> None:
        """Begin the next pass from a start made by :meth:`mix_start`."""
        if not (
            isinstance(start, dict)
            and type(start.get("pass")) is int
            and start["pass"] >= 0
            and (start.get("quota") is None or (type(start["quota"]) is int and start["quota"] >= 0))
            and isinstance(start.get("sources"), list)
            and len(start["sources"]) == len(self.datasets)
        ):
            raise StateMismatchError(
                f"the saved mix start {shown(start)} is not one a merged state gives: the state was changed",
                field="mix",
            )
        for ds, source in zip(self.datasets, start["sources"]):
            ds.apply_level_start(source)
        self._elastic = (start["pass"], start.get("quota"))
        self._resume = None

    def next_pass_state(self) -> dict:
        if self._resume is not None:
            return dict(self._resume)
        state = {
            "format": STATE_FORMAT,
            "names": list(self.names),
            "pass": self._passes,
            "count": 0,
            "draws": 0,
            "taken": [0] * len(self.names),
            "dropped": [],
            "sources": [ds.next_pass_state() for ds in self.datasets],
        }  # each source's next pass, too
        return seal(state)

    def load_state_dict(self, state: dict) -> None:
        """Check ``state`` field by field (its counts against each other and the spec) and its checksum, then
        hand each source its own state; the sources it says ended are confirmed when the pass begins."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise StateMismatchError(f"not the state of a mixed dataset ({STATE_FORMAT}): {shown(state)}")
        if SEAL not in state:
            raise StateMismatchError(
                "the saved mix state has no checksum: it was taken by an earlier version of wds_cloud (before "
                "mix states carried one) or edited; take a new state with state_dict(), or start the pass again",
                field=SEAL,
            )
        refuse_unknown(state, _STATE_KEYS, "mix")
        if state.get("names") != list(self.names):
            raise StateMismatchError(
                f"the state was saved by a mix of the sources {shown(state.get('names'))}; this one "
                f"mixes {list(self.names)!r}: resume with the spec the state was saved with",
                field="names",
            )
        for key in ("pass", "count", "draws"):
            if type(state.get(key)) is not int or not 0 <= state[key] < MAX_COUNT:
                raise StateMismatchError(f"the mix state's {key!r} is {shown(state.get(key))}, not a count", field=key)
        taken = state.get("taken")
        if (
            not isinstance(taken, list)
            or len(taken) != len(self.names)
            or not all(type(n) is int and n >= 0 for n in taken)
            or sum(taken) != state["count"]
            or state["draws"] < state["count"]
        ):
            raise StateMismatchError(
                f"the mix state's 'taken' ({shown(taken)}) does not fit its count and draws", field="taken"
            )
        if self.samples_per_epoch is not None and state["count"] > self.samples_per_epoch:
            raise StateMismatchError(
                f"the mix state counts {state['count']} samples taken this pass, more than the spec's "
                f"samples_per_epoch ({self.samples_per_epoch}): the state was changed",
                field="count",
            )
        dropped = state.get("dropped")
        quota = state.get("quota")
        if (
            not isinstance(dropped, list)
            or not all(type(i) is int and 0 <= i < len(self.names) for i in dropped)
            or len(set(dropped)) != len(dropped)
            or any(self.resampled[i] for i in dropped)
            # without samples_per_epoch the first source to end ends the pass: none leaves the mix
            or (dropped and self.samples_per_epoch is None and quota is None)
        ):
            raise StateMismatchError(
                f"the mix state's 'dropped' is {shown(dropped)}, not a list of the sources that ended this pass",
                field="dropped",
            )
        if "quota" in state and (type(quota) is not int or not state["count"] <= quota < MAX_COUNT):
            raise StateMismatchError(
                f"the mix state's 'quota' is {shown(quota)}, which no state_dict() gives: the state was changed",
                field="quota",
            )
        if state["draws"] != state["count"] + len(dropped):  # every draw takes a sample or finds a source ended
            raise StateMismatchError(
                f"the mix state's 'draws' ({state['draws']}) is not its count ({state['count']}) "
                f"plus the sources that ended ({len(dropped)}): the state was changed",
                field="draws",
            )
        sources = state.get("sources")
        if not isinstance(sources, list) or len(sources) != len(self.datasets):
            raise StateMismatchError("the mix state does not hold one state per source", field="sources")
        check_seal(state, "mix")
        for ds, source_state in zip(self.datasets, sources):
            ds.load_state_dict(source_state)
        self._resume = dict(state)


#: the fields a mix state may have (``quota`` after an elastic resume)
_STATE_KEYS = frozenset(("format", "names", "pass", "count", "draws", "taken", "dropped", "sources", "quota", SEAL))


def _reader_of(dataset: Any) -> Any:
    """The shard reader whose latest sample is ``dataset``'s latest output, or None (a buffer in between)."""
    feeding = getattr(dataset, "feeding_source", None)
    return feeding() if feeding is not None else None


class _MixCursor:
    """Where the sample a mix yielded last came from: its source's reader's cursor, read through, with the
    shard ref made unique over the sources (``ref * sources + source``)."""

    __slots__ = ("readers", "n", "current")

    def __init__(self, readers: list) -> None:
        self.readers = readers
        self.n = len(readers)
        self.current = 0

    @property
    def shard(self) -> int:
        return self.readers[self.current].cursor.shard * self.n + self.current

    @property
    def url(self) -> Any:
        return self.readers[self.current].cursor.url

    @property
    def compressed(self) -> bool:
        return self.readers[self.current].cursor.compressed

    @property
    def position(self) -> Any:
        return self.readers[self.current].cursor.position
