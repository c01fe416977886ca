"""Numbers a user gives a dataset or stage, normalised when it is built (a state holds them as JSON, so a numpy integer or a float such as 1e3 must become a plain int there, or be refused naming the argument).

A state is plain JSON sealed with a checksum of its canonical text, and a stage's settings travel in it (a
shuffle's buffer size, a shard list's seed).  A numpy integer or float is a valid Python number but not JSON,
so a stage built with one could not give its state: ``state_dict()`` raised where trainers call it at every
checkpoint.  Every such argument goes through these functions when the stage is built: integer types (numpy's,
anything with ``__index__``) become ``int``, real ones ``float``; ``True``/``False`` where a number goes,
``nan``, ``inf``, fractions where a count goes and values out of range are refused with
:class:`~wds_cloud.errors.ConfigError` naming the argument and what it takes.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable
from typing import Any, Optional

from ..errors import ConfigError
from ..io.datafile import shown

__all__ = ["SEED_MIN", "SEED_MAX", "as_count", "as_seed", "as_real", "as_weights", "as_size", "is_seed", "is_flag"]

#: the seeds a state may hold: a 64-bit word either signed or not (a spec's ``seed:`` takes the same); a seed of
#: thousands of digits cannot even be turned into text (Python's limit on int-to-str conversion)
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


def is_flag(value: Any) -> bool:
    """Whether ``value`` is True/False of any type (numpy's ``bool_`` too: a scalar whose dtype is boolean)."""
    return isinstance(value, bool) or getattr(getattr(value, "dtype", None), "kind", None) == "b"


def _integer(name: str, value: Any, what: str) -> int:
    """``value`` as an int: any integer type, or a real that is a whole number (``1e3``); else ConfigError."""
    if is_flag(value):
        raise ConfigError(f"{name}={value!r} is True/False where {what} goes: give a whole number")
    if isinstance(value, numbers.Integral) or (hasattr(value, "__index__") and not isinstance(value, numbers.Real)):
        try:
            return operator.index(value)
        except TypeError:
            pass
    if isinstance(value, numbers.Real):
        number = float(value)
        if math.isfinite(number) and number == int(number):
            return int(number)
    raise ConfigError(f"{name}={shown(value)} is not {what}: give a whole number")


def as_count(name: str, value: Any, least: int = 0, most: Optional[int] = None) -> int:
    """``value`` as a whole number from ``least`` to ``most`` (a buffer size, a batch size, a number of samples)."""
    number = _integer(name, value, "a count")
    if number < least or (most is not None and number > most):
        upper = f" and at most {most}" if most is not None else ""
        raise ConfigError(f"{name}={shown(value)} is out of range: give a whole number of at least {least}{upper}")
    return number


def is_seed(value: Any) -> bool:
    """Whether ``value`` is a seed as a state holds it: an ``int`` (not a bool) from SEED_MIN to SEED_MAX."""
    return type(value) is int and SEED_MIN <= value <= SEED_MAX


def as_seed(name: str, value: Any) -> Optional[int]:
    """A seed as an ``int`` (None stays None: a fresh seed); a string of digits is read as its number."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if not text.lstrip("-").isdigit() or len(text) > 21:
            raise ConfigError(f"{name}={shown(value)} is not a seed: give a whole number, such as 42")
        value = int(text)
    number = _integer(name, value, "a seed")
    if not SEED_MIN <= number <= SEED_MAX:
        raise ConfigError(f"{name}={shown(value)} is out of range: give a seed from {SEED_MIN} to {SEED_MAX}")
    return number


def as_real(name: str, value: Any, least: float = 0.0, positive: bool = False) -> float:
    """``value`` as a finite float of at least ``least`` (above it when ``positive``)."""
    if is_flag(value) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name}={shown(value)} is not a number: give a finite number")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or number < least or (positive and number <= least):
        rule = f"above {least:g}" if positive else f"at least {least:g}"
        raise ConfigError(f"{name}={shown(value)} is out of range: give a finite number {rule}")
    return number


def as_weights(name: str, values: Iterable, count: int) -> list[float]:
    """``count`` finite, non-negative weights (numpy arrays and tuples too), not all zero."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ConfigError(f"{name}={shown(values)} is not a list of weights: give one number per dataset")
    weights = [as_real(f"{name}[{i}]", w) for i, w in enumerate(values)]
    if len(weights) != count:
        raise ConfigError(f"{name} has {len(weights)} weights for {count} datasets: give one weight per dataset")
    if weights and not sum(weights) > 0:
        raise ConfigError(
            f"{name}={shown(weights)}: every weight is 0, so nothing could be drawn; give a weight above 0"
        )
    if not math.isfinite(sum(weights)):
        raise ConfigError(f"{name}={shown(weights)}: the weights add up to more than a float holds; scale them down")
    return weights


def as_size(name: str, value: Any, least: int = 0) -> Any:
    """A byte count given as a number (normalised to ``int``, at least ``least``) or as text (``"8MB"``: left to
    the parser of sizes); None stays None."""
    if value is None or isinstance(value, str):
        return value
    if is_flag(value):
        raise ConfigError(f"{name}={value!r} is True/False where a size goes: give a number of bytes, or '8MB'")
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        number = as_real(name, value, least=least)
        if number != int(number):  # a part of a byte: never cut to a whole number silently
            raise ConfigError(
                f"{name}={value!r} is {number!r} bytes, not a whole number of them: give a whole number of bytes, "
                "or a size with a unit such as '256MB'"
            )
        return int(number)
    return as_count(name, value, least=least)
