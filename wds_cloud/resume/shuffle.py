"""The resumable shuffle: a buffer of samples whose state names where each came from.

:class:`Shuffle` keeps, beside its buffer, each buffered sample's shard and byte range
(read from the cursor of the shard reader feeding it), so its state is small and a
resumed pass can fetch the same samples again.  For a loader that asks for a state with
every batch it sends changes only (a journal); :func:`apply_journal` replays them.
"""

from __future__ import annotations

import copy
import itertools
import logging
import random
from array import array
from collections.abc import Iterable, Iterator
from typing import Any, Optional

from .. import config
from ..errors import StateMismatchError
from ..io.datafile import MAX_SHARD_BLOCKS, shown
from ..stages import PassHolder, PipelineStage
from ..utils import make_seed
from .arguments import as_count, as_seed, is_seed
from .rng import MAX_COUNT, CountedRandom
from .state import StateURL, check_same, expect, refuse_unknown, shown_url, url_id

__all__ = ["Shuffle", "apply_journal", "buffer_locations"]

log = logging.getLogger(__name__)


class _ShuffleRun:
    """The live part of one pass of a :class:`Shuffle`: its buffer, where each buffered sample came from, its RNG."""

    __slots__ = (
        "buf",
        "locs",
        "urls",
        "counts",
        "rng",
        "tracked",
        "journal",
        "run_id",
        "journaled",
        "urls_list",
        "epoch",
    )

    def __init__(self, rng: Any, epoch: int) -> None:
        self.epoch = epoch  # the epoch this pass was seeded with (a set_epoch() during it is for the next)
        self.buf: list = []
        self.locs: list = []  # (shard ref, first block, blocks) of each buffered sample, in buffer order
        self.urls: dict = {}  # shard ref -> (url, compressed), for the refs in the buffer
        self.counts: dict = {}  # shard ref -> buffered samples from it
        self.rng = rng
        self.tracked = False
        self.journal: Optional[list] = None  # buffer changes since the last delta (see Shuffle.transport_state)
        self.run_id = id(self)
        self.journaled = 0  # journal entries sent since the whole buffer was last sent
        self.urls_list: Optional[list] = None  # ``urls`` as the state lists them, kept while unchanged


