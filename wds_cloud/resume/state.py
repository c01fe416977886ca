"""Exact mid-epoch resume: the pieces the resumable stages share.

How it works.  ``DataPipeline.state_dict()`` asks each resumable stage for its
state at the moment the pipeline last yielded (every stage is then suspended
at a yield, so the parts agree):

- the shard list: the epoch (and, when resampling, how many shards were drawn);
- the shard reader (:class:`~wds_cloud.tar.shardreader.TarSamples`): how many of
  this worker's shards it started, the URL of the current one and the byte
  offset where its next sample begins (the next tar header);
- the sample shuffle (:class:`~wds_cloud.resume.shuffle.Shuffle`): its random
  generator (two integers, :class:`~wds_cloud.resume.rng.CountedRandom`) and, for every sample in its
  buffer, the shard and byte range it came from (not the sample).

``load_state_dict(state)`` on a freshly built, identical pipeline hands these
back.  On the next pass the reader first fetches the buffered samples again
with ranged reads (:func:`~wds_cloud.resume.refetch.refetch`; adjacent samples are read in one request,
requests run in parallel) and passes them down to the shuffle, which puts them
back in its buffer in their old order; then it opens the current shard at the
saved offset.  Consumed shards are not opened again.

Every state is plain JSON (ints, strings, lists, dicts).  A state that does not
fit the pipeline it is loaded into raises :class:`StateMismatchError` listing
what differs.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import warnings
from typing import Any, Optional

from ..errors import InexactResumeWarning, StateMismatchError, redact
from ..io.datafile import shown

__all__ = [
    "FORMAT",
    "StateURL",
    "check_same",
    "RESHAPE_FIX",
    "refuse_unknown",
    "expect",
    "same_url",
    "shown_url",
    "url_id",
    "inexact_state",
    "is_inexact",
    "restart_from",
    "seal",
    "check_seal",
    "seal_problem",
    "SEAL",
    "MAX_OFFSET",
]

log = logging.getLogger(__name__)

#: the format tag of a pipeline state; bumped when the layout changes incompatibly
FORMAT = "wds_cloud.state/1"


@functools.lru_cache(maxsize=4096)
def url_id(url: str) -> str:
    """What a state keeps of a URL besides its redacted text: a hash that matches it, and no secret."""
    return hashlib.sha256(str(url).encode("utf-8", "surrogateescape")).hexdigest()[:24]


@functools.lru_cache(maxsize=4096)
def shown_url(url: str) -> str:
    """A URL as a state stores it: redacted (signatures, tokens and passwords never reach a checkpoint)."""
    return redact(url)


class StateURL(str):
    """A URL read from a saved state: its redacted text, and ``id`` (:func:`url_id`) when the state had one."""

    __slots__ = ("id",)
    id: Optional[str]

    def __new__(cls, text: str, ident: Optional[str] = None) -> StateURL:
        obj = super().__new__(cls, text)
        obj.id = ident
        return obj


#: every byte offset a state holds lies below this (a seek past 2**63 raises a raw ValueError; no shard is so big)
MAX_OFFSET = 1 << 62

#: the key of a state's checksum (see :func:`seal`)
SEAL = "checksum"


def _digest(state: dict) -> str:
    body = {k: v for k, v in state.items() if k != SEAL}
    try:
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), check_circular=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:  # RecursionError: nested deeper than any state is
        raise StateMismatchError(
            f"the saved state holds a value that no state_dict() gives ({exc}): the state was "
            "changed; load the state that state_dict() returned",
            field=SEAL,
        ) from None
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def seal(state: dict) -> dict:
    """``state`` with its checksum (a digest of its canonical JSON): a state changed after it was taken, by a
    bit flipped on disk, an edit or a merge gone wrong, is refused on load instead of resuming somewhere else
    (an RNG count moved by one would give another order, silently).  Not a signature: a state is still
    checked field by field, as input."""
    state[SEAL] = _digest(state)
    return state


def check_seal(state: dict, what: str) -> None:
    """Refuse a state whose checksum is missing or does not match (:func:`seal`)."""
    problem = seal_problem(state, what)
    if problem is not None:
        raise problem


def seal_problem(state: dict, what: str) -> Optional[StateMismatchError]:
    """The error :func:`check_seal` would raise, or None.  A pipeline raises it only after its stages' own
    checks of the state had their say (they name the field that was changed), before any item is yielded."""
    saved = state.get(SEAL)
    if not isinstance(saved, str):
        return StateMismatchError(
            f"the saved {what} state has no checksum: it was not returned by state_dict() of "
            "this version of wds_cloud (or it was edited); load the state that state_dict() "
            "returned, or start the pass again",
            field=SEAL,
        )
    try:
        digest = _digest(state)
    except StateMismatchError as exc:
        return exc
    if saved != digest:
        return StateMismatchError(
            f"the saved {what} state does not match its checksum: it was changed after "
            "state_dict() returned it (an edit, a damaged file); resuming from it could not be "
            "exact, so it is refused: load an unchanged state, or start the pass again",
            field=SEAL,
        )
    return None


def same_url(url: str, saved: str, saved_id: Optional[str]) -> bool:
    """Whether the shard list's ``url`` is the one a state saved (by hash when it has one)."""
    return url_id(url) == saved_id if saved_id else url == saved


