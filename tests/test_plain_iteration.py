"""Pipelines of the user's own functions and generators iterate through WebLoader and DataLoader as in webdataset.

Resume never gets in the way: a pipeline that cannot be resumed iterates like any other, its
``state_dict()`` (which trainers call on their own) gives an inexact state saying why, and only
``state_dict(strict=True)`` raises.
"""

import json
import logging
import random

import pytest

import wds_cloud as wds
from wds_cloud.errors import NotResumableError, StateMismatchError
from wds_cloud.filters import _shuffle
from wds_cloud.tariterators import base_plus_ext, tar_file_expander, url_opener, valid_sample

from .test_resume import write_shards

torch = pytest.importorskip("torch")


def log_and_continue(exn):
    logging.getLogger("test").info("skipping: %r", exn)
    return True


def group_by_keys_nothrow(data, keys=base_plus_ext, lcase=True, suffixes=None, handler=None):
    """A trainer's own grouping loop: never raises on a repeated field, starts a new sample instead."""
    current = None
    for filesample in data:
        if "fname" not in filesample:  # the end-of-shard marker
            continue
        fname, value = filesample["fname"], filesample["data"]
        prefix, suffix = keys(fname)
        if prefix is None:
            continue
        if lcase:
            suffix = suffix.lower()
        if current is None or prefix != current["__key__"] or suffix in current:
            if valid_sample(current):
                yield current
            current = {"__key__": prefix, "__url__": filesample["__url__"]}
        if suffixes is None or suffix in suffixes:
            current[suffix] = value
    if valid_sample(current):
        yield current


def tarfile_to_samples_nothrow(src, handler=log_and_continue):
    """The trainer's own sample source, composed from the upstream building blocks."""
    return group_by_keys_nothrow(tar_file_expander(url_opener(src, handler=handler), handler=handler), handler=handler)


class detshuffle2(wds.PipelineStage):
    """A trainer's own shard shuffle, seeded by (seed, epoch), on top of the private ``_shuffle``."""

    def __init__(self, bufsize=1000, initial=100, seed=0, epoch=-1):
        self.bufsize, self.initial, self.seed, self.epoch = bufsize, initial, seed, epoch

    def run(self, src):
        self.epoch += 1
        rng = random.Random(self.seed + self.epoch)
        return _shuffle(src, self.bufsize, self.initial, rng)


def clip_style_pipeline(urls, batch_size=8):
    """The default training set-up of a widely used CLIP trainer, rebuilt on our API."""
    return wds.DataPipeline(
        wds.SimpleShardList(urls),
        detshuffle2(bufsize=2000, initial=500, seed=0),
        wds.split_by_node,
        wds.split_by_worker,
        tarfile_to_samples_nothrow,
        wds.shuffle(bufsize=5000, initial=1000),
        wds.select(lambda sample: "txt" in sample),
        wds.decode(handler=log_and_continue),
        wds.rename(text="txt", label="bin"),
        wds.map_dict(text=str.upper),
        wds.to_tuple("text", "label"),
        wds.batched(batch_size, partial=False),
    )


def texts(batches):
    return sorted(t for batch in batches for t in batch[0])


@pytest.fixture
def urls(tmp_path):
    return write_shards(tmp_path, [20, 20, 20, 20])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_clip_style_pipeline_iterates_through_webloader(urls, num_workers):
    """The CLIP trainer's pipeline (own generator source, then shuffle and batched) yields its batches."""
    dataset = clip_style_pipeline(urls).with_epoch(5)
    loader = wds.WebLoader(
        dataset, batch_size=None, shuffle=False, num_workers=num_workers, persistent_workers=num_workers > 0
    )
    loader.num_batches = 5  # trainers set attributes on the loader
    for _epoch in range(2):
        batches = list(loader)
        assert len(batches) == 5 * max(1, num_workers)
        assert all(len(batch[0]) == 8 for batch in batches)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_non_resumable_pipeline_gives_the_same_samples_as_dataloader(urls, num_workers):
    """WebLoader and torch's DataLoader deliver the same samples from a pipeline that cannot be resumed."""
    web = list(wds.WebLoader(clip_style_pipeline(urls), batch_size=None, num_workers=num_workers))
    plain = list(torch.utils.data.DataLoader(clip_style_pipeline(urls), batch_size=None, num_workers=num_workers))
    assert texts(web) == texts(plain)
    assert len(texts(web)) == 80 - 80 % 8 if num_workers == 0 else len(texts(web)) == len(texts(plain))


def test_state_dict_of_a_non_resumable_pipeline_names_the_stage_and_the_fix(urls):
    """state_dict(strict=True) raises, naming the shuffle that no shard reader feeds and what would make it resumable."""
    dataset = clip_style_pipeline(urls)
    it = iter(dataset)
    next(it)
    with pytest.raises(
        NotResumableError,
        match=r"stage 5 \(shuffle\(bufsize=5000\)\).*stage 4 "
        r"\(function tarfile_to_samples_nothrow\).*tarfile_to_samples\(\)",
    ):
        dataset.state_dict(strict=True)
    loader = wds.WebLoader(clip_style_pipeline(urls), batch_size=None, num_workers=0)
    assert len(list(loader)) == 10
    with pytest.raises(NotResumableError, match="stage 5") as info:
        loader.state_dict(strict=True)
    assert isinstance(info.value, StateMismatchError) and isinstance(info.value, TypeError)


