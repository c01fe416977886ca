"""Real training loops drive our loaders as they drive webdataset's: Lightning's default Trainer and
torchdata's StatefulDataLoader call ``state_dict()`` on their own, with every checkpoint or batch, and
Lightning calls ``iter()`` once only to check that a loader is iterable.

These run the trainers themselves (no stand-ins): whatever they call, when they call it, is what users get.
"""

import json

import pytest

import wds_cloud as wds

from .test_resume import write_shards

torch = pytest.importorskip("torch")
pl = pytest.importorskip("pytorch_lightning")

# Lightning warns about this small set-up (few workers, no GPU, its own deprecations); not ours to change.
pytestmark = [
    pytest.mark.torch,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


@pytest.fixture
def urls(tmp_path):
    (tmp_path / "shards").mkdir()
    return write_shards(tmp_path / "shards", [24, 24, 24, 24])


class Recorder(pl.LightningModule):
    """A model whose training step records the sample keys of each batch it is given."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen = []

    def training_step(self, batch, index):
        self.seen.append(list(batch[0]))
        return self.layer(torch.ones(1, 1)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer(root, **kw):
    return pl.Trainer(
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        accelerator="cpu",
        **kw,
    )


def resumable_loader(urls):
    dataset = wds.WebDataset(urls, shardshuffle=100).to_tuple("__key__").batched(4)
    return wds.WebLoader(dataset, batch_size=None, num_workers=2)


def readme_loader(urls):
    """webdataset's README pattern: a shuffle of shard URLs before the reader, and a shuffle after the workers."""
    dataset = wds.DataPipeline(
        wds.SimpleShardList(urls),
        wds.shuffle(10),
        wds.split_by_worker,
        wds.tarfile_to_samples(),
        wds.shuffle(20),
        wds.to_tuple("__key__"),
        wds.batched(4),
    )
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=2)
    return loader.unbatched().shuffle(30).batched(4)


def test_default_trainer_checkpoints_a_loader_that_cannot_be_resumed(urls, tmp_path):
    """Lightning's default Trainer (a checkpoint after every epoch) trains on webdataset's README pipeline;
    the checkpoint holds an inexact state, and resuming from it restarts the data of the next epoch."""
    model = Recorder()
    trainer(tmp_path, max_epochs=2).fit(model, train_dataloaders=readme_loader(urls))
    assert sum(len(batch) for batch in model.seen) == 2 * 96
    [checkpoint] = tmp_path.glob("**/*.ckpt")
    state = torch.load(checkpoint, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert "inexact" in state and json.loads(json.dumps(state)) == state
    again = Recorder()
    trainer(tmp_path / "again", max_epochs=3).fit(again, train_dataloaders=readme_loader(urls), ckpt_path=checkpoint)
    assert sum(len(batch) for batch in again.seen) == 96


def test_lightning_resumes_mid_epoch_where_the_checkpoint_stood(urls, tmp_path):
    """A mid-epoch checkpoint resumes the epoch where Lightning's loader stood: nothing repeated.

    Lightning's fetcher asks for one batch ahead, so its checkpoint after step 10 is taken with batch 11
    already drawn: that batch is the one not trained on (as with any stateful loader under Lightning).
    """
    whole = Recorder()
    trainer(tmp_path / "whole", max_epochs=2, enable_checkpointing=False).fit(
        whole, train_dataloaders=resumable_loader(urls)
    )
    first = Recorder()
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=10, save_last=True)
    trainer(tmp_path / "first", max_steps=10, callbacks=[saver]).fit(first, train_dataloaders=resumable_loader(urls))
    rest = Recorder()
    trainer(tmp_path / "rest", max_epochs=2).fit(
        rest, train_dataloaders=resumable_loader(urls), ckpt_path=tmp_path / "ckpt" / "last.ckpt"
    )
    assert len(whole.seen) == 48 and first.seen == whole.seen[:10]
    assert first.seen + rest.seen == whole.seen[:10] + whole.seen[11:]


def test_an_end_of_epoch_checkpoint_resumes_with_a_whole_epoch(urls, tmp_path):
    """Resumed from the checkpoint after epoch 0 (Lightning's default), training reads one whole epoch; the
    iter() Lightning calls only to check that the loader is iterable uses up no epoch."""
    whole = Recorder()
    trainer(tmp_path / "whole", max_epochs=2, enable_checkpointing=False).fit(
        whole, train_dataloaders=resumable_loader(urls)
    )
    first = Recorder()
    trainer(tmp_path / "first", max_epochs=1).fit(first, train_dataloaders=resumable_loader(urls))
    [checkpoint] = (tmp_path / "first").glob("**/*.ckpt")
    rest = Recorder()
    trainer(tmp_path / "rest", max_epochs=2).fit(rest, train_dataloaders=resumable_loader(urls), ckpt_path=checkpoint)
    assert first.seen == whole.seen[:24]  # epoch 0's order, though Lightning called iter() twice
    keys = [key for batch in rest.seen for key in batch]
    assert len(keys) == len(set(keys)) == 96


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_iterates_a_pipeline_that_cannot_be_resumed(urls, num_workers):
    """torchdata's StatefulDataLoader asks the dataset for its state in every worker with every batch:
    a pipeline that cannot be resumed still iterates, and its state loads as a restart."""
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    def make():
        dataset = wds.DataPipeline(
            wds.SimpleShardList(urls),
            wds.shuffle(10),
            wds.split_by_worker,
            wds.tarfile_to_samples(),
            wds.shuffle(20),
            wds.to_tuple("__key__"),
        )
        return sdl.StatefulDataLoader(dataset, batch_size=4, num_workers=num_workers)

    loader = make()
    batches = 0
    for batches, _ in enumerate(loader, 1):
        if batches == 5:
            state = loader.state_dict()
    assert batches == 24
    again = make()
    again.load_state_dict(state)
    assert sum(len(keys) for (keys,) in again) == 96  # the pass starts again: nothing is lost
