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

import braceexpand

from .handlers import reraise_exception
from .stages import pipelinefilter
from .tar import samples as _samples
from .tar import shardreader as _shardreader
from .tar.samples import (
    base_plus_ext,
    group_by_keys,
    key_rule,
    last_dot_split,
    meta_prefix,
    meta_suffix,
    shard_samples,
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
    "trace",
    "shardlist",
]

#: the functions user code replaces in this module, and ours
_OURS: dict[str, Callable] = {
    "url_opener": _samples.url_opener,
    "tar_file_iterator": _samples.tar_file_iterator,
    "tar_file_expander": _samples.tar_file_expander,
    "group_by_keys": _samples.group_by_keys,
}


def replaced_functions() -> list[str]:
    """The names of this module's functions that user code has replaced (``tariterators.url_opener = mine``)."""
    module = sys.modules[__name__]
    return [name for name, ours in _OURS.items() if getattr(module, name, ours) is not ours]


class _Replaced:
    """One pass composed of this module's functions as they are now, called as webdataset calls them."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        module = sys.modules[__name__]
        self.url_opener = module.url_opener
        self.tar_file_iterator = module.tar_file_iterator
        self.tar_file_expander = module.tar_file_expander
        self.group_by_keys = module.group_by_keys

    def __str__(self) -> str:
        return ", ".join(f"wds_cloud.tariterators.{name}" for name in self.names)

    def samples(
        self,
        src: Iterable[dict],
        handler: Callable,
        select_files: Optional[Callable],
        rename_files: Optional[Callable],
        grouping: dict,
    ) -> Iterator[dict]:
        # Keywords webdataset passes are passed; ours (select/rename, key rules) only when set, so a replacement
        # written for an older webdataset, with fewer parameters, is called as it expects.
        streams = self.url_opener(src, handler=handler)
        files_kw = {k: v for k, v in (("select_files", select_files), ("rename_files", rename_files)) if v is not None}
        if (
            self.tar_file_expander is _samples.tar_file_expander
            and self.tar_file_iterator is not _OURS["tar_file_iterator"]
        ):
            files = _expand_with(self.tar_file_iterator, streams, handler, files_kw)
        else:
            files = self.tar_file_expander(streams, handler=handler, **files_kw)
        return self.group_by_keys(files, handler=handler, **grouping)


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
    """What the shard reader composes a pass of, when a function here was replaced (None: read it ourselves)."""
    names = replaced_functions()
    return _Replaced(names) if names else None


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
    listed = list(braceexpand.braceexpand(urls)) if isinstance(urls, str) else list(urls)
    if shuffle:
        random.shuffle(listed)
    for url in listed:
        yield {"url": url}
