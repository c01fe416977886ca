"""The worker result pipe: WebLoader's wide pipe next to the default one, samples/s, in one run.

The DataLoader row of ``bench_peers.py`` (8,000 samples of a ~15.5 KB JPEG, json and cls; batches of 64 pickled
through the workers' result pipe, ~1 MB each) through ``WebLoader`` with 2 workers, two ways, alternating, best
of ``--repeat`` epochs after one untimed epoch each:

- ``wide``: the default: WebLoader's multiprocessing context, whose result pipe is widened to
  ``wds_cloud.loader.pipes.PIPE_BYTES`` (256 KiB) when a worker first puts a batch in it;
- ``default pipe``: the same loader given ``multiprocessing_context="fork"`` (what a program choosing its own
  context gets: the kernel's 64 KiB pipe).

Both with workers started each epoch and with ``persistent_workers=True``.  Linux only (elsewhere no pipe is
widened).

    python bench/bench_pipes.py [--repeat 6]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


def epoch(loader) -> float:
    started, n = time.perf_counter(), 0
    for batch in loader:
        for value in batch[0]:
            value[0]
            n += 1
    return n / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=6)
    args = parser.parse_args()
    import wds_cloud as wds
    from wds_cloud.loader import pipes

    if pipes.context() is None:
        raise SystemExit("pipes are widened on Linux only: nothing to compare here")
    spec, _ = common.dataset("medium", 8, 1000, common.medium)
    files = [os.path.join(os.path.dirname(spec), f"medium-{i:04d}.tar") for i in range(8)]

    def loader(narrow: bool, persistent: bool):
        ds = wds.WebDataset(files, shardshuffle=False).to_tuple("jpg", "cls").batched(64)
        extra = {"multiprocessing_context": "fork"} if narrow else {}
        return wds.WebLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent, **extra)

    print(f"pipe allowance of this user: {pipes.allowance()} pages; a wide pipe asks {pipes.PIPE_BYTES} bytes")
    print("| workers | wide pipe (default) | default pipe (64 KiB) | wide / default |")
    print("|---|---|---|---|")
    for persistent in (False, True):
        loaders = {narrow: loader(narrow, persistent) for narrow in (False, True)}
        best = {narrow: 0.0 for narrow in loaders}
        for one in loaders.values():
            epoch(one)
        for _ in range(args.repeat):
            for narrow, one in loaders.items():
                best[narrow] = max(best[narrow], epoch(one))
        what = "persistent" if persistent else "started each epoch"
        print(f"| {what} | {best[False]:,.0f} | {best[True]:,.0f} | {best[False] / best[True]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
