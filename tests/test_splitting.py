"""Splitting by rank (from the environment here; torch.distributed in test_distributed.py), epochs, equal work."""

import json
import subprocess
import sys

import pytest

import wds_cloud as wds
from wds_cloud import utils

from .test_resume import write_shards

SIZES = [7, 12, 5, 9, 11, 6, 8, 10]


@pytest.fixture
def index(tmp_path):
    urls = write_shards(tmp_path, SIZES)
    path = tmp_path / "index.json"
    path.write_text(
        json.dumps({"shardlist": [{"url": u.rsplit("/", 1)[1], "nsamples": n} for u, n in zip(urls, SIZES)]})
    )
    return str(path)


def as_rank(monkeypatch, rank, world_size=2, variable="RANK"):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world_size))


def keys(ds):
    return [s["__key__"] for s in ds]


@pytest.mark.parametrize("variable", ["RANK", "LOCAL_RANK"])
def test_ranks_from_the_environment_partition_every_epoch(index, monkeypatch, variable):
    parts = {}
    for rank in (0, 1):
        as_rank(monkeypatch, rank, variable=variable)
        ds = wds.WebDataset(index, shardshuffle=True, seed=3, nodesplitter=wds.split_by_node)
        parts[rank] = [keys(ds), keys(ds)]  # epochs 0 and 1
    for epoch in (0, 1):
        both = parts[0][epoch] + parts[1][epoch]
        assert len(both) == sum(SIZES) and len(set(both)) == sum(SIZES)
    assert parts[0][0] != parts[0][1]


def test_single_node_only_names_the_fix(index, monkeypatch):
    as_rank(monkeypatch, 1)
    with pytest.raises(ValueError, match="nodesplitter=wds.split_by_node"):
        list(wds.WebDataset(index))


@pytest.mark.parametrize("policy", ["min", "max", 9])
def test_equal_work_gives_every_rank_the_same_count(index, monkeypatch, policy):
    counts = {}
    for rank in (0, 1):
        as_rank(monkeypatch, rank)
        ds = wds.WebDataset(index, shardshuffle=True, seed=5, nodesplitter=wds.split_by_node, equal_work=policy)
        counts[rank] = [len(keys(ds)) for _ in range(3)]
    assert counts[0] == counts[1]
    if policy == 9:
        assert counts[0] == [9, 9, 9]
    else:
        # the shares of the two ranks are the shard totals at even and odd positions of each epoch's order
        from wds_cloud.shardlists import slot_shards

        for epoch, n in enumerate(counts[0]):
            totals = [sum(SIZES[i] for i in slot) for slot in slot_shards(len(SIZES), 5, epoch, 2, 1)]
            assert n == (min(totals) if policy == "min" else max(totals))


def test_equal_work_needs_counts_or_a_number(tmp_path):
    urls = write_shards(tmp_path, [3, 4])
    with pytest.raises(ValueError, match="nsamples"):
        wds.WebDataset(urls, equal_work="min")
    with pytest.raises(ValueError, match="equal_work=-1"):
        wds.WebDataset(urls, equal_work=-1)


def test_equal_work_with_too_few_shards_says_so(index, monkeypatch):
    as_rank(monkeypatch, 0, world_size=16)
    ds = wds.WebDataset(index, nodesplitter=wds.split_by_node, equal_work="min")
    with pytest.raises(ValueError, match="gets no samples this epoch"):
        list(ds)


def test_resampled_is_deterministic_per_rank_and_epoch(tmp_path, monkeypatch):
    urls = write_shards(tmp_path, [5] * 6)

    def draw(rank, epoch):
        as_rank(monkeypatch, rank)
        ds = wds.WebDataset(urls, resampled=True, seed=8, nodesplitter=wds.split_by_node).with_epoch(20)
        ds.set_epoch(epoch)
        return keys(ds)

    assert draw(0, 0) == draw(0, 0)
    assert draw(0, 0) != draw(1, 0)
    assert draw(0, 0) != draw(0, 1)


def test_seed_from_the_environment_is_an_integer(tmp_path, monkeypatch):
    urls = write_shards(tmp_path, [3] * 5)
    monkeypatch.setenv("WDS_SEED", "42")
    assert wds.WebDataset(urls).seed == 42
    monkeypatch.setenv("WDS_SEED", "forty-two")
    with pytest.raises(ValueError, match="WDS_SEED"):
        wds.WebDataset(urls)


def test_group_argument_reaches_torch_distributed(monkeypatch):
    """split_by_node(group=g) asks torch.distributed about that group."""
    torch = pytest.importorskip("torch")
    calls = []
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: calls.append(group) or 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 3)
    assert list(wds.split_by_node(range(9), group="g")) == [1, 4, 7]
    assert calls == ["g"]
    assert utils.pytorch_worker_info()[:2] == (1, 3)


def test_the_readme_recipe_runs():
    """docs/examples/ddp_equal_work.py: two ranks over gloo, equal batches, a mid-epoch resume."""
    pytest.importorskip("torch")
    import pathlib

    script = pathlib.Path(__file__).resolve().parents[1] / "docs" / "examples" / "ddp_equal_work.py"
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run(
        [sys.executable, "-W", "ignore", str(script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ok: both ranks made the same number of batches" in out.stdout


@pytest.mark.parametrize("persistent", [False, True])
def test_torch_dataloader_epochs_advance_without_set_epoch(tmp_path, persistent):
    """torch's DataLoader restarts its workers from the main process's copy every epoch; the shard
    order still moves on, and is the one set_epoch(n) would give."""
    torch = pytest.importorskip("torch")
    urls = write_shards(tmp_path, [4] * 8)

    def loader(epoch=None):
        ds = wds.WebDataset(urls, shardshuffle=True, seed=3).to_tuple("__key__")
        if epoch is not None:
            ds.set_epoch(epoch)
        return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent)

    dl = loader()
    passes = [[k for (k,) in dl] for _ in range(3)]
    assert passes[0] != passes[1] != passes[2]
    assert passes == [[k for (k,) in loader(e)] for e in range(3)]
