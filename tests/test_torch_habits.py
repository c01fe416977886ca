"""A torch user's habits: a dataset given to torch's DataLoader workers and asked for its state in the main
process, a state loaded on another shape, a WebLoader's statistics, and a folder read as a directory queue."""

import inspect
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import wds_cloud as wds
from wds_cloud import shardlists

from .test_resume import write_shards

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch

QUEUE_WARNING = "ignore:DirectoryShardList.*work queue:UserWarning"


@pytest.fixture
def urls(tmp_path):
    (tmp_path / "shards").mkdir()
    return write_shards(tmp_path / "shards", [30, 30, 30, 30])


def keys_dataset(urls):
    return wds.WebDataset(urls, shardshuffle=False).to_tuple("__key__")


def read_some(loader, n):
    for i, _ in enumerate(loader, 1):
        if i == n:
            break


# a state taken from the object torch's DataLoader copied into its workers


@pytest.mark.parametrize("persistent", [False, True])
def test_a_dataset_handed_to_dataloader_workers_refuses_its_state(urls, persistent):
    """DataLoader(ds, batch_size=None, num_workers=2), as webdataset's README does: ds.state_dict() in the main
    process is refused, naming the loaders that take exact states, in every epoch, and so is a pipeline's
    that wraps it."""
    ds = keys_dataset(urls)
    outer = wds.DataPipeline(ds, wds.batched(4))
    for dataset in (ds, outer):
        loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, persistent_workers=persistent)
        for _epoch in range(2):
            read_some(loader, 5)
            for asked in (ds, dataset):
                with pytest.raises(wds.NotResumableError, match="WebLoader.*StatefulDataLoader"):
                    asked.state_dict()
                with pytest.raises(wds.NotResumableError, match="num_workers=0"):
                    asked.state_dict(strict=True)
        del loader


@pytest.mark.slow  # a spawned worker imports torch afresh
@pytest.mark.parametrize("start_method", ["spawn", "forkserver"], indirect=True)  # fork: the test above
def test_a_dataset_pickled_for_spawned_workers_refuses_its_state(urls, start_method):
    """Workers started by spawn or forkserver receive the dataset pickled: the main process's copy refuses too."""
    ds = keys_dataset(urls)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context=start_method)
    read_some(loader, 3)
    with pytest.raises(wds.NotResumableError, match="handed to torch DataLoader worker processes"):
        ds.state_dict()


def test_states_that_are_exact_are_never_refused(urls):
    """Before any hand-off, with num_workers=0, after a pass in this process, and through a WebLoader, the state
    is given (and resumes exactly)."""
    ds = keys_dataset(urls)
    fresh = ds.state_dict()  # checkpointed before any iteration
    whole = [k for (k,) in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)]
    again = keys_dataset(urls)
    again.load_state_dict(fresh)
    assert [k for (k,) in again] == whole
    read_some(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2), 3)
    it = iter(ds)  # a pass in this process: the state describes it
    [next(it) for _ in range(7)]
    state = ds.state_dict()
    rest = keys_dataset(urls)
    rest.load_state_dict(state)
    assert [k for (k,) in rest] == whole[7:]
    loader = wds.WebLoader(keys_dataset(urls).batched(4), batch_size=None, num_workers=2)
    read_some(loader, 3)
    assert "inexact" not in loader.state_dict(strict=True)


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_stateful_dataloader_resumes_exactly(urls, num_workers):
    """torchdata's StatefulDataLoader, the documented alternative, resumes our dataset exactly with 0, 1, 2
    workers: the state is taken in its workers, never refused."""
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    def make():
        return sdl.StatefulDataLoader(keys_dataset(urls), batch_size=4, num_workers=num_workers)

    whole = [list(keys) for (keys,) in make()]
    loader = make()
    first = []
    for batch, (keys,) in enumerate(loader, 1):
        first.append(list(keys))
        if batch == 7:
            state = loader.state_dict()
            break
    again = make()
    again.load_state_dict(state)
    assert first + [list(keys) for (keys,) in again] == whole


@pytest.mark.slow  # Lightning's import (shared with test_trainers.py in a whole run)
@pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning's advice about this small set-up; not ours
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_lightning_with_a_plain_dataloader_refuses_the_datasets_state(urls, tmp_path):
    """Lightning training through torch's DataLoader with workers: a callback asking the dataset for its state
    gets the refusal with the fix, not a fresh state."""
    pl = pytest.importorskip("pytorch_lightning")
    ds = keys_dataset(urls)
    asked = []

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch, index):
            return self.layer(torch.ones(1, 1)).sum()

        def on_train_epoch_end(self):
            with pytest.raises(wds.NotResumableError, match="WebLoader") as refused:
                ds.state_dict()
            asked.append(refused.value)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        accelerator="cpu",
        max_epochs=1,
    )
    trainer.fit(Model(), train_dataloaders=torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2))
    assert len(asked) == 1


