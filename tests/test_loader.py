"""Real DataLoader workers: forked and spawned, each reading its own shards."""

import pytest

import wds_cloud as wds

torch = pytest.importorskip("torch")


def test_webloader_two_forked_workers(shards):
    """Two workers split the shards: every sample exactly once."""
    ds = wds.WebDataset(shards, shardshuffle=False).decode().to_tuple("cls")
    loader = wds.WebLoader(ds, batch_size=None, num_workers=2)
    got = sorted(int(x[0]) for x in loader)
    assert got == list(range(30))


def test_spawned_workers_receive_the_pipeline(shards):
    """with_length pipelines pickle, so spawn-started workers work."""
    ds = wds.WebDataset(shards, shardshuffle=False).decode().to_tuple("cls").with_length(30)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    assert sorted(int(x[0]) for x in loader) == list(range(30))


def test_webloader_fluent_and_epoch(shards):
    """WebLoader has the fluent methods and passes set_epoch to its dataset."""
    ds = wds.WebDataset(shards, shardshuffle=True).decode().to_tuple("cls").batched(5)
    loader = wds.WebLoader(ds, batch_size=None, num_workers=0).unbatched().shuffle(10).batched(6)
    loader.set_epoch(3)
    assert ds.pipeline[0].epoch == 3
    assert sorted(int(x) for b in loader for x in b[0]) == list(range(30))
