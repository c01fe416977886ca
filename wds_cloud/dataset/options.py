"""``ReadOptions``: how a dataset reads its shards (transfers and safety), grouped in one object.

``WebDataset(url, options=ReadOptions(retries=10, part_size="16MB"))`` and ``WebDataset(url, retries=10,
part_size="16MB")`` are the same dataset: the keyword arguments feed the object, so code written either way
works, and one object can be shared by many datasets.  A field left None takes its default from the
environment (``WDS_*``) and the URL's storage profile when the shards are opened.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

from ..errors import ConfigError
from ..resume.arguments import as_count, as_real, as_size

__all__ = ["ReadOptions"]


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
        # numbers of any type made plain, nonsense (nan, inf, negative, True) refused naming the setting, here
        # rather than at the first transfer, where the error would name neither the setting nor where it was given
        checks = {
            "retries": lambda name, v: as_count(name, v),
            "timeout": lambda name, v: as_real(name, v, positive=True),
            "part_size": lambda name, v: as_size(name, v, least=1),
            "concurrency": lambda name, v: as_count(name, v, least=1),
            "max_concurrency": lambda name, v: as_count(name, v, least=1),
            "prefetch": lambda name, v: as_count(name, v),
            "max_member_size": lambda name, v: as_size(name, v, least=1),
            "max_sample_size": lambda name, v: as_size(name, v, least=1),
        }
        for name, check in checks.items():
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, check(name, value))  # frozen: the one place values are set
        if (
            self.concurrency is not None
            and self.max_concurrency is not None
            and self.concurrency > self.max_concurrency
        ):
            raise ConfigError(
                f"concurrency={self.concurrency} is above max_concurrency={self.max_concurrency}: concurrency pins "
                "the connections per host, max_concurrency bounds the level measured when it is not pinned; give "
                "one of them (or a concurrency within the bound)"
            )

    def with_keywords(self, **given: Any) -> ReadOptions:
        """These options with the keyword arguments a dataset was given (None: not given) filled in; a setting
        given both here and as a keyword, with two values, is refused."""
        changes = {}
        for name, value in given.items():
            if value is None:
                continue
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