# a state loaded on another shape


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 3 workers on 2 cores: torch's advice
def test_a_state_of_two_workers_loaded_into_three_names_merge_states(urls):
    """A WebLoader state of 2 workers loaded into 3, and a worker's dataset state loaded into another worker,
    are refused with the documented fix: wds.merge_states, with the call."""
    loader = wds.WebLoader(keys_dataset(urls).batched(4), batch_size=None, num_workers=2)
    read_some(loader, 3)
    state = loader.state_dict()
    other = wds.WebLoader(keys_dataset(urls).batched(4), batch_size=None, num_workers=3)
    with pytest.raises(wds.StateMismatchError, match=r"num_workers=2.*wds\.merge_states\(\[state_of_rank_0"):
        other.load_state_dict(state)
    other.load_state_dict(wds.merge_states([state]))  # the fix works
    worker_state = dict(state["workers"])[1]
    ds = keys_dataset(urls)
    ds.load_state_dict(worker_state)  # worker 1 of 2, loaded into the main process (worker 0 of 1)
    with pytest.raises(wds.StateMismatchError, match=r"another shape.*wds\.merge_states"):
        next(iter(ds))


# WebLoader.stats


@pytest.mark.parametrize(
    "num_workers, persistent, resumable",
    [(0, False, True), (1, False, True), (2, False, True), (2, True, True), (2, False, False)],
    ids=["0", "1", "2", "2-persistent", "2-not-resumable"],
)
def test_webloader_stats_sum_the_workers_statistics(urls, num_workers, persistent, resumable):
    """WebLoader.stats counts what every worker read, cumulative over epochs: 4 local shards an epoch, whether
    the loader takes states or not."""
    dataset = keys_dataset(urls) if resumable else keys_dataset(urls).shuffle(5).shuffle(5)  # not resumable
    loader = wds.WebLoader(dataset.batched(4), batch_size=None, num_workers=num_workers, persistent_workers=persistent)
    assert (loader.resume_blocker() is None) == resumable
    for epoch in (1, 2):
        assert sum(len(keys) for (keys,) in loader) == 120
        stats = loader.stats
        assert stats.local_files == 4 * epoch and stats.local_bytes == 4 * epoch * os.path.getsize(urls[0])
    assert inspect.signature(wds.WebLoader).parameters["num_workers"].default == 0  # the reference shows it


# the directory queue


def folder_of_shards(tmp_path, n=3):
    folder = tmp_path / "queue"
    folder.mkdir()
    (folder / "src").mkdir()
    for path in write_shards(folder / "src", [5] * n):
        os.rename(path, folder / os.path.basename(path))
    os.rmdir(folder / "src")
    return folder


def names(folder):
    return sorted(os.listdir(folder))


def test_the_directory_queue_warns_once_naming_the_folder_and_the_way_out(tmp_path):
    """WebDataset("folder/") warns as it is built: the folder, the renaming, the loop, and a brace spec or a
    list as the way to read without that."""
    folder = folder_of_shards(tmp_path)
    with pytest.warns(UserWarning, match="work queue") as caught:
        wds.WebDataset(str(folder) + "/", shardshuffle=False)
    [warning] = caught
    text = str(warning.message)
    assert str(folder) in text and "renamed" in text and "until the program stops" in text and "glob" in text


@pytest.mark.filterwarnings(QUEUE_WARNING)
@pytest.mark.parametrize("stop", ["break", "error", "close", "gc", "interrupt", "end"])
def test_the_directory_queue_gives_names_back_on_every_stop(tmp_path, stop):
    """A consumer that breaks, raises, closes or drops the iterator, a KeyboardInterrupt, or a normal end: every
    file has its name again."""
    folder = folder_of_shards(tmp_path)
    before = names(folder)
    listing = shardlists.DirectoryShardList(str(folder), poll=None, mode="resample")
    if stop == "end":
        listing = shardlists.DirectoryShardList(str(folder), poll=None, mode="keep")
        assert len(list(listing)) == 3
        assert names(folder) == [n + "._done_" for n in before]
        return
    it = iter(listing)
    claimed = next(it)["url"]
    assert os.path.basename(claimed) not in before and os.path.exists(claimed)
    if stop == "break":
        for _ in it:
            break
        del it
    elif stop in ("error", "interrupt"):
        kind = RuntimeError if stop == "error" else KeyboardInterrupt

        def consume():
            for _ in it:
                raise kind("in user code")

        with pytest.raises(kind):
            consume()
        del it
    elif stop == "close":
        it.close()
    else:
        del it
    assert names(folder) == before


