"""bench/bench_scale.py, the growth benchmark: its slope, and a quick run whose output parses."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "bench_scale.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_scale", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_scale"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_slope_is_the_exponent_of_growth():
    """The slope of log(cost) on log(size) is 2 for a quadratic cost, 0 for a bound, and skips failed cells."""
    bench = load_bench()
    cells = [{"size": n, "status": "ok", "seconds": 3e-6 * n * n, "bytes": 5e6} for n in (10, 100, 1000)]
    cells.append({"size": 10000, "status": "timeout", "note": "> 60 s"})
    assert abs(bench.slope(cells, "seconds") - 2.0) < 1e-9
    assert abs(bench.slope(cells, "bytes")) < 1e-9
    assert bench.slope(cells[:1], "seconds") is None


def test_quick_run_prints_a_table_and_writes_json(tmp_path):
    """`--quick --rows datafile-size --json` measures three sizes in child processes and writes figures with slopes."""
    out = tmp_path / "scale.json"
    run = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
            "--rows",
            "datafile-size",
            "--json",
            str(out),
            "--data",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| datafile-size | seconds |" in run.stdout
    row = json.loads(out.read_text())["rows"]["datafile-size"]
    assert [c["size"] for c in row["cells"]] == [10, 100, 1000]
    assert all(c["status"] == "ok" and c["seconds"] > 0 for c in row["cells"]), row["cells"]
    assert isinstance(row["slopes"]["seconds"], float)


def test_unknown_row_is_refused_naming_the_rows(tmp_path):
    """An unknown --rows name exits 2 naming the rows there are."""
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--rows", "nope", "--data", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert "rerun" in run.stderr and "nope" in run.stderr