class Shuffle(PassHolder, PipelineStage):
    """Shuffle through a buffer of ``bufsize`` samples, starting once ``initial`` are buffered.

    Resumable: when a shard reader feeds it (``source``, wired by ``DataPipeline``),
    the state records the RNG (:class:`~wds_cloud.resume.rng.CountedRandom`: two integers)
    and, for each buffered sample, the shard and byte range it came from; a
    resumed pass gets the same samples back from the reader and puts them in
    the same buffer positions.  ``rng`` (a ``random.Random``) is honoured;
    its state is then saved whole.  Without ``seed`` or ``rng`` each pass draws
    a fresh seed.  ``epoch_seeded=True`` (``detshuffle``) seeds each pass from
    (``seed``, epoch).

    A pipeline runs a copy of its own (see :class:`~wds_cloud.stages.PassHolder`): the buffer and the source
    it reads places from belong to the pass, a loaded state to the copy.
    """

    PASS_FIELDS = {"source": None, "_live": None}
    COPIED_FIELDS = ("_resume",)

    def __init__(
        self,
        bufsize: int = 1000,
        initial: int = 100,
        rng: Optional[random.Random] = None,
        handler: Any = None,
        seed: Any = None,
        epoch_seeded: bool = False,
        epoch: int = -1,
    ) -> None:
        # numbers of any type (numpy's) are made plain here: they go into the state, which is JSON
        self.bufsize = as_count("bufsize", bufsize)
        self.initial = min(as_count("initial", initial), self.bufsize)
        self.rng = rng
        self.seed = as_seed("seed", seed)  # a string of digits (WDS_SEED) is read as its number
        self.epoch_seeded = epoch_seeded
        self.epoch = as_count("epoch", epoch, least=-1)
        self.source: Any = None  # the sample source feeding this shuffle (attached by DataPipeline)
        self._live: Optional[_ShuffleRun] = None
        self._resume: Optional[dict] = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = as_count("epoch", epoch) - 1  # run() advances before use
        for made in self.pipeline_copies():
            made.set_epoch(epoch)

    def _forget_run(self) -> None:
        """No loaded state (a copy has no source or buffer already): what a copy made for another stream starts
        from."""
        self._resume = None

    def for_stream(self, stream: int, streams: int) -> Shuffle:
        """A shuffle of its own for virtual stream ``stream`` (see :mod:`wds_cloud.resume.streams`): a buffer of
        its own, seeded from the seed and the stream's number (a given ``rng`` is copied as it is)."""
        clone = copy.copy(self)
        clone._forget_run()
        if self.seed is not None:
            clone.seed = make_seed(self.seed, "stream", stream)
        elif self.rng is not None:
            clone.rng = copy.deepcopy(self.rng)
        return clone

    # the BufferingStage role (wds_cloud.resume.protocol)
    def attach_source(self, source: Any) -> None:
        self.source = source

    def resume_blocker(self, feeder: str) -> str:
        name = "detshuffle" if self.epoch_seeded else "shuffle"
        return (
            f"({name}(bufsize={self.bufsize})) is not fed by a shard reader of this pipeline ({feeder}), so "
            "the items in its buffer could not be fetched again on resume. To make the pipeline resumable, "
            "read the shards with wds.tarfile_to_samples() (or use WebDataset) before this shuffle; to shuffle "
            "shards, give the shard list a seed (wds.SimpleShardList(urls, seed=...), or "
            "WebDataset(urls, shardshuffle=True)) instead of a shuffle of the shard names before the reader"
        )

    def _make_rng(self) -> Any:
        if self.rng is not None:
            return self.rng
        rng = CountedRandom(make_seed(self.seed, self.epoch) if self.epoch_seeded else self.seed)
        if config.current().show_seed:
            log.info(
                "shuffle(bufsize=%d) seeded with %d%s",
                self.bufsize,
                rng.seed,
                f" (epoch {self.epoch})" if self.epoch_seeded else "",
            )
        return rng

    def run(self, src: Iterable) -> Iterator:
        resume, self._resume = self._resume, None
        if resume is not None and "epoch" in resume:
            self.epoch = resume["epoch"]
        elif self.epoch_seeded:
            self.epoch += 1
        live = _ShuffleRun(self._make_rng(), self.epoch)
        self._live = live
        return self._shuffle(src, live, resume)

    # One generator with its helpers as closures over locals: this runs once per sample, and every
    # attribute lookup or method call saved here is measured in bench_read/bench_loader (hence its length).
    def _shuffle(self, src: Iterable, live: _ShuffleRun, resume: Optional[dict]) -> Iterator:
        buf, locs, urls, counts = live.buf, live.locs, live.urls, live.counts
        cursor = getattr(self.source, "cursor", None)
        live.tracked = cursor is not None
        rng = live.rng
        randbelow = getattr(rng, "randbelow", None) or (lambda n: rng.randint(0, n - 1))
        bufsize, initial = self.bufsize, self.initial

        def add(sample: Any) -> None:
            buf.append(sample)
            if cursor is not None:
                ref = cursor.shard
                if ref in counts:
                    counts[ref] += 1
                else:
                    counts[ref] = 1
                    urls[ref] = (cursor.url, cursor.compressed)
                position = cursor.position
                start = position.start
                loc = (ref, start >> 9, (position.end - start) >> 9)  # tar offsets are in 512-byte blocks
                locs.append(loc)
                if live.journal is not None:
                    live.journal.append(loc)

        def pick() -> Any:
            k = randbelow(len(buf))
            buf[k], buf[-1] = buf[-1], buf[k]
            if cursor is not None:
                locs[k], locs[-1] = locs[-1], locs[k]
                ref = locs.pop()[0]
                counts[ref] -= 1
                if not counts[ref]:
                    del counts[ref], urls[ref]
                if live.journal is not None:
                    live.journal.append((~k,))
            return buf.pop()

        it = iter(src)
        if resume is not None:
            for _ in range(len(resume.get("buffer") or ())):
                try:
                    add(next(it))
                except StopIteration:
                    raise StateMismatchError(
                        "the shuffle buffer could not be refilled on resume: the stages "
                        "between the shard reader and the shuffle dropped samples"
                    ) from None
            if "rng" in resume:
                if isinstance(rng, random.Random):
                    version, internal, gauss = resume["rng"]
                    rng.setstate((version, tuple(internal), gauss))
                else:
                    rng.setstate(resume["rng"])
        for sample in it:
            add(sample)
            if len(buf) < bufsize:
                try:
                    add(next(it))  # grow the buffer while consuming
                except StopIteration:
                    pass
            if len(buf) >= initial:
                yield pick()
        while buf:
            yield pick()

    def _config(self) -> dict:
        return {"bufsize": self.bufsize, "initial": self.initial}

    def state_dict(self) -> dict:
        """The RNG and, for each buffered sample, ``[shard ref, first block, blocks]``: plain JSON.

        Positions are in 512-byte tar blocks (``"block": 512``); ``"urls"`` maps shard refs to URLs.
        """
        if self._resume is not None:  # loaded, not yet iterated: still that state
            return dict(self._resume)
        live = self._live
        if live is None:
            return {"fresh": True, "config": self._config()}
        state = self._head(live)
        state["urls"] = [list(entry) for entry in state["urls"]]  # the live list is shared with transport_state
        state["buffer"] = list(live.locs)  # tuples: JSON arrays
        return state

    def _head(self, live: _ShuffleRun) -> dict:
        if live.buf and not live.tracked:
            raise StateMismatchError(
                "this shuffle is not fed by a shard reader of the same pipeline, so the samples in its buffer "
                "cannot be fetched again on resume; shuffle inside the dataset (WebDataset(...).shuffle(n)), "
                "or take the state where the buffer is empty"
            )
        rng = live.rng.getstate()
        urls = live.urls
        cached = live.urls_list
        if cached is None or len(cached) != len(urls) or any(entry[0] not in urls for entry in cached):
            # redacted, with a hash to match them by: no credential ever reaches a checkpoint
            cached = live.urls_list = [
                [ref, shown_url(url), compressed, url_id(url)] for ref, (url, compressed) in urls.items()
            ]
        state = {
            "config": self._config(),
            # JSON's shapes (lists, not tuples): the state loads the same in memory and after a trip through JSON
            "rng": [list(v) if isinstance(v, tuple) else v for v in rng],
            "urls": cached,
            "block": 512,
        }
        if self.epoch_seeded:
            state["epoch"] = live.epoch
        return state

    def transport_state(self) -> dict:
        """The state as a delta, for a loader that sends one with every batch (see ``compat.WebLoader``).

        The first call of a pass sends the whole buffer (``"buffer"``) and starts a journal;
        later calls send only the journal (``"journal"``: the changes since, in order), which
        :func:`apply_journal` replays onto the previous buffer.  Both are flat integer arrays
        (``array("q")``), which cost a copy of their bytes to pickle where lists of tuples
        cost a call per element: a locations is its three integers, a pick of buffer index
        ``k`` is ``~k`` (negative).
        """
        if self._resume is not None or self._live is None:
            return self.state_dict()
        live = self._live
        state = self._head(live)
        state["run"] = live.run_id
        journal = live.journal
        if journal is None or live.journaled + len(journal) > 8 * len(live.locs) + 1024:
            # the whole buffer again once the journals would outgrow it: what the loader keeps stays bounded
            state["buffer"] = array("q", itertools.chain.from_iterable(live.locs))
            live.journaled = 0
        else:
            # flattened in C: a location is its three integers, a pick of index k the one integer ~k
            state["journal"] = array("q", itertools.chain.from_iterable(journal))
            live.journaled += len(journal)
        live.journal = []
        return state

    def next_pass_state(self) -> dict:
        if self._resume is not None:
            return dict(self._resume)
        state = {"fresh": True, "config": self._config()}
        if self.epoch_seeded:
            state["epoch"] = self.epoch + 1
        return state

    def load_state_dict(self, state: dict) -> None:

        expect(state, "shuffle", dict, config=dict)
        refuse_unknown(state, ("fresh", "config", "rng", "urls", "block", "epoch", "buffer", "run"), "shuffle")
        check_same("shuffle", state.get("config") or {}, self._config())
        if not state.get("fresh"):
            expect(
                state,
                "shuffle",
                dict,
                rng=list,
                urls=list,
                block=(int, lambda v: v == 512, True),
                buffer=(list, lambda v: len(v) <= self.bufsize),
                epoch=(int, None, True),
            )
            refs = set()
            for entry in state["urls"]:
                if not (
                    isinstance(entry, list)
                    and len(entry) in (3, 4)
                    and type(entry[0]) is int
                    and isinstance(entry[1], str)
                    and (len(entry) == 3 or isinstance(entry[3], str))
                ):
                    raise StateMismatchError(
                        f"the saved shuffle state's 'urls' holds {shown(entry)}, which no "
                        "state_dict() gives: the state was changed",
                        field="urls",
                    )
                refs.add(entry[0])
            self._check_rng(state["rng"])
            self._check_seeded(state)
            most_blocks = _most_blocks()
            for entry in state["buffer"]:
                if not (
                    isinstance(entry, (list, tuple))
                    and len(entry) == 3
                    and all(type(v) is int and v >= 0 for v in entry)
                    and entry[0] in refs
                    and 0 < entry[2] <= most_blocks
                    and entry[1] < MAX_SHARD_BLOCKS
                ):
                    raise StateMismatchError(
                        f"the saved shuffle state's 'buffer' holds {shown(entry)}, which no "
                        "state_dict() gives: the state was changed",
                        field="buffer",
                    )
        self._resume = None if state.get("fresh") else state
        if state.get("fresh") and "epoch" in state:
            self.epoch = state["epoch"] - 1  # run() advances before use

    def _check_seeded(self, state: dict) -> None:
        """A seeded shuffle's saved generator was seeded by this shuffle (from its seed, and the epoch where
        each epoch draws anew): another seed would resume in another order, silently."""
        if self.rng is not None or self.seed is None:
            return  # a given generator, or a pass seeded at random: any seed is its own
        if self.epoch_seeded and "epoch" not in state:
            raise StateMismatchError(
                "the saved shuffle state has no 'epoch', which every state_dict() of a shuffle that draws anew "
                "each epoch holds: the state was changed; load the state that state_dict() returned",
                field="epoch",
            )
        expected = make_seed(self.seed, state["epoch"]) if self.epoch_seeded else self.seed
        if state["rng"][0] != expected:
            raise StateMismatchError(
                f"the saved shuffle state's generator was seeded with {shown(state['rng'][0])}, but this shuffle "
                f"(seed={self.seed}{', epoch ' + str(state['epoch']) if self.epoch_seeded else ''}) seeds it with "
                f"{expected}: the state was changed, or was taken from a shuffle with another seed",
                field="rng",
            )

    def _check_rng(self, saved: Any) -> None:
        """The saved RNG state has the shape this shuffle's generator gives: two whole numbers (a counted
        generator: seed and draws), or ``random.Random``'s (version, 625 words, gauss) for a given ``rng``."""
        if isinstance(self.rng, random.Random):
            ok = (
                isinstance(saved, list)
                and len(saved) == 3
                and type(saved[0]) is int
                and isinstance(saved[1], list)
                and len(saved[1]) == 625
                and all(type(w) is int and 0 <= w < (1 << 32) for w in saved[1][:-1])
                and type(saved[1][-1]) is int
                and 0 <= saved[1][-1] <= 624
                and (saved[2] is None or type(saved[2]) is float)
            )
        elif self.rng is not None:
            ok = isinstance(saved, list)
        else:
            ok = (
                isinstance(saved, list)
                and len(saved) == 2
                and is_seed(saved[0])
                and type(saved[1]) is int
                and 0 <= saved[1] < MAX_COUNT
            )
        if not ok:
            raise StateMismatchError(
                f"the saved shuffle state's 'rng' is {shown(saved)}, which no state_dict() "
                "gives: the state was changed; load the state that state_dict() returned",
                field="rng",
            )

    def replay_locations(self, state: dict) -> list:
        """``(url, start, end, compressed, ref)`` of the buffered samples of ``state``, in buffer order."""
        if state.get("fresh"):
            return []

        urls = {
            entry[0]: (StateURL(entry[1], entry[3] if len(entry) > 3 else None), entry[2])
            for entry in state.get("urls") or ()
        }
        block = state.get("block") or 512
        out = []
        for ref, first, blocks in state.get("buffer") or ():
            url, compressed = urls[ref]
            out.append((url, first * block, (first + blocks) * block, bool(compressed), ref))
        return out


def _most_blocks() -> int:
    """The most 512-byte blocks one buffered sample may span: the sample limit (``WDS_MAX_SAMPLE_SIZE``, else the
    member limit) and its headers; a state claiming more would be read on resume, so it is refused."""
    settings = config.current()
    return (settings.max_sample_size or settings.max_member_size) // 512 + 64


def apply_journal(buffer: list, journal: Any) -> list:
    """Replay a :meth:`Shuffle.transport_state` journal onto ``buffer`` (a list of location tuples, in place)."""
    out = buffer
    i, n = 0, len(journal)
    while i < n:
        op = journal[i]
        if op < 0:
            k = ~op
            out[k] = out[-1]
            out.pop()
            i += 1
        else:
            out.append((op, journal[i + 1], journal[i + 2]))
            i += 3
    return out


def buffer_locations(flat: Any) -> list:
    """The location tuples of a buffer sent flat (``array("q")`` of three integers each)."""
    if not isinstance(flat, array):
        return list(flat)
    return list(zip(flat[0::3], flat[1::3], flat[2::3]))
