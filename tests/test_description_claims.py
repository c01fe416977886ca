"""What a wids dataset description claims about its shards is said back to the user when it would hide data."""

import json
import warnings

import pytest

import wds_cloud as wds

from .test_resume import write_shards


def describe(tmp_path, counts):
    urls = write_shards(tmp_path, [3] * len(counts))
    rows = [{"url": u.rsplit("/", 1)[1], "nsamples": n} for u, n in zip(urls, counts)]
    path = tmp_path / "desc.json"
    path.write_text(json.dumps({"__kind__": "wids-shard-index-v1", "wids_version": 1, "shardlist": rows}))
    return str(path), urls


def test_a_shard_claimed_empty_is_named_in_a_warning(tmp_path):
    """A count of 0 would hide a shard's samples without a word (it is never opened): the user is told which."""
    path, urls = describe(tmp_path, [3, 0, 3, 0])
    with pytest.warns(UserWarning, match=r"2 of 4 shards with 'nsamples': 0 .*p01\.tar.*write the description again"):
        ds = wds.ShardListDataset(path, transformations=[])
    assert len(ds) == 6


def test_a_description_without_empty_shards_says_nothing(tmp_path):
    """No warning when every shard is claimed to hold samples."""
    path, _ = describe(tmp_path, [3, 3])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(wds.ShardListDataset(path, transformations=[])) == 6
