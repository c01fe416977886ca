"""Preemptible training: a job stopped on 2 ranks continues its epoch on 3, every sample exactly once.

Runs on one machine with no GPU: it writes a small dataset, starts 2 ranks (torch.distributed over gloo,
2 DataLoader workers each) that read a few batches and take a checkpoint with
``loader.state_dict(gather=True)`` (every rank gets the same merged state; rank 0 saves it), then starts
3 ranks (1 worker each) that load it and finish the epoch.  It checks that what was trained on before
and after the restart is the whole epoch, each sample once.

    python docs/examples/elastic_resume.py
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


def write_dataset(directory: str) -> list:
    """Twelve shards of 5 to 12 samples; returns their paths."""
    urls = []
    for s in range(12):
        path = os.path.join(directory, f"train-{s:04d}.tar")
        with tarfile.open(path, "w") as tar:
            for i in range(5 + (s * 7) % 8):
                data = f"sample {s}/{i}".encode()
                info = tarfile.TarInfo(f"{s:04d}_{i:04d}.txt")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        urls.append(path)
    return urls


def keys(batch: list) -> list:
    return [key for (key,) in batch]


def make_loader(urls: list, workers: int) -> wds.WebLoader:
    dataset = (
        wds.WebDataset(urls, shardshuffle=True, seed=1234, nodesplitter=wds.split_by_node)
        .shuffle(10)
        .to_tuple("__key__")
    )
    return wds.WebLoader(dataset, batch_size=4, num_workers=workers, collate_fn=keys)


def run(rank: int, world_size: int, port: int, urls: list, workdir: str, phase: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    seen = []
    if phase == "before":
        loader = make_loader(urls, workers=2)
        it = iter(loader)
        for _ in range(3 + rank):  # the ranks need not be at the same batch: only at the same step
            seen += next(it)
        state = loader.state_dict(gather=True)  # a collective: every rank calls it, every rank gets it
        del it
        if rank == 0:
            with open(os.path.join(workdir, "checkpoint.json"), "w") as f:
                json.dump(state, f)  # with the model's weights, in a real job
    else:
        loader = make_loader(urls, workers=1)  # another shape: 3 ranks x 1 worker
        with open(os.path.join(workdir, "checkpoint.json")) as f:
            loader.load_state_dict(json.load(f))
        for batch in loader:  # this rank's share of the rest of the epoch
            seen += batch
    with open(os.path.join(workdir, f"{phase}-{rank}.json"), "w") as f:
        json.dump(seen, f)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    with tempfile.TemporaryDirectory() as workdir:
        urls = write_dataset(workdir)
        for phase, world_size in (("before", 2), ("after", 3)):
            mp.spawn(run, args=(world_size, free_port(), urls, workdir, phase), nprocs=world_size)
        parts = {
            phase: [json.load(open(os.path.join(workdir, f"{phase}-{r}.json"))) for r in range(n)]
            for phase, n in (("before", 2), ("after", 3))
        }
        before = [k for part in parts["before"] for k in part]
        after = [k for part in parts["after"] for k in part]
        everything = sum(5 + (s * 7) % 8 for s in range(12))
        print(
            f"before the restart (2 ranks x 2 workers): {len(before)} samples; after it (3 ranks x 1 worker): "
            f"{[len(p) for p in parts['after']]} per rank"
        )
        assert len(set(before + after)) == len(before + after) == everything, "a sample was lost or repeated"
        print(f"the epoch's {everything} samples, each exactly once")
    sys.exit(0)


if __name__ == "__main__":
    main()
