"""WebLoader's DataLoader labels a batch for the profiler only while a profiler records (wds_cloud.loader.torchloader).

torch's iterator entered ``record_function`` for every batch, profiler or not (about a fifth of the main
process's CPU per batch): the count of those entries per batch is pinned at 0 without a profiler, and under one
every batch still carries torch's label; the batches are torch's DataLoader's either way.
"""

from __future__ import annotations

import warnings

import pytest

import wds_cloud as wds

from .test_resume import write_shards

torch = pytest.importorskip("torch")

LABEL = "enumerate(DataLoader)#"


@pytest.fixture
def entered(monkeypatch):
    """How many times ``record_function`` was entered by a DataLoader iterator (its label)."""
    count = []
    real = torch.autograd.profiler.record_function.__enter__

    def enter(self):
        if str(self.name).startswith(LABEL):
            count.append(self.name)
        return real(self)

    monkeypatch.setattr(torch.autograd.profiler.record_function, "__enter__", enter)
    return count


def _dataset(tmp_path):
    if not (tmp_path / "p00.tar").exists():
        write_shards(tmp_path, [20, 20, 20, 20])
    urls = [str(tmp_path / f"p{s:02d}.tar") for s in range(4)]
    return wds.WebDataset(urls, shardshuffle=False).to_tuple("txt", "bin").batched(8)


def _loader(tmp_path, workers, **kw):
    return wds.WebLoader(_dataset(tmp_path), batch_size=None, num_workers=workers, **kw)


def _expected(tmp_path, workers, **kw) -> list:
    """The batches torch's own DataLoader gives for the same dataset."""
    loader = torch.utils.data.DataLoader(_dataset(tmp_path), batch_size=None, num_workers=workers, **kw)
    return [tuple(map(list, b)) for b in loader]


@pytest.mark.parametrize("workers,kw", [(0, {}), (2, {}), (2, {"persistent_workers": True})])
def test_no_profiler_label_per_batch_unless_a_profiler_records(tmp_path, entered, workers, kw):
    loader = _loader(tmp_path, workers, **kw)
    expected = _expected(tmp_path, workers, **kw)
    for _ in range(2):  # a second pass too (persistent workers: the iterator is reset, not made anew)
        entered.clear()
        got = [tuple(map(list, b)) for b in loader]
        assert sorted(got) == sorted(expected) and len(got) == 10
        assert entered == []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = [tuple(map(list, b)) for b in loader]
    assert sorted(got) == sorted(expected)
    labels = [e.name for e in prof.events() if e.name.startswith(LABEL)]
    assert len(labels) >= len(got)  # torch's label on every batch (and on the pass's last, empty next())
    # named as torch's iterators name them (the adversary's finding: tools keyed on torch's names missed them)
    kind = "_MultiProcessingDataLoaderIter" if workers else "_SingleProcessDataLoaderIter"
    assert set(labels) == {f"{LABEL}{kind}.__next__"}, set(labels)


def test_a_profiler_started_mid_pass_sees_the_batches_from_then_on(tmp_path, entered):
    loader = _loader(tmp_path, 0)
    it = iter(loader)
    for _ in range(3):
        next(it)
    assert entered == []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        for _ in range(4):
            next(it)
    assert len(entered) == 4
    entered.clear()
    assert len(list(it)) == 3 and entered == []


def test_torchs_warning_on_a_length_outrun_still_comes(tmp_path):
    """After len(loader) was asked, torch's iterator warns when more batches come than the length said: such
    a pass goes through torch's own next(), warning included."""
    from wds_cloud.loader.torchloader import TorchLoader

    urls = write_shards(tmp_path, [20, 20])
    dataset = wds.WebDataset(urls, shardshuffle=False).to_tuple("txt").batched(8).with_length(2)
    inner = TorchLoader(dataset, batch_size=None)
    assert isinstance(inner, torch.utils.data.DataLoader)
    assert len(inner) == 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert len(list(inner)) == 5
    assert any("Length of IterableDataset" in str(w.message) for w in caught)


def test_the_shared_memory_of_persistent_workers_goes_with_their_loader(tmp_path):
    """The adversary's finding: persistent workers exit when their loader goes, long after its pass ended, and
    their rings of shared memory stayed mapped in the main process until another loader's pass ran."""
    import gc

    from wds_cloud.loader import unframe

    urls = []
    for s in range(2):
        urls.append(str(tmp_path / f"big{s}.tar"))
        with wds.TarWriter(urls[-1]) as sink:
            for i in range(8):
                sink.write({"__key__": f"{s}_{i}", "bin": bytes([i]) * 65536})
    ds = wds.WebDataset(urls, shardshuffle=False).to_tuple("bin")
    loader = wds.WebLoader(ds, batch_size=4, num_workers=2, persistent_workers=True)
    before = set(unframe.RINGS)
    assert len(list(loader)) == 4
    assert set(unframe.RINGS) - before  # the workers' rings, mapped while they live
    del loader
    gc.collect()
    assert not set(unframe.RINGS) - before
