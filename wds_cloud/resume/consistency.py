"""Load-time proof that a state is consistent, across its fields and with the dataset it is loaded into.

A checksum (:func:`~wds_cloud.resume.state.seal`) stops accidents, not people: a state edited and sealed again
is well formed field by field and can still describe work that never existed.  These checks hold every state
we write to what a real pass can leave (a checksum stops accidents, not edits), before any sample is read:

- a shard is in exactly one of unstarted (``pending``) / partly read (``partial``) / done; partly read at most
  once (unless shards are drawn with replacement);
- buffered samples are only of shards already started, and of the shard being read only before where it
  stands; a sample is buffered at most once;
- counts owed under ``equal_work`` are no more than the epoch holds;
- a merged level's counts add up: done + partly read + unstarted shards == the epoch's shards, and the samples
  read == those delivered + those held in shuffle buffers (the buffered ones less the replays not yet read).

Where a pass reads a shard more than once (``resampled=True``; ``equal_work`` shares that go over their shards
again) "started" cannot be told from "done", so only what still holds there is checked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

from ..errors import StateMismatchError
from .elastic import REPLAY_REF, decode_buffered, decode_ranges
from .state import shown_url, url_id

__all__ = ["check_work", "check_owed", "check_counts", "check_buffer", "slot_items"]

_CHANGED = "the state was changed (or comes from another dataset); load the state that state_dict() returned"


def _refuse(field: str, text: str) -> StateMismatchError:
    return StateMismatchError(f"{text}: {_CHANGED}", field=field)


def check_work(
    work: dict,
    urls: Any,
    *,
    repeats: bool,
    laps: bool,
    buffered: str = "buffered",
    what: str = "merged state",
    index_of: Optional[dict] = None,
) -> None:
    """Refuse a merged level or an elastic share (``work``: ``pending`` shard indices, ``partial`` entries and
    buffered entries under the key ``buffered``) whose shards overlap: a shard both unstarted and partly read,
    partly read twice, buffered samples of an unstarted shard or past where its partial read stands.

    ``repeats``: shards are drawn with replacement; ``laps``: a share goes over its shards again (equal_work).
    ``index_of``: URL hash -> index in ``urls``, of every shard ``work`` names at least (a share's, found from its
    hints without hashing every URL: see :mod:`wds_cloud.resume.share_out`); else made from ``urls``.
    """
    if index_of is None:
        index_of = {url_id(u): i for i, u in enumerate(urls)}
    pending = set(work.get("pending") or ())
    partial_at: dict = {}
    for entry in work.get("partial") or ():
        index = index_of.get(entry[0])
        if index is None:
            raise StateMismatchError(
                f"the {what} names the partly read shard {entry[1]!r}, which this dataset's shard list does not: "
                "load a state taken from a job over the same shards",
                field="partial",
                url=entry[1],
            )
        if repeats:
            continue
        if index in partial_at:
            raise _refuse("partial", f"the {what} lists the shard {entry[1]!r} as partly read twice")
        if index in pending:
            raise _refuse("pending", f"the {what} lists the shard {entry[1]!r} both as unstarted and as partly read")
        partial_at[index] = entry[2] // 512
    seen: set = set()
    for entry in work.get(buffered) or ():
        if entry[0] in seen:
            raise _refuse("buffered", f"the {what} lists the buffered samples of {entry[1]!r} twice")
        seen.add(entry[0])
        index = index_of.get(entry[0])
        if index is None:
            raise StateMismatchError(
                f"the {what} holds buffered samples of {entry[1]!r}, which this dataset's shard list does not "
                "name: load a state taken from a job over the same shards",
                field="buffered",
                url=entry[1],
            )
        if repeats or laps:
            continue
        if index in pending:
            raise _refuse(
                "buffered", f"the {what} holds buffered samples of {entry[1]!r}, a shard it lists as not started"
            )
        end = _end(entry[3])
        if index in partial_at and end > partial_at[index]:
            raise _refuse(
                "buffered",
                f"the {what} holds a buffered sample of {entry[1]!r} ending at block {end}, past block "
                f"{partial_at[index]} where that shard's partial read stands",
            )


def _end(flat: list) -> int:
    """The block after the last buffered sample of a shard's ranges (gaps and lengths, see ``encode_buffered``)."""
    if flat and min(flat[0::2]) >= 0:  # no repeat: each sample ends after the one before, so the ends add up
        return sum(flat)
    ranges = decode_ranges(flat)
    return max((first + blocks for first, blocks in ranges), default=0)