def test_state_dict_of_a_non_resumable_pipeline_is_inexact_and_restarts_the_pass(urls, caplog):
    """Without strict, trainers' own calls never raise: the state says why it is inexact (logged once), and
    loading it starts the pass again, as webdataset would."""
    dataset = clip_style_pipeline(urls)
    it = iter(dataset)
    next(it)
    with caplog.at_level("WARNING", logger="wds_cloud.resume"):
        state = dataset.state_dict()
        dataset.state_dict()
    assert "stage 5" in state["inexact"] and json.loads(json.dumps(state)) == state
    assert sum("stage 5" in r.getMessage() for r in caplog.records) <= 1
    again = clip_style_pipeline(urls)
    with pytest.warns(wds.InexactResumeWarning, match="starts again"):
        again.load_state_dict(state)
    assert texts(list(again)) == texts(list(clip_style_pipeline(urls)))
    loader = wds.WebLoader(clip_style_pipeline(urls), batch_size=None, num_workers=0)
    first = list(loader)
    state = loader.state_dict()
    assert state["inexact"] and state["epoch"] == 1  # the pass had ended: the next one is epoch 1
    fresh = wds.WebLoader(clip_style_pipeline(urls), batch_size=None, num_workers=0)
    with pytest.warns(wds.InexactResumeWarning, match="WebLoader state cannot be resumed exactly") as caught:
        fresh.load_state_dict(state)
    assert len(caught) == 1
    assert len(list(fresh)) == len(first)


def passthrough(src):
    """A user's generator stage that passes everything through."""
    yield from src


def count_calls(item):
    return item


#: a resumable pipeline; a user's generator or plain function goes in at every position
BASE = [
    lambda urls: wds.SimpleShardList(urls),
    lambda urls: wds.split_by_worker,
    lambda urls: wds.tarfile_to_samples(),
    lambda urls: wds.shuffle(30, initial=10),
    lambda urls: wds.decode(),
    lambda urls: wds.to_tuple("txt", "bin"),
    lambda urls: wds.batched(4),
]


def build(urls, insert_at=None, stage=passthrough):
    stages = [make(urls) for make in BASE]
    if insert_at is not None:
        stages.insert(insert_at, stage)
    return wds.DataPipeline(*stages)


@pytest.mark.parametrize("loader", ["WebLoader", "DataLoader"])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("insert_at", list(range(1, len(BASE) + 1)))
@pytest.mark.parametrize("stage", [passthrough, wds.map(count_calls)], ids=["generator", "map"])
def test_user_stages_at_every_position_iterate_as_without_them(urls, loader, num_workers, insert_at, stage):
    """A user's generator or function anywhere in the pipeline changes nothing about the samples delivered."""
    make = wds.WebLoader if loader == "WebLoader" else torch.utils.data.DataLoader
    got = list(make(build(urls, insert_at, stage), batch_size=None, num_workers=num_workers))
    want = list(make(build(urls), batch_size=None, num_workers=num_workers))
    assert texts(got) == texts(want) and len(texts(got)) == 80


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_shard_shuffle_before_the_reader_iterates_and_explains_itself(urls, num_workers):
    """webdataset's README pipeline (a shuffle of the shard list, then the reader) iterates; its state says why not."""
    dataset = wds.DataPipeline(
        wds.SimpleShardList(urls),
        wds.shuffle(100),
        wds.split_by_worker,
        wds.tarfile_to_samples(),
        wds.shuffle(50),
        wds.to_tuple("txt", "bin"),
        wds.batched(4),
    )
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=num_workers)
    assert len(texts(list(loader))) == 80
    with pytest.raises(NotResumableError, match=r"stage 1 .*stage 0 \(SimpleShardList\)"):
        loader.state_dict(strict=True)
    assert "stage 1" in loader.state_dict()["inexact"]


def test_a_stage_whose_state_fails_never_interrupts_iteration(urls):
    """A user stage whose state_dict() raises: iteration goes on; WebLoader.state_dict() reports the error.  (After
    the shuffle: one with a state between the reader and the shuffle is refused for that first.)"""

    class Fragile(wds.PipelineStage):
        def run(self, src):
            return iter(src)

        def state_dict(self):
            raise RuntimeError("my stage keeps no state")

        def load_state_dict(self, state):
            pass

    dataset = build(urls, 4, Fragile())
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=2)
    iterator = iter(loader)
    assert len(texts([next(iterator) for _ in range(10)])) == 40
    with pytest.raises(NotResumableError, match="my stage keeps no state"):
        loader.state_dict(strict=True)
    assert "my stage keeps no state" in loader.state_dict()["inexact"]
    with pytest.raises(NotResumableError, match="my stage keeps no state"):
        dataset.state_dict(strict=True)


def test_webloader_resumes_a_nested_pipeline_exactly(tmp_path):
    """A shuffle inside a nested pipeline: its journals are kept until a whole buffer replaces them."""
    urls = write_shards(tmp_path, [300, 300, 300, 300])

    def loader():
        inner = wds.WebDataset(urls, shardshuffle=False).shuffle(40, seed=5)
        return wds.WebLoader(
            wds.DataPipeline(inner, wds.to_tuple("__key__"), wds.batched(4)), batch_size=None, num_workers=2
        )

    whole = [k for batch in loader() for k in batch[0]]
    first = loader()
    it = iter(first)
    got = [k for _ in range(200) for k in next(it)[0]]  # past several journal rounds
    state = first.state_dict()
    del it
    again = loader()
    again.load_state_dict(state)
    got += [k for batch in again for k in batch[0]]
    assert got == whole
