"""``webdataset.tariterators`` kept as a module path.

The key rules and grouping live in :mod:`wds_cloud.tar.samples`, the resumable
shard reader in :mod:`wds_cloud.tar.shardreader`.

Trainers replace this module's functions (NeMo assigns ``tariterators.url_opener`` to read
its own URLs; stable-audio-tools and Lhotse replace ``group_by_keys`` or
``tar_file_expander``). webdataset's ``tarfile_samples`` looks them up here each time it
runs, and so do ours: while all four (``url_opener``, ``tar_file_iterator``,
``tar_file_expander``, ``group_by_keys``) are the library's own, the resumable shard reader
reads the shards; once one is replaced, a pass calls them as webdataset does,
``group_by_keys(tar_file_expander(url_opener(src, handler=h), handler=h, ...), handler=h)``,
and that pass cannot be resumed exactly (``state_dict()`` says so, naming the function).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional, Union

from . import utils as _utils
from .errors import ConfigError
from .handlers import reraise_exception
from .stages import pipelinefilter
from .tar import samples as _samples
from .tar import shardreader as _shardreader
from .tar.grouping import shard_samples
from .tar.samples import (
    base_plus_ext,
    group_by_keys,
    key_rule,
    last_dot_split,
    meta_prefix,
    meta_suffix,
    tar_file_expander,
    tar_file_iterator,
    url_opener,
    valid_sample,
)
from .tar.shardreader import TarSamples

__all__ = [
    "base_plus_ext",
    "last_dot_split",
    "key_rule",
    "valid_sample",
    "url_opener",
    "tar_file_iterator",
    "tar_file_expander",
    "group_by_keys",
    "tarfile_samples",
    "tarfile_to_samples",
    "TarSamples",
    "meta_prefix",
    "meta_suffix",
    "shard_samples",
    "pipelinefilter",
    "replaced_functions",
    "replaced_in_webdataset",
    "replaced_for_webdataset",
    "trace",
    "shardlist",
]

#: what webdataset's ``tarfile_samples`` and the functions it calls look up in this module each time they run,
#: and so what user code replaces here to change how shards are read; ours, to tell a replacement
_LOOKED_UP = (
    "url_opener",
    "tar_file_iterator",
    "tar_file_expander",
    "group_by_keys",
    "valid_sample",
    "meta_prefix",
    "meta_suffix",
)
_OURS: dict[str, Any] = {name: getattr(_samples, name) for name in _LOOKED_UP}
#: what webdataset 1.0.2's ``WebDataset`` does not take from here: it opens with its own opener and expands and
#: groups with the functions its ``compat`` module imported (replacing ``compat.group_by_keys`` reaches it)
_NOT_IN_WEBDATASET = ("url_opener", "tar_file_expander", "group_by_keys")
_COMPAT = "wds_cloud.compat"


def _differs(value: Any, ours: Any) -> bool:
    return value is not ours and not (isinstance(ours, str) and value == ours)


def replaced_functions() -> list[str]:
    """The names (``tariterators.url_opener``...) of what user code has replaced here that ``tarfile_samples``
    and ``tarfile_to_samples`` look up when a pass begins."""
    module = sys.modules[__name__]
    return [f"tariterators.{n}" for n in _LOOKED_UP if _differs(getattr(module, n, _OURS[n]), _OURS[n])]


def replaced_in_webdataset() -> list[str]:
    """As :func:`replaced_functions`, for ``WebDataset``: what webdataset 1.0.2's ``WebDataset`` would call of
    what user code replaced (``tariterators.tar_file_iterator``, ``valid_sample``; ``compat.tar_file_expander``,
    ``compat.group_by_keys``)."""
    names = [n for n in replaced_functions() if n.split(".", 1)[1] not in _NOT_IN_WEBDATASET]
    compat = sys.modules.get(_COMPAT)  # above this module on the data path: looked up, never imported here
    if compat is not None:
        names += [f"compat.{n}" for n in ("tar_file_expander", "group_by_keys") if getattr(compat, n) is not _OURS[n]]
    return names


class _Replaced:
    """One pass composed of the functions user code replaced (and ours for the rest), called as webdataset calls
    them: ``group_by_keys(tar_file_expander(url_opener(src, handler=h), handler=h, ...), handler=h)``."""

    def __init__(self, names: list[str], webdataset: bool) -> None:
        self.names = names
        module = sys.modules[__name__]
        for meta in ("meta_prefix", "meta_suffix"):
            if f"tariterators.{meta}" in names:
                raise ConfigError(
                    f"wds_cloud.tariterators.{meta} was replaced ({getattr(module, meta)!r}), but the reader skips "
                    f"members named {_OURS['meta_prefix']}...{_OURS['meta_suffix']} by a rule of its own, which this "
                    "setting does not change: put it back, and choose members with select_files= (or rename_files=)"
                )
        #: WebDataset opens shards with its own opener (cache, storage options); tarfile_samples with url_opener
        self.webdataset = webdataset
        self.url_opener = module.url_opener
        self.tar_file_iterator = module.tar_file_iterator
        self.valid_sample = module.valid_sample
        where = sys.modules.get(_COMPAT) if webdataset else module
        self.tar_file_expander = getattr(where, "tar_file_expander", _OURS["tar_file_expander"])
        self.group_by_keys = getattr(where, "group_by_keys", _OURS["group_by_keys"])

    def __str__(self) -> str:
        return ", ".join(f"wds_cloud.{name}" for name in self.names)

    def samples(
        self,
        src: Iterable[dict],
        handler: Callable,
        select_files: Optional[Callable],
        rename_files: Optional[Callable],
        grouping: dict,
        opened: Callable[[Iterable[dict]], Iterator[dict]],
    ) -> Iterator[dict]:
        """The pass; ``opened(src)`` gives ``{"url", "stream"[, "local_path"]}`` items with the reader's own opener."""
        # Keywords webdataset passes are passed; ours (select/rename, key rules) only when set, so a replacement
        # written for an older webdataset, with fewer parameters, is called as it expects.
        streams = opened(src) if self.webdataset else self.url_opener(src, handler=handler)
        files_kw = {k: v for k, v in (("select_files", select_files), ("rename_files", rename_files)) if v is not None}
        if self.tar_file_expander is _OURS["tar_file_expander"] and _differs(
            self.tar_file_iterator, _OURS["tar_file_iterator"]
        ):
            files = _expand_with(self.tar_file_iterator, streams, handler, files_kw)
        else:
            files = self.tar_file_expander(streams, handler=handler, **files_kw)
        samples = self.group_by_keys(files, handler=handler, **grouping)
        if self.group_by_keys is _OURS["group_by_keys"] and _differs(self.valid_sample, _OURS["valid_sample"]):
            # webdataset's group_by_keys asks this module's valid_sample of each sample it would yield
            samples = (sample for sample in samples if self.valid_sample(sample))
        return samples


