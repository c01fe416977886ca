"""Two checkouts of wds_cloud side by side on the local rows, in alternating fresh processes: is a change slower?

Whole benchmark scripts run once per version move 20-30% between rounds on a shared 2-core machine (the peer
column of ``bench_read.py``, the noise gauge, moves as much), so a best of two rounds cannot show 2% either way.
This one runs each version in ``--processes`` fresh processes, alternating (old, new, old, new, ...), each the best
of ``--epochs`` epochs over the benchmark's own shards, and prints the best over the processes of each version and
their ratio: a version is measured at its quietest moments, and the two get the same chances at them.

    python bench/bench_ab.py /path/to/other/checkout [--rows tiny,medium,views,large] [--processes 6] [--epochs 30]

The other checkout is a git worktree of this repository (``git worktree add --detach /tmp/base REV``); its code is
imported from there, the current tree's from here (neither installed copy).  Rows: ``tiny`` (200,000 tiny samples),
``medium`` (8,000 samples, the trainer touching the jpg bytes), ``views`` (the same with ``zero_copy=True``),
``large`` (64 members of 8 MB).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ROWS = ("tiny", "medium", "views", "large")
PLUGINS: dict = {}  # checkout -> the folder that gives its plugins package

_CHILD = """
import sys, time
# an editable install's finder would give the installed checkout whatever sys.path says: this checkout's code
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path[:0] = [{code!r}, {plugins!r}]
import wds_cloud as wds
assert wds.__file__.startswith({code!r}), wds.__file__
spec, zero_copy, touch, epochs = {spec!r}, {zero_copy!r}, {touch!r}, {epochs!r}
best = 0.0
for i in range(epochs + 1):
    started, n = time.perf_counter(), 0
    for sample in wds.WebDataset(spec, shardshuffle=False, **({{"zero_copy": True}} if zero_copy else {{}})):
        if touch:
            sample[touch][0]
        n += 1
    if i:
        best = max(best, n / (time.perf_counter() - started))
print(best)
"""


def spec_of(row: str) -> str:
    sys.path.insert(0, HERE)
    import common

    name = {"tiny": "tiny", "large": "large"}.get(row, "medium")
    shape = {"tiny": (8, 25000, common.tiny), "medium": (8, 1000, common.medium), "large": (4, 16, common.large)}
    return common.dataset(name, *shape[name])[0]


def plugins_of(code: str) -> str:
    """A folder in which ``wds_cloud_plugins`` is the checkout's ``plugins`` (the built-in backends' package)."""
    import tempfile

    folder = tempfile.mkdtemp(prefix="bench-ab-")
    os.symlink(os.path.join(code, "plugins"), os.path.join(folder, "wds_cloud_plugins"))
    return folder


def rate(code: str, row: str, spec: str, epochs: int) -> float:
    script = _CHILD.format(
        code=code,
        plugins=PLUGINS[code] if code in PLUGINS else PLUGINS.setdefault(code, plugins_of(code)),
        spec=spec,
        zero_copy=row == "views",
        touch="jpg" if row in ("medium", "views") else None,
        epochs=epochs,
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=code)
    if done.returncode:
        raise SystemExit(f"the run of {code} failed:\n{done.stderr[-2000:]}")
    return float(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("other", help="the other checkout (a git worktree of this repository)")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated: " + ", ".join(ROWS))
    parser.add_argument("--processes", type=int, default=6, help="fresh processes per version (default 6)")
    parser.add_argument("--epochs", type=int, default=30, help="timed epochs per process, tiny and large a fifth")
    args = parser.parse_args()
    other = os.path.abspath(args.other)
    if not os.path.isdir(os.path.join(other, "wds_cloud")):
        parser.error(f"{other} holds no wds_cloud package: give a checkout of this repository")
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown or args.processes < 1 or args.epochs < 1:
        parser.error(f"--rows from {', '.join(ROWS)}; --processes and --epochs at least 1")
    try:
        compare(other, rows, args.processes, args.epochs)
    finally:
        import shutil

        for folder in PLUGINS.values():
            shutil.rmtree(folder, ignore_errors=True)


def compare(other: str, rows: list, processes: int, epochs_given: int) -> None:
    print(f"other: {other}\nthis:  {ROOT}\n")
    print("| row | other (samples/s) | this (samples/s) | this / other |\n|---|---|---|---|")
    for row in rows:
        spec = spec_of(row)
        epochs = max(1, epochs_given // 5) if row in ("tiny", "large") else epochs_given
        best = {"other": 0.0, "this": 0.0}
        for _ in range(processes):
            for name, code in (("other", other), ("this", ROOT)):
                best[name] = max(best[name], rate(code, row, spec, epochs))
        print(
            f"| {row} | {best['other']:,.0f} | {best['this']:,.0f} | {best['this'] / best['other']:.3f} |", flush=True
        )


if __name__ == "__main__":
    main()
