"""Output name patterns: the ``out/train-%06d.tar`` a tool writes its shards to, checked once, before anything.

A pattern names shard ``k`` as ``pattern % k``.  It holds exactly one number field, ``%d`` or a zero-padded
``%0Nd`` (``%06d``), in its last path segment, and no other ``%``: so the names of two shards never coincide
(a pattern whose names repeat, such as ``out-%.0s.tar``, would publish every shard under one name and keep
all but the first as "already complete"), the job record (``wds_cloud.jobs.record``) can name the job
(the field replaced by ``N``) and recognise its outputs, and nothing fails half way with Python's
``TypeError`` (``out-%d-%d.tar``, ``out-%%d.tar``).  Other conversions (``%s``, ``%x``, ``%5d`` padded
with spaces, ``%+d``) and a literal ``%%`` are refused: the few names they would add are not worth names
that a rerun, ``ls`` or a shell glob would treat differently.
"""

from __future__ import annotations

import re

from ..errors import ConfigError, redact

__all__ = ["check_output_pattern", "output_pattern_problem", "PATTERN_RULE"]

#: one printf conversion as Python's ``%`` operator reads it (mapping key, flags, width, precision, length, type)
_CONVERSION = re.compile(r"%(?:\([^)]*\)?)?[-+ #0]*(?:\*|\d+)?(?:\.(?:\*|\d*))?[hlL]?(.?)", re.DOTALL)
#: the number fields accepted: %d and %0Nd (as the job record's name and matching read them)
_NUMBER = re.compile(r"%(?:0\d{1,2})?d")

#: the rule, as every refusal of a pattern states it
PATTERN_RULE = (
    "give exactly one %d field (or a zero-padded one such as %06d) for the shard number, such as out/train-%06d.tar"
)


def output_pattern_problem(pattern: str) -> str | None:
    """What is wrong with ``pattern`` as an output name pattern (see the module docstring), or None."""
    if not isinstance(pattern, str) or not pattern.strip():
        return "it is empty"
    if "\0" in pattern:
        return "it holds a NUL character"
    fields = []
    for m in _CONVERSION.finditer(pattern):
        text = m.group(0)
        if text == "%%":
            return "a literal %% is not allowed in an output name (only the number field may hold a %)"
        if not _NUMBER.fullmatch(text):
            what = f"{text!r} is not a number field" if m.group(1) else "a % at the end"
            return f"{what} (only %d or %0Nd such as %06d)"
        fields.append(m)
    if not fields:
        return "it has no %d-style field for the shard number"
    if len(fields) > 1:
        return f"it has {len(fields)} fields ({', '.join(m.group(0) for m in fields)}); one number per name"
    if "/" in pattern[fields[0].end() :] or "\\" in pattern[fields[0].end() :]:
        return "the number field is in a folder's name: put it in the file name (out/train-%06d.tar)"
    names = {pattern % k for k in (0, 1, 9, 10, 99999)}
    if len(names) != 5:  # cannot happen with the fields above: a last guard that names never repeat
        return "two shards would get the same name"
    return None


def check_output_pattern(pattern: str, what: str = "the output pattern") -> str:
    """``pattern`` when it is a valid output name pattern, else ``ConfigError`` naming it (as ``what``),
    what is wrong and the rule."""
    problem = output_pattern_problem(pattern)
    if problem is not None:
        raise ConfigError(f"{what} {redact(pattern)!r}: {problem}; {PATTERN_RULE}")
    return pattern