@pytest.mark.slow  # a fresh interpreter imports wds_cloud (and torch)
@pytest.mark.filterwarnings(QUEUE_WARNING)
def test_the_directory_queue_gives_names_back_when_the_process_ends(tmp_path):
    """A process ended by SIGTERM, whose handler exits, while its iterator holds a claim (the interpreter's exit
    then gives it back) leaves every name as it was; synchronised on the child's own line, not on time."""
    folder = folder_of_shards(tmp_path)
    before = names(folder)
    code = textwrap.dedent(
        f"""
        import signal, sys, warnings
        warnings.simplefilter("ignore")
        from wds_cloud import shardlists
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(3))
        HELD = iter(shardlists.DirectoryShardList({str(folder)!r}, poll=None))
        print(next(HELD)["url"], flush=True)
        sys.stdin.readline()
        """
    )
    with subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        claimed = child.stdout.readline().strip()
        assert os.path.exists(claimed) and names(folder) != before
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=120) == 3
    assert names(folder) == before


@pytest.mark.filterwarnings(QUEUE_WARNING)
def test_the_directory_queue_gives_names_back_when_dataloader_workers_shut_down(tmp_path):
    """WebDataset("folder/") read by DataLoader workers: once the loader is dropped and its workers have shut
    down, every file has its name again."""
    folder = folder_of_shards(tmp_path)
    before = names(folder)
    loader = torch.utils.data.DataLoader(
        wds.WebDataset(str(folder) + "/", shardshuffle=False).to_tuple("__key__"), batch_size=None, num_workers=2
    )
    it = iter(loader)
    [next(it) for _ in range(4)]
    it._shutdown_workers()  # what dropping the iterator does; joins the workers
    del it, loader
    assert names(folder) == before


@pytest.mark.filterwarnings(QUEUE_WARNING)
def test_a_stale_claim_never_replaces_a_file_of_its_name(tmp_path):
    """A claim left by a dead process, beside a file of the name it would get back (a shard written there again):
    both are kept, with a warning naming them, where the claim used to be renamed over the real shard."""
    folder = folder_of_shards(tmp_path, 2)
    shard = sorted(folder.iterdir())[0]
    stale = str(shard) + "._999999_"
    with open(stale, "wb") as f:
        f.write(b"CANARY")
    size = shard.stat().st_size
    with pytest.warns(UserWarning, match="cannot get its name back"):
        shardlists.cleanup_files_without_processes(str(folder))
    with open(stale, "rb") as f:
        assert shard.stat().st_size == size and f.read() == b"CANARY"


@pytest.mark.filterwarnings(QUEUE_WARNING)
def test_keep_mode_never_replaces_a_done_file(tmp_path):
    """mode="keep" gives a file read twice (written again after its first pass) a name of its own."""
    folder = folder_of_shards(tmp_path, 1)
    [shard] = os.listdir(folder)
    (folder / (shard + "._done_")).write_bytes(b"EARLIER")
    assert len(list(shardlists.DirectoryShardList(str(folder), poll=None, mode="keep"))) == 1
    assert (folder / (shard + "._done_")).read_bytes() == b"EARLIER"
    assert names(folder) == [shard + "._done_", shard + "._done_.1"]


@pytest.mark.filterwarnings(QUEUE_WARNING)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_error_in_the_dataset_gives_the_claim_back_at_once(tmp_path):
    """A shard that fails to read ends the pass with its error; the claimed file has its name again as the error
    leaves the loop (not when a collection gets to the traceback's frames), so a retry can read it."""
    import gc

    folder = folder_of_shards(tmp_path, 1)
    (folder / "broken.tar").write_bytes(b"x" * 700)
    before = names(folder)
    ds = wds.WebDataset(str(folder) + "/", shardshuffle=False, empty_check=False)
    gc.disable()
    try:
        for _ in range(3):
            with pytest.raises(wds.CorruptShardError):
                for _ in ds:
                    pass
            assert names(folder) == before
    finally:
        gc.enable()


def test_resume_blocker_names_a_shuffle_appended_to_the_loader(urls):
    """A shuffle after the workers (loader.unbatched().shuffle(n).batched(k)) makes mid-pass states inexact:
    resume_blocker() says so before any state is taken, as state_dict() does after."""
    loader = wds.WebLoader(keys_dataset(urls), batch_size=None, num_workers=0).unbatched().shuffle(10).batched(4)
    assert "shuffle in the dataset" in (loader.resume_blocker() or "")
    plain = wds.WebLoader(keys_dataset(urls), batch_size=None, num_workers=0)
    assert plain.resume_blocker() is None