def _expand_with(iterate: Callable, streams: Iterable[dict], handler: Callable, files_kw: dict) -> Iterator[dict]:
    """webdataset's ``tar_file_expander`` over a replaced ``tar_file_iterator``: its members tagged with the
    shard's URL, an empty dict after each shard (the end of a shard ends its last sample)."""
    for source in streams:
        try:
            for sample in iterate(source["stream"], handler=handler, **files_kw):
                sample["__url__"] = source["url"]
                if source.get("local_path") is not None:
                    sample["__local_path__"] = source["local_path"]
                yield sample
            yield {}
        except Exception as exn:
            exn.args = exn.args + (source.get("url"),)
            if handler(exn):
                continue
            break
        finally:
            _samples.close_quietly(source.get("stream"))


def _replaced_now() -> Optional[_Replaced]:
    """What the shard reader of ``tarfile_to_samples`` composes a pass of, when something here was replaced (None:
    the reader reads it itself)."""
    names = replaced_functions()
    return _Replaced(names, webdataset=False) if names else None


def replaced_for_webdataset() -> Optional[_Replaced]:
    """What ``WebDataset``'s shard reader composes a pass of (see :func:`replaced_in_webdataset`), or None."""
    names = replaced_in_webdataset()
    return _Replaced(names, webdataset=True) if names else None


def tarfile_samples(
    src: Iterable[dict],
    handler: Callable = reraise_exception,
    select_files: Optional[Callable] = None,
    rename_files: Optional[Callable] = None,
    **kw: Any,
) -> Iterator[dict]:
    """Samples from a stream of ``{"url": ...}`` shard descriptions (see :func:`wds_cloud.tar.shardreader.tarfile_samples`);
    the functions of this module that user code replaced take effect, as in webdataset."""
    return _shardreader.tarfile_samples(
        src, handler=handler, select_files=select_files, rename_files=rename_files, replaced=_replaced_now, **kw
    )


def tarfile_to_samples(handler: Callable = reraise_exception, **kw: Any) -> TarSamples:
    """The shard reader stage (``{"url": ...}`` items in, samples out): a resumable :class:`TarSamples`, which
    reads through this module's functions while user code has replaced one of them (see the module's doc)."""
    return _shardreader.tarfile_to_samples(handler=handler, replaced=_replaced_now, **kw)


#: webdataset's debugging switch: user code that replaces ``group_by_keys`` (stable-audio-tools' does) reads it
#: and prints each member when it is true; the library's own reader prints nothing
trace = False


def shardlist(urls: Union[str, Iterable[str]], *, shuffle: bool = False) -> Iterator[dict]:
    """``{"url": ...}`` items for ``urls`` (a brace pattern or a list), in a random order if ``shuffle``
    (webdataset's helper)."""
    listed = list(_utils.expand_braces(urls)) if isinstance(urls, str) else list(urls)
    if shuffle:
        random.shuffle(listed)
    for url in listed:
        yield {"url": url}
