"""``ReadOptions``: how a dataset reads its shards (transfers and safety), grouped in one object.

``WebDataset(url, options=ReadOptions(retries=10, part_size="16MB"))`` and ``WebDataset(url, retries=10,
part_size="16MB")`` are the same dataset: the keyword arguments feed the object, so code written either way
works, and one object can be shared by many datasets.  A field left None takes its default from the
environment (``WDS_*``) and the URL's storage profile when the shards are opened.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

from .. import config
from ..errors import ConfigError

__all__ = ["ReadOptions"]

#: the fields that are numbers: each is held to the range of the variable that sets the same thing
#: (``part_size``: ``WDS_PART_SIZE``), by the function that checks the variable, so that an argument takes what
#: the variable takes (``"16MB"``, ``"4"``) and a refusal says as much (the kind, units, range and fix)
_NUMBERS = (
    "retries",
    "timeout",
    "part_size",
    "concurrency",
    "max_concurrency",
    "prefetch",
    "max_member_size",
    "max_sample_size",
)


def _plain(name: str, value: Any) -> Any:
    """``value`` of field ``name`` as the readers take it (a number of any type or text made a plain int or float),
    or a ConfigError naming the argument, the kind and range it takes, and the fix."""
    return config.check_setting(name, value) if name in _NUMBERS and value is not None else value


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """Transfer and safety settings of a dataset's reads (each None: the environment's or profile's default).

    - ``storage_options``: passed to the storage backend (credentials are better kept in a profile);
    - ``retries``, ``timeout``: how a dropped or stalled transfer is retried;
    - ``part_size``, ``concurrency``, ``max_concurrency``, ``prefetch``: remote shards read as parallel ranged
      parts (see :mod:`wds_cloud.io.parallel`);
    - ``max_member_size``, ``max_sample_size``: the largest tar member and sample accepted (bytes or ``"256MB"``);
    - ``manifest``: a manifest (path, URL, dict or :class:`~wds_cloud.manifest.Manifest`) every shard is
      checked against while it is read.
    """

    storage_options: Optional[dict] = None
    retries: Optional[int] = None
    timeout: Optional[float] = None
    part_size: Union[int, str, None] = None
    concurrency: Optional[int] = None
    max_concurrency: Optional[int] = None
    prefetch: Optional[int] = None
    max_member_size: Union[int, str, None] = None
    max_sample_size: Union[int, str, None] = None
    manifest: Any = None

    def __post_init__(self) -> None:
        # numbers of any type made plain, nonsense (nan, inf, negative, True, a part size below the floor) refused
        # naming the setting, here rather than at the first transfer, where the error would name neither the
        # setting nor where it was given
        for name in _NUMBERS:
            object.__setattr__(self, name, _plain(name, getattr(self, name)))  # frozen: the one place values are set
        # both given here: the arguments win over every profile and variable, so the two are in conflict whatever
        # else is set (a pair from other sources is checked once resolved, when a shard is opened)
        config.check_ceiling(self.concurrency, self.max_concurrency)

    def with_keywords(self, **given: Any) -> ReadOptions:
        """These options with the keyword arguments a dataset was given (None: not given) filled in; a setting
        given both here and as a keyword, with two values, is refused."""
        changes = {}
        for name, value in given.items():
            if value is None:
                continue
            value = _plain(name, value)  # "16MB" and 16000000 are one value (this object holds the number)
            mine = getattr(self, name)
            if mine is not None and mine is not value and mine != value:
                raise ConfigError(
                    f"{name} is given twice, as {name}={value!r} and in options= ({mine!r}): give it once"
                )
            changes[name] = value
        return dataclasses.replace(self, **changes) if changes else self

    @property
    def transfer(self) -> dict:
        """The parallel-read settings, as the openers take them."""
        return {
            "part_size": self.part_size,
            "concurrency": self.concurrency,
            "max_concurrency": self.max_concurrency,
            "prefetch": self.prefetch,
        }
