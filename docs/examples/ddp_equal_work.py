"""DDP without hangs: every rank gets the same number of batches, and training resumes mid-epoch.

Runs on one machine with no GPU: it writes a small dataset with shards of
uneven sizes and an index giving each shard's sample count, starts two ranks
(torch.distributed over gloo), and has each read its share through a
WebLoader with two workers for two epochs, checking that both ranks made the
same number of batches.  Rank 0 then saves a checkpoint mid-epoch and a new
loader continues from it.

    python docs/examples/ddp_equal_work.py
"""

import io
import json
import os
import socket
import sys
import tarfile
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp

import wds_cloud as wds


def write_dataset(directory: str) -> str:
    """Eight shards of 5 to 12 samples and a wids-style index with their counts; returns the index path."""
    sizes = [7, 12, 5, 9, 11, 6, 8, 10]
    entries = []
    for s, n in enumerate(sizes):
        name = f"train-{s:04d}.tar"
        with tarfile.open(os.path.join(directory, name), "w") as tar:
            for i in range(n):
                for ext, data in (("txt", f"sample {s}/{i}".encode()), ("cls", str(i % 3).encode())):
                    info = tarfile.TarInfo(f"{s:04d}_{i:04d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        entries.append({"url": name, "nsamples": n})
    index = os.path.join(directory, "train.json")
    with open(index, "w") as f:
        json.dump({"shardlist": entries}, f)
    return index


def make_loader(index: str) -> wds.WebLoader:
    dataset = (
        wds.WebDataset(
            index, shardshuffle=True, seed=1234, nodesplitter=wds.split_by_node, equal_work="min"
        )  # every worker of every rank: the same number of samples
        .shuffle(20)
        .decode()
        .to_tuple("txt", "cls")
        .batched(4)
    )
    return wds.WebLoader(dataset, batch_size=None, num_workers=2)


def rank_main(rank: int, world_size: int, port: int, index: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    loader = make_loader(index)
    for epoch in range(2):
        loader.set_epoch(epoch)  # a new shard order every epoch, the same on every rank
        batches = sum(1 for _ in loader)
        counts = [None] * world_size
        dist.all_gather_object(counts, batches)
        if rank == 0:
            print(f"epoch {epoch}: batches per rank {counts}")
        assert len(set(counts)) == 1, counts

    # Checkpoint after 2 batches of epoch 2, then continue in a new loader (as after a restart).
    loader.set_epoch(2)
    it = iter(loader)
    seen = [next(it) for _ in range(2)]
    checkpoint = json.dumps(loader.state_dict())  # save this with the model
    del it
    resumed = make_loader(index)
    resumed.load_state_dict(json.loads(checkpoint))
    rest = list(resumed)
    if rank == 0:
        print(
            f"resumed: {len(seen)} batches before the checkpoint, {len(rest)} after it "
            f"({len(checkpoint)} bytes of state)"
        )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        index = write_dataset(directory)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(rank_main, args=(2, port, index), nprocs=2, start_method="spawn")
        print("ok: both ranks made the same number of batches in every epoch")


if __name__ == "__main__":
    sys.exit(main())