def expect(state: Any, what: str, kind: type, **fields: Any) -> None:
    """Check a saved state's shape: ``state`` is a ``kind``; each named field has its type (``type``,
    or ``(type, check, optional)``).  A state is input: anything else is StateMismatchError naming the field."""
    if not isinstance(state, kind):
        raise StateMismatchError(
            f"the saved {what} state is a {type(state).__name__}, not a {kind.__name__}: "
            "load the state that state_dict() returned",
            field=what,
        )
    fields_of: Any = state  # a dict (or the kind asked for), checked above
    for name, spec in fields.items():
        typ, check, optional = (spec, None, False) if isinstance(spec, type) else (tuple(spec) + (None, False))[:3]
        if name not in fields_of:
            if optional:
                continue
            raise StateMismatchError(
                f"the saved {what} state has no {name!r}: load the state that state_dict() returned", field=name
            )
        value = fields_of[name]
        if value is None and optional:
            continue
        ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
        if ok and check is not None:
            ok = bool(check(value))
        if not ok:
            raise StateMismatchError(
                f"the saved {what} state's {name!r} is {shown(value)}, which no state_dict() "
                "gives: the state was changed; load the state that state_dict() returned",
                field=name,
            )


def refuse_unknown(state: dict, allowed: Any, what: str) -> None:
    """Refuse a state holding fields ``allowed`` does not name: no ``state_dict()`` gives them, so it was edited."""
    unknown = sorted(str(key) for key in set(state) - set(allowed))
    if unknown:
        raise StateMismatchError(
            f"the saved {what} state has the field(s) {shown(unknown)}, which no state_dict() gives: the state was "
            "changed; load the state that state_dict() returned",
            field=unknown[0],
        )


#: what to do when a state was taken on another number of ranks or DataLoader workers (the documented fix)
RESHAPE_FIX = (
    "To resume on another number of ranks or DataLoader workers, merge the states into one and load that: "
    "loader.load_state_dict(wds.merge_states([state])) for a state of one process, "
    "wds.merge_states([state_of_rank_0, state_of_rank_1, ...]) for one per rank (or take it with "
    "loader.state_dict(gather=True)); see docs/elastic.md"
)


def check_same(what: str, saved: dict, current: dict, fix: Optional[str] = None) -> None:
    """Raise :class:`StateMismatchError` naming every key whose value differs between ``saved`` and ``current``,
    and ``fix`` (what to do; by default: build the dataset as the run that saved the state did)."""
    diffs = [
        f"{key}: saved {shown(saved.get(key))}, here {shown(current.get(key))}"
        for key in sorted(set(saved) | set(current))
        if saved.get(key) != current.get(key)
    ]
    if diffs:
        raise StateMismatchError(
            f"the saved state does not fit this {what}: "
            + "; ".join(diffs)
            + ". "
            + (
                fix
                or "Load a state into a dataset built with the same shards, seed, splitting and shuffle as the "
                "one that saved it. "
                + RESHAPE_FIX
            ),
            differences=diffs,
        )


# Inexact states.  Trainers take states on their own: Lightning asks every stateful loader with each
# checkpoint, torchdata's StatefulDataLoader asks the dataset in every worker with every batch.  A
# pipeline that cannot be resumed exactly must not stop that training run (webdataset has no states
# at all, so code written for it never expects an error there); it gives a state that says so.

_warned: set = set()


def inexact_state(fmt: str, reason: str, **fields: Any) -> dict:
    """A state that cannot be resumed exactly: its ``format``, ``inexact`` (why), and ``fields`` (such
    as the epoch) that let a restart begin the same pass again.  Logged once per reason."""
    if reason not in _warned and len(_warned) < 256:
        _warned.add(reason)
        log.warning(
            "%s; a run restored from this state starts its data pass again (as webdataset would). "
            "Pass strict=True to state_dict() to make this an error",
            reason,
        )
    return {"format": fmt, "inexact": reason, **fields}


def is_inexact(state: Any) -> bool:
    """Whether ``state`` was taken from a pipeline or loader that cannot be resumed exactly."""
    return isinstance(state, dict) and isinstance(state.get("inexact"), str)


def restart_from(state: dict, what: str) -> None:
    """Warn (:class:`~wds_cloud.errors.InexactResumeWarning`, once per load) that an inexact state is loaded:
    the pass it was taken in starts again."""
    warnings.warn(
        f"the saved {what} state cannot be resumed exactly ({str(state['inexact'])[:2000]}): the epoch "
        "starts again from its beginning",
        InexactResumeWarning,
        stacklevel=3,
    )
