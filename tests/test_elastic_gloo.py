"""``state_dict(gather=True)`` across two real ranks (torch.distributed with gloo, started by the test): every
rank gets the same merged state, which a job of another shape then finishes, every sample exactly once."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from .cloud import free_port
from .test_distributed import wait_for_ranks
from .test_elastic import EVERYTHING, SIZES, assert_exactly_once, finish, make_loader
from .test_resume import write_shards

pytest.importorskip("torch")

RANK_SCRIPT = textwrap.dedent("""
    import json
    import sys

    import torch.distributed as dist

    import wds_cloud as wds
    from wds_cloud.loader import webloader

    merges = []
    merge_states = webloader.merge_states
    webloader.merge_states = lambda states: merges.append(len(states)) or merge_states(states)  # counted


    def keys(batch):
        return [s["__key__"] for s in batch]


    def main():
        rank, port, out, urls, steps = int(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5])
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        ds = wds.WebDataset(urls, shardshuffle=True, seed=11, nodesplitter=wds.split_by_node).shuffle(6)
        loader = wds.WebLoader(ds, batch_size=3, num_workers=2, collate_fn=keys)
        delivered = []
        it = iter(loader)
        for _ in range(steps):
            delivered += next(it)
        merged = loader.state_dict(gather=True)  # a collective: both ranks call it at this step
        del it
        dist.barrier()
        dist.destroy_process_group()
        with open(out, "w") as f:
            json.dump({"delivered": delivered, "merged": merged, "merges": merges}, f)


    if __name__ == "__main__":
        main()
""")


def test_gather_merges_every_ranks_state(tmp_path):
    """Two gloo ranks stop, gather and merge (once, on one rank), each gets the same merged state; jobs of other
    shapes finish from it, every sample exactly once."""
    urls = write_shards(tmp_path, SIZES)
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
                str(4 + 3 * rank),
            ],
            env=env,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        for rank in range(2)
    ]
    wait_for_ranks(procs)
    results = [json.loads((tmp_path / f"r{rank}.json").read_text()) for rank in range(2)]
    assert results[0]["merged"] == results[1]["merged"]  # every rank holds the same merged state
    assert results[0]["merges"] + results[1]["merges"] == [2]  # merged once, on one rank, from both ranks' states
    before = results[0]["delivered"] + results[1]["delivered"]
    assert len(before) == 3 * (4 + 7)
    for shape in [(3, 1), (1, 2)]:
        after, _ = finish(lambda w: make_loader(urls, w), shape, results[0]["merged"])
        assert_exactly_once(before, after, EVERYTHING)


def test_the_elastic_example_runs():
    """docs/examples/elastic_resume.py: 2 ranks stop and gather, 3 ranks finish, each sample once."""
    import pathlib

    script = pathlib.Path(__file__).resolve().parents[1] / "docs" / "examples" / "elastic_resume.py"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "WDS_SEED")}
    out = subprocess.run(
        [sys.executable, "-W", "ignore", str(script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "each exactly once" in out.stdout