def check_counts(level: dict, repeats: bool) -> None:
    """Refuse a merged level (its fields' shapes checked by ``check_merged``) whose counts do not add up: every shard
    of the epoch is done, partly read or unstarted (``done + len(partial) + len(pending) == shards``); the shards
    begun since the last merge are among those done or partly read (``started``); and every sample read since then
    was delivered or is buffered (``read == delivered + held``, the buffered samples being the held ones plus the
    ``replays`` not yet read).
    ``repeats``: shards are drawn with replacement (no shard is ever done for good)."""
    changed = "the state was changed; load the state that merge_states() returned"
    n_shards = level["shards"]["shards"]
    done, partial, pending = level["done"], len(level["partial"]), len(level["pending"])
    if not repeats:  # shards drawn with replacement: no shard is ever done for good
        if done + partial + pending != n_shards:
            field = "done" if done + partial + pending > n_shards else "pending"
            raise StateMismatchError(
                f"the merged state accounts for {done + partial + pending} shards of the epoch's {n_shards} "
                f"({done} done + {partial} partly read ('partial') + {pending} unstarted ('pending')); each "
                f"shard is exactly one of them: {changed}",
                field=field,
            )
        if level["started"] > done + partial:
            raise StateMismatchError(
                f"the merged state says {level['started']} shards were started, more than the {done} done and "
                f"{partial} partly read: {changed}",
                field="started",
            )
    buffered = sum(len(entry[3]) // 2 for entry in level["buffered"])
    replays, read, delivered = level["replays"], level["read"], level["delivered"]
    held = buffered - replays
    if held < 0 or held + delivered != read:
        raise StateMismatchError(
            f"the merged state's samples do not add up: 'read' {read} must equal 'delivered' {delivered} plus the "
            f"{max(held, 0)} held in shuffle buffers ({buffered} 'buffered' less {replays} 'replays' not yet "
            f"read): {changed}",
            field="buffered" if held < 0 else "read",
        )


def check_owed(level: dict, equal_work: Any, counts: Optional[dict], n_shards: int) -> None:
    """Refuse an ``owed`` count (the samples an equal_work job still owes) beyond what the epoch holds: every one
    of the level's ``slots`` owed at most its limit (``equal_work=N``: N; ``"min"``: the smallest share, so all
    of them together at most every sample; ``"max"``: at most every sample each, and a slot exists only for a
    share with samples), plus the samples held in buffers."""
    owed = level.get("owed")
    if owed is None or equal_work is None:
        return
    slots = level["slots"]
    held = sum(len(entry[3]) // 2 for entry in level.get("buffered") or ())
    if isinstance(equal_work, int):
        bound = equal_work * slots + held
    elif counts:
        total = sum(counts.values())
        bound = (total if equal_work == "min" else total * min(slots, n_shards)) + held
    else:
        return
    if owed > bound:
        raise _refuse(
            "owed",
            f"the merged state owes {owed} samples (equal_work={equal_work!r} over {slots} ranks x workers), "
            f"more than its epoch holds ({bound})",
        )


def slot_items(order: Sequence, split: Any, identity: Any, shard_split: Callable) -> Optional[Sequence]:
    """The shard indices one rank and worker (``identity``, as a reader records it) read out of ``order`` with the
    splitting ``split``; None when that cannot be known (a splitter of the user's, a stream, no identity)."""
    if split not in ("nodes+workers", "nodes", "workers", "none") or not isinstance(identity, dict):
        return None
    try:
        rank, world_size, worker, workers = (identity[k] for k in ("rank", "world_size", "worker", "num_workers"))
    except KeyError:
        return None
    if not all(type(v) is int for v in (rank, world_size, worker, workers)):
        return None
    if not (0 <= rank < world_size and 0 <= worker < workers):
        return None
    slot, slots = shard_split(split, world_size, max(1, workers), rank, worker)
    ranks = slots // (max(1, workers) if split in ("nodes+workers", "workers") else 1)
    per = slots // ranks
    return order[slot // per :: ranks][slot % per :: per]


def check_buffer(
    replay: list, reader: dict, items: Optional[list], share: Optional[dict], what: str = "shuffle"
) -> None:
    """Refuse a per-worker state whose shuffle buffer (``replay``: ``(url, start, end, compressed, ref)`` of each
    buffered sample) does not fit its shard reader's state (``reader``): samples of a shard the reader had not
    started (a ref past its current shard), of the current shard past where it stands or of another URL, of a
    shard that is not the worker's own at that ref (``items``: the URL id of each of the worker's shards, when
    known, by URL), of a replay its elastic share (``share``) does not hold, or the same sample twice."""
    if not replay:
        return
    if reader.get("fresh"):
        raise _refuse("buffer", f"the saved {what} holds {len(replay)} samples, but its shard reader had not started")
    current = reader.get("shard")
    current_id = reader.get("url_id")
    replaying = reader.get("url") is None
    done = bool(reader.get("done"))
    offset = reader.get("offset") if type(reader.get("offset")) is int else 0
    replays = decode_buffered(share.get("replay") or []) if isinstance(share, dict) else []
    seen: set = set()
    for url, start, end, _compressed, ref in replay:
        ident = getattr(url, "id", None)
        if (ref, start) in seen:
            raise _refuse("buffer", f"the saved {what} holds the sample at byte {start} of {url!r} twice")
        seen.add((ref, start))
        if ref >= REPLAY_REF:
            number = ref - REPLAY_REF
            if number >= len(replays) or (ident is not None and replays[number][0] != ident):
                raise _refuse(
                    "buffer", f"the saved {what} holds a sample of {url!r} that its elastic share does not replay"
                )
            continue
        if replaying or ref > current:
            raise _refuse(
                "buffer",
                f"the saved {what} holds a sample of {url!r} from shard {ref} of this worker, which its reader "
                f"had not started ({'none begun' if replaying else 'reading shard ' + str(current)})",
            )
        if ref == current:
            if current_id is not None and ident is not None and ident != current_id:
                raise _refuse(
                    "buffer",
                    f"the saved {what} holds a sample of {url!r} as from shard {ref}, which its reader "
                    f"reads as {reader.get('url')!r}",
                )
            if not done and end > offset:
                raise _refuse(
                    "buffer",
                    f"the saved {what} holds a sample of {url!r} ending at byte {end}, past byte {offset} "
                    "where its reader stands in that shard",
                )
        elif items and ident is not None and url_id(items[ref % len(items)]) != ident:
            raise _refuse(
                "buffer",
                f"the saved {what} holds a sample of {url!r} as from shard {ref} of this worker, which is "
                f"{shown_url(items[ref % len(items)])!r} in the shard order",
            )
