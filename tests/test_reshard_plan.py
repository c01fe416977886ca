"""reshard's output does not depend on how many workers ran it: the cut planned on Dask is one process's cut."""

from __future__ import annotations

import array
import json
import random

import pytest

import wds_cloud as wds
from wds_cloud.cli import main
from wds_cloud.tools.dask import OutputCut, plan_outputs

distributed = pytest.importorskip("distributed")


def sequential_spans(inputs, maxcount, maxsize):
    """(number, input, first sample, count) per output, sample by sample as the one-process reshard cuts."""
    cut, spans = OutputCut(maxcount, maxsize), []
    for index, sizes in enumerate(inputs):
        for position, size in enumerate(sizes):
            number = cut.shard_for(size)
            if not spans or spans[-1][0] != number:
                spans.append([number, index, position, 0])
            spans[-1][3] += 1
    return [tuple(s) for s in spans]


def test_the_plan_cuts_as_one_process_does():
    """plan_outputs over measured weights (empty inputs, samples past maxsize) gives the sequential cut."""
    rng = random.Random(5)
    for _ in range(200):
        inputs = [[rng.choice([0, 1, 5, 40, 300]) for _ in range(rng.choice([0, 0, 1, 3, 17]))] for _ in range(6)]
        maxcount, maxsize = rng.choice([1, 2, 7, 1000]), rng.choice([1, 50, 10**9])
        packed = (array.array("q", sizes).tobytes() for sizes in inputs)
        got = [(s.number, s.start, s.first, s.count) for s in plan_outputs(packed, maxcount, maxsize)]
        assert got == sequential_spans(inputs, maxcount, maxsize)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("in")
    urls = []
    for s, n in enumerate([100, 100, 0, 100, 100, 100, 100]):
        url = str(root / f"in-{s}.tar")
        with wds.TarWriter(url) as writer:
            for i in range(n):
                writer.write({"__key__": f"{s}-{i:04d}", "txt": b"x" * (i % 7 + 1), "cls": str(i % 3)})
        urls.append(url)
    return urls


def reshard(capsys, *args):
    code = main(["reshard", *args, "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def test_dask_writes_what_one_process_writes_with_1_2_3_workers(shards, tmp_path, capsys):
    """--maxcount 250 gave 6 shards of 100 on Dask (one per input) where one process gives 250, 250, 100: now the
    same names and bytes with 1, 2 and 3 workers, and a rerun on Dask of the one-process job keeps its shards."""
    flags = ["--maxcount", "250", "--maxsize", "1200", "--compress", "gz"]  # both limits cut here
    one = reshard(capsys, *shards, str(tmp_path / "one" / "s-%04d.tar"), *flags)
    expected = {p.name: p.read_bytes() for p in (tmp_path / "one").glob("*.tar")}
    assert len(expected) == one["shards"] > 1
    for workers in (1, 2, 3):
        with distributed.LocalCluster(
            n_workers=workers, threads_per_worker=1, processes=False, protocol="tcp://", dashboard_address=":0"
        ) as cluster:
            address = cluster.scheduler.address
            dest = tmp_path / f"w{workers}"
            got = reshard(capsys, *shards, str(dest / "s-%04d.tar"), *flags, "--scheduler", address)
            assert got == one
            assert {p.name: p.read_bytes() for p in dest.glob("*.tar")} == expected
            if workers == 2:  # the one-process job, continued on Dask: its shards are kept
                (tmp_path / "one" / "s-0001.tar").unlink()
                again = reshard(capsys, *shards, str(tmp_path / "one" / "s-%04d.tar"), *flags, "--scheduler", address)
                assert (again["written"], again["kept"]) == (1, one["shards"] - 1)
                assert (tmp_path / "one" / "s-0001.tar").read_bytes() == expected["s-0001.tar"]


def test_a_rerun_with_nothing_to_do_says_the_job_was_complete(shards, tmp_path, capsys):
    """A rerun of a finished job read "0 samples into 0 shards": it says the job was complete and what it kept."""
    dest = str(tmp_path / "out" / "s-%04d.tar")
    assert main(["reshard", *shards, dest, "--maxcount", "250"]) == 0
    capsys.readouterr()
    assert main(["reshard", *shards, dest, "--maxcount", "250"]) == 0
    out = capsys.readouterr().out
    assert "already complete" in out and "kept all 3 shards (600 samples)" in out


def test_index_output_rerun_keeps_the_complete_index(shards, tmp_path, capsys):
    """`index --output` run again rebuilt the index it had written; it keeps it (and rewrites a changed one)."""
    out = tmp_path / "d.json"
    assert main(["index", *shards, "--format", "wids", "--output", str(out)]) == 0
    out.write_bytes(out.read_bytes())  # same bytes, a new mtime: still the job's own output
    before = out.stat().st_mtime_ns
    capsys.readouterr()
    assert main(["index", *shards, "--format", "wids", "--output", str(out)]) == 0
    assert "already complete" in capsys.readouterr().out and out.stat().st_mtime_ns == before
    out.write_bytes(out.read_bytes() + b" ")
    assert main(["index", *shards, "--format", "wids", "--output", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out


def test_a_rerun_refusal_names_the_flags_typed():
    """A refusal listed another command's settings as flags of this one (`--per`, FUNCTION for a reshard)."""
    from wds_cloud.cli.console import job_conflict
    from wds_cloud.errors import ConfigError

    def refusal(rows):
        return job_conflict(ConfigError("x", conflict=rows, destination="out/s-%04d.tar", record="out/s-N.json"))

    old_dask = refusal(
        [
            ("tool", "map", "reshard"),
            ("compress", None, "keep"),
            ("function", "wds_cloud.tools.dask:passthrough", None),
            ("per", "shard", None),
        ]
    )
    assert "--per" not in old_dask and "FUNCTION" not in old_dask and "earlier version" in old_dask, old_dask
    other = refusal([("tool", "map", "reshard"), ("function", "m:f", None), ("maxcount", None, 250)])
    assert "`wds-cloud map` (FUNCTION m:f)" in other and "--maxcount" not in other, other
    same = refusal([("maxcount", 250, 200), ("compress", "keep", "gz")])
    assert "rerun with --maxcount 250 --compress keep" in same, same
    counts = refusal([("inputs", "6 inputs", "5 inputs")])
    assert "6 inputs" in counts and "something else" not in counts, counts
