"""A resume state is input: a changed one never yields a partial or repeated sample, and its errors name the field."""

import copy
import json

import pytest

import wds_cloud as wds
from wds_cloud.errors import StateMismatchError

from .test_resume import write_shards


def build(urls):
    return wds.WebDataset(urls, shardshuffle=False).shuffle(5, seed=3)


@pytest.fixture
def saved(tmp_path):
    urls = write_shards(tmp_path, [10, 10, 10])
    ds = build(urls)
    it = iter(ds)
    for _ in range(12):
        next(it)
    return urls, json.loads(json.dumps(ds.state_dict()))


def stage(state, kind):
    return next(s[2] for s in state["stages"] if s[1] == kind)


def run(urls, state):
    ds = build(urls)
    ds.load_state_dict(state)
    return list(ds)


def test_an_untouched_state_resumes(saved):
    urls, state = saved
    assert len(run(urls, state)) == 30 - 12


def test_an_offset_moved_inside_a_sample_is_refused(saved):
    """An offset pointing at a member that does not begin a sample is refused: no partial sample."""
    urls, state = saved
    stage(state, "TarSamples")["offset"] += 1024  # the second member of the next sample
    with pytest.raises(StateMismatchError, match="expects the member") as info:
        run(urls, state)
    assert info.value.field == "offset"


@pytest.mark.parametrize(
    "change,field",
    [
        (lambda s: stage(s, "TarSamples").update(offset=100), "offset"),
        (lambda s: stage(s, "TarSamples").update(offset="abc"), "offset"),
        (lambda s: stage(s, "TarSamples").update(samples=None), "samples"),
        (lambda s: stage(s, "TarSamples").pop("url"), "url"),
        (lambda s: stage(s, "Shuffle").update(buffer=[[0, 1, 1]] * 200_000), "buffer"),
        (lambda s: stage(s, "Shuffle").update(buffer=[[77, 1, 1]]), "buffer"),
        (lambda s: stage(s, "Shuffle").update(buffer=[["x", 1, 1]]), "buffer"),
        (lambda s: stage(s, "Shuffle").update(urls={"a": 1}), "urls"),
        (lambda s: stage(s, "Shuffle").update(rng="seed"), "rng"),
        (lambda s: stage(s, "SimpleShardList").update(epoch="one"), "epoch"),
        (lambda s: s.update(stages={"a": 1}), "stages"),
        (lambda s: s.update(progress=[-1, 0]), "progress"),
        (lambda s: s["stages"].append("junk"), "stages"),
    ],
)
def test_changed_fields_are_named(saved, change, field):
    """Every wrong type or value is a StateMismatchError naming the field, never a TypeError or KeyError."""
    urls, state = saved
    state = copy.deepcopy(state)
    change(state)
    with pytest.raises(StateMismatchError) as info:
        run(urls, state)
    assert info.value.field == field


def test_a_shard_index_past_the_end_is_refused(saved):
    """shard=99 does not silently skip the rest of the epoch."""
    urls, state = saved
    reader = stage(state, "TarSamples")
    reader["shard"] = 99
    with pytest.raises(StateMismatchError, match="shard 99") as info:
        run(urls, state)
    assert info.value.field == "shard"


@pytest.mark.parametrize("offset", [512 * 10**12, 1 << 61])
def test_an_offset_no_file_can_hold_is_refused_by_name(saved, offset):
    """An offset past what the file system seeks to is a StateMismatchError naming the field (a bare OSError
    EINVAL from the seek before; adversary finding)."""
    urls, state = saved
    stage(state, "TarSamples")["offset"] = offset
    with pytest.raises(StateMismatchError, match="cannot hold|no tar member begins") as info:
        run(urls, state)
    assert info.value.field == "offset"
