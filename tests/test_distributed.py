"""Two ranks x two DataLoader workers on this machine: torch.distributed with gloo, started by the test."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from .cloud import free_port
from .test_resume import write_shards

pytest.importorskip("torch")

RANK_SCRIPT = textwrap.dedent("""
    import json
    import sys

    import torch.distributed as dist

    import wds_cloud as wds


    def main():
        rank, port, out, urls, index, context = (int(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4]),
                                                 sys.argv[5], sys.argv[6])
        # rank and world size reach wds_cloud only through the process group (no RANK/WORLD_SIZE variables)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        result = {"epochs": [], "again": None, "batches": []}

        ds = wds.WebDataset(urls, shardshuffle=True, seed=17, nodesplitter=wds.split_by_node).to_tuple("__key__")
        loader = wds.WebLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=context)
        for epoch in range(2):
            loader.set_epoch(epoch)
            result["epochs"].append([key for (key,) in loader])
        loader.set_epoch(0)
        result["again"] = [key for (key,) in loader]

        # equal work: uneven shards, counts from the index; every rank must make the same number of batches
        eq = (wds.WebDataset(index, shardshuffle=True, seed=5, nodesplitter=wds.split_by_node, equal_work="min")
              .to_tuple("__key__").batched(4, collation_fn=list))
        eq_loader = wds.WebLoader(eq, batch_size=None, num_workers=2, multiprocessing_context=context)
        for epoch in range(2):
            n = sum(1 for _ in eq_loader)
            result["batches"].append(n)
            counts = [0, 0]
            dist.all_gather_object(counts, n)  # every rank reaches this collective once per epoch
        dist.barrier()
        dist.destroy_process_group()
        with open(out, "w") as f:
            json.dump(result, f)


    if __name__ == "__main__":  # spawned DataLoader workers import this file again
        main()
""")


def wait_for_ranks(procs, timeout=900):
    """Wait for every rank process (each started in a session of its own, ``start_new_session=True``); fail naming
    the hang or the first rank's error output.  The bound is a hang's, not a speed's: spawned workers import torch
    afresh every pass, minutes on a loaded 2-core machine.  On a hang the whole session goes, the rank's DataLoader
    workers with it (a worker left alive holds the rank's stderr open, and reading it would never end)."""
    errors = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.communicate(timeout=60)
            pytest.fail("a rank hung")
        errors.append((proc.returncode, err.decode()[-3000:]))
    for code, err in errors:
        assert code == 0, err


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_two_ranks_two_workers(tmp_path, context):
    """fork: workers inherit the process group; spawn: they learn the rank from the pickled dataset."""
    sizes = [7, 12, 5, 9, 11, 6, 8, 10]  # 68 samples in 8 shards: 4 slots (2 ranks x 2 workers)
    urls = write_shards(tmp_path, sizes)
    index = tmp_path / "index.json"
    index.write_text(
        json.dumps({"shardlist": [{"url": u.rsplit("/", 1)[1], "nsamples": n} for u, n in zip(urls, sizes)]})
    )
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "WDS_SEED")}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                str(rank),
                str(port),
                str(tmp_path / f"r{rank}.json"),
                json.dumps(urls),
                str(index),
                context,
            ],
            env=env,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        for rank in range(2)
    ]
    wait_for_ranks(procs)
    results = [json.loads((tmp_path / f"r{rank}.json").read_text()) for rank in range(2)]
    everything = sorted(f"s{s:02d}_{i:04d}" for s, n in enumerate(sizes) for i in range(n))
    for epoch in range(2):
        parts = [r["epochs"][epoch] for r in results]
        assert sorted(parts[0] + parts[1]) == everything  # every sample exactly once across the ranks
        assert not set(parts[0]) & set(parts[1])
    for r in results:
        assert r["epochs"][0] != r["epochs"][1]  # a new order every epoch
        assert r["again"] == r["epochs"][0]  # and the same order for the same (seed, epoch)
    shards = [[{key.split("_")[0] for key in r["epochs"][epoch]} for epoch in range(2)] for r in results]
    assert any(mine[0] != mine[1] for mine in shards)  # a rank does not keep the same shard subset
    # equal work: the same number of batches on both ranks, in both epochs
    assert results[0]["batches"] == results[1]["batches"]
    assert all(n > 0 for n in results[0]["batches"])
