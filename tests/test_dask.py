"""wds_cloud.dask.map_shards and ``wds-cloud map`` on a real Dask LocalCluster (2 worker processes)."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys
import threading
import time

import pytest

import wds_cloud as wds

from .test_resume import write_shards

distributed = pytest.importorskip("distributed")

from wds_cloud.dask import map_shards  # noqa: E402
from wds_cloud.errors import ConfigError  # noqa: E402

SIZES = [5, 9, 3, 7, 6]


def shout(sample):
    """Upper-case the text, drop every fourth sample (a filter and a map in one)."""
    if int(sample["__key__"].rsplit("_", 1)[1]) % 4 == 3:
        return None
    return {"__key__": sample["__key__"], "txt": sample["txt"].upper() + b"!"}


def fails_when_marked(sample):
    """Raises on shard 2 while the marker file named by MAP_TEST_MARKER exists (an interrupted job)."""
    marker = os.environ.get("MAP_TEST_MARKER")
    if marker and os.path.exists(marker) and sample["__key__"].startswith("s02_"):
        raise RuntimeError("interrupted")
    return shout(sample)


def bad_sample(sample):
    if sample["__key__"] == "s01_0004":
        raise ValueError("cannot process this one")
    return shout(sample)


def dies_once(sample):
    """Kills its worker process the first time it sees shard 3 (a machine lost mid-shard)."""
    marker = os.environ["MAP_TEST_MARKER"]
    if sample["__key__"] == "s03_0002":
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            pass
        else:
            os.close(fd)
            os._exit(1)
    return shout(sample)


def waits_on_shard_3(sample):
    """Shard 3 says it started (MAP_TEST_MARKER) and waits until the file MAP_TEST_GO exists."""
    if sample["__key__"].startswith("s03_"):
        pathlib.Path(os.environ["MAP_TEST_MARKER"]).touch()
        until(lambda: os.path.exists(os.environ["MAP_TEST_GO"]), "the go file")
    return shout(sample)


def holds_shard_1(sample):
    """Shard 1 says it started (the file MAP_HOLD_STARTED) and waits until the file MAP_HOLD_GO exists."""
    if sample["__key__"].startswith("s01_"):
        pathlib.Path(os.environ["MAP_HOLD_STARTED"]).touch()
        until(lambda: os.path.exists(os.environ["MAP_HOLD_GO"]), "the go file")
    return shout(sample)


def until(ready, what, limit=240.0):
    """Wait for an event (a file appearing); the limit only turns a hang into a failure."""
    deadline = time.monotonic() + limit
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} never came")
        time.sleep(0.02)


def setenv(name, value):
    os.environ[name] = value


def keep_every_other(samples):
    for n, sample in enumerate(samples):
        if n % 2 == 0:
            yield sample


def expected(urls, fn):
    out = []
    for url in urls:
        for sample in wds.WebDataset(url, shardshuffle=False):
            result = fn({k: v for k, v in sample.items() if k == "__key__" or not k.startswith("__")})
            if result is not None:
                out.append((result["__key__"], result["txt"]))
    return out


def written(pattern, n):
    out = []
    for i in range(n):
        for sample in wds.WebDataset(pattern % i, shardshuffle=False, empty_check=False):
            out.append((sample["__key__"], sample["txt"]))
    return out


@pytest.fixture(scope="module")
def cluster():
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0")
    client = distributed.Client(cluster)
    yield client
    client.close()
    cluster.close()


@pytest.fixture
def shards(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    return write_shards(tmp_path / "in", SIZES)


def test_output_equals_a_one_process_run(shards, tmp_path, cluster):
    dest = str(tmp_path / "out" / "part-%03d.tar")
    summary = map_shards(shout, shards, dest, client=cluster)
    assert written(dest, len(SIZES)) == expected(shards, shout)  # sample for sample, input i gives output i
    assert summary["done"] == len(SIZES) and summary["skipped"] == 0 and not summary["failures"]
    assert summary["samples_in"] == sum(SIZES)
    assert summary["samples_out"] == len(expected(shards, shout))
    head, *lines = map(json.loads, (tmp_path / "out" / "part-N.tar.wds-job.json").read_text().splitlines())
    assert head["tool"] == "map" and head["version"] == 2 and head["inputs"] == len(SIZES)
    assert sorted(line["done"] for line in lines if "done" in line) == list(range(len(SIZES)))


def test_per_shard_and_maxcount(shards, tmp_path, cluster):
    dest = str(tmp_path / "out" / "part-%03d.tar")
    summary = map_shards(keep_every_other, shards, dest, per="shard", maxcount=2, client=cluster)
    names = sorted(p.name for p in (tmp_path / "out").glob("part-*.tar"))
    assert "part-001.tar" in names and "part-001-001.tar" in names  # 5 of 9 samples kept: 3 outputs of 2
    assert summary["samples_out"] == sum((n + 1) // 2 for n in SIZES)
    # an earlier attempt at input 1 left a fourth part (a function whose output varies between runs): when
    # input 1 is written again, what is past its parts goes
    (tmp_path / "out" / "part-001-003.tar").write_bytes((tmp_path / "out" / "part-001-002.tar").read_bytes())
    (tmp_path / "out" / "part-001.tar").write_bytes(b"damaged")
    again = map_shards(keep_every_other, shards, dest, per="shard", maxcount=2, client=cluster)
    assert again["done"] == 1 and again["skipped"] == len(SIZES) - 1
    assert not (tmp_path / "out" / "part-001-003.tar").exists()
    parts = sorted(str(p) for p in (tmp_path / "out").glob("part-*.tar"))
    samples = [s["__key__"] for s in wds.WebDataset(parts, shardshuffle=False, empty_check=False)]
    assert len(samples) == len(set(samples)) == summary["samples_out"]


def test_a_rerun_after_an_interruption_skips_finished_shards(shards, tmp_path, cluster, monkeypatch):
    marker = tmp_path / "interrupt"
    marker.write_text("x")
    monkeypatch.setenv("MAP_TEST_MARKER", str(marker))
    cluster.run(setenv, "MAP_TEST_MARKER", str(marker))
    dest = str(tmp_path / "out" / "part-%03d.tar")
    first = map_shards(fails_when_marked, shards, dest, client=cluster, retries=0)
    assert first["done"] == len(SIZES) - 1 and len(first["failures"]) == 1
    assert "interrupted" in first["failures"][0]["error"] and first["failures"][0]["input"].endswith("p02.tar")
    assert not (tmp_path / "out" / "part-002.tar").exists()  # nothing partial under an output name
    marker.unlink()
    again = map_shards(fails_when_marked, shards, dest, client=cluster)
    assert again["skipped"] == len(SIZES) - 1 and again["done"] == 1
    assert written(dest, len(SIZES)) == expected(shards, shout)
    with pytest.raises(ConfigError, match="settings"):  # other settings: refused before anything is written
        map_shards(fails_when_marked, shards, dest, client=cluster, maxcount=3)


def test_a_client_killed_mid_job_leaves_a_job_its_rerun_completes(shards, tmp_path, cluster, caplog):
    """The process running map_shards dies (SIGKILL) after workers published outputs that its record may not
    list yet, while a task still runs: the rerun neither refuses those outputs as strangers nor duplicates a
    sample, and leaves nothing partial."""
    marker, go = tmp_path / "started", tmp_path / "go"
    for name, value in (("MAP_TEST_MARKER", str(marker)), ("MAP_TEST_GO", str(go))):
        cluster.run(setenv, name, value)
    dest = str(tmp_path / "out" / "part-%03d.tar")
    out = tmp_path / "out"
    code = (
        "import distributed\nfrom wds_cloud.dask import map_shards\nfrom tests.test_dask import waits_on_shard_3\n"
        f"map_shards(waits_on_shard_3, {shards!r}, {dest!r}, client=distributed.Client({cluster.scheduler.address!r}))"
    )
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    job = subprocess.Popen(
        [sys.executable, "-c", code], cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        until(
            lambda: marker.exists() and all((out / f"part-{i:03d}.tar").exists() for i in (0, 1, 2, 4)),
            "four outputs and shard 3 started",
        )
    finally:
        job.kill()
        job.wait()
    go.touch()  # the orphaned task goes on: its output is published with no client to record it
    until(lambda: (out / "part-003.tar").exists(), "the orphaned task's output")
    with caplog.at_level(logging.WARNING, logger="wds_cloud"):
        again = map_shards(waits_on_shard_3, shards, dest, client=cluster)
    # the killed job's claim is recognised as stale and taken over, with a line in the log
    assert any(f"pid {job.pid}" in r.getMessage() and "stale" in r.getMessage() for r in caplog.records)
    assert not again["failures"] and again["done"] + again["skipped"] == len(SIZES)
    assert written(dest, len(SIZES)) == expected(shards, shout)
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    assert map_shards(waits_on_shard_3, shards, dest, client=cluster)["skipped"] == len(SIZES)


def test_a_second_job_into_a_running_jobs_destination_is_refused(shards, tmp_path, cluster):
    """While a job runs (a task of it is running), another job into its destination, with another function
    or the same one, is refused naming the first; the first finishes untouched and reports exactly its
    outputs."""
    started, go = tmp_path / "hold-started", tmp_path / "hold-go"
    for name, value in (("MAP_HOLD_STARTED", str(started)), ("MAP_HOLD_GO", str(go))):
        cluster.run(setenv, name, value)
    dest = str(tmp_path / "out" / "part-%03d.tar")
    box = {}

    def first():
        box["summary"] = map_shards(holds_shard_1, shards, dest, client=cluster)

    thread = threading.Thread(target=first)
    thread.start()
    try:
        until(started.exists, "the first job's task")
        for fn in (shout, holds_shard_1):
            with pytest.raises(ConfigError, match="another job is writing here") as caught:
                map_shards(fn, shards, dest, client=cluster)
            assert f"pid {os.getpid()}" in str(caught.value) and "tests.test_dask:holds_shard_1" in str(caught.value)
    finally:
        go.touch()
        thread.join()
    assert box["summary"]["done"] == len(SIZES) and not box["summary"]["failures"]
    assert written(dest, len(SIZES)) == expected(shards, shout)
    assert not (tmp_path / "out" / "part-N.tar.wds-job.lock").exists()  # given back at the end


def test_a_job_started_while_another_starts_its_cluster_is_refused(shards, tmp_path, cluster):
    """The first job (another process) claims the destination before its own cluster starts: a second job
    with another function, started meanwhile, is refused naming it (they used to both run and both
    report success)."""
    started, go = tmp_path / "hold-started", tmp_path / "hold-go"
    dest = str(tmp_path / "out" / "part-%03d.tar")
    claim = tmp_path / "out" / "part-N.tar.wds-job.lock"
    code = (
        "from wds_cloud.dask import map_shards\nfrom tests.test_dask import holds_shard_1\n"
        f"s = map_shards(holds_shard_1, {shards!r}, {dest!r}, workers=1)\n"
        "assert s['done'] == 5 and not s['failures'], s\n"
    )
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), MAP_HOLD_STARTED=str(started), MAP_HOLD_GO=str(go))
    job = subprocess.Popen([sys.executable, "-c", code], cwd=root, env=env, stderr=subprocess.PIPE, text=True)
    try:
        until(claim.exists, "the first job's claim")
        with pytest.raises(ConfigError, match=f"pid {job.pid}") as caught:
            map_shards(shout, shards, dest, client=cluster)
        assert "tests.test_dask:holds_shard_1" in str(caught.value)
    finally:
        go.touch()
        _, err = job.communicate(timeout=300)
    assert job.returncode == 0, err[-3000:]
    assert written(dest, len(SIZES)) == expected(shards, shout) and not claim.exists()


def test_a_rerun_redoes_missing_outputs_even_after_a_failed_attempt(shards, tmp_path, cluster):
    """An output removed after the job finished is written again by the rerun; a rerun whose redo fails leaves
    a record the next rerun loads (that input no longer listed as done), which completes the job."""
    dest = str(tmp_path / "out" / "part-%03d.tar")
    marker = tmp_path / "interrupt-redo"
    cluster.run(setenv, "MAP_TEST_MARKER", str(marker))
    assert map_shards(fails_when_marked, shards, dest, client=cluster)["done"] == len(SIZES)
    (tmp_path / "out" / "part-002.tar").unlink()
    marker.write_text("x")
    failed = map_shards(fails_when_marked, shards, dest, client=cluster, retries=0)
    assert failed["skipped"] == len(SIZES) - 1 and len(failed["failures"]) == 1
    marker.unlink()
    again = map_shards(fails_when_marked, shards, dest, client=cluster)
    assert again["skipped"] == len(SIZES) - 1 and again["done"] == 1 and not again["failures"]
    assert written(dest, len(SIZES)) == expected(shards, shout)


@pytest.mark.parametrize(
    "argument, value",
    [
        ("maxcount", True),
        ("maxcount", 0),
        ("maxcount", 2.5),
        ("maxsize", float("nan")),
        ("maxsize", float("inf")),
        ("maxsize", -1),
        ("retries", -1),
        ("retries", 1.5),
        ("workers", 0),
    ],
)
def test_bad_counts_are_refused_naming_the_argument(shards, tmp_path, argument, value):
    """Before any claim, record or cluster."""
    with pytest.raises(ConfigError, match=argument):
        map_shards(shout, shards, str(tmp_path / "out" / "o-%03d.tar"), **{argument: value})
    assert not list((tmp_path / "out").iterdir())


def test_numpy_counts_are_accepted_and_recorded_as_numbers(shards, tmp_path, cluster):
    """numpy integers (as from a config computed with numpy) work and the record stays JSON."""
    import numpy as np

    dest = str(tmp_path / "out" / "o-%03d.tar")
    summary = map_shards(shout, shards[:1], dest, client=cluster, maxcount=np.int64(2), retries=np.int32(1))
    assert summary["done"] == 1 and not summary["failures"]
    head = json.loads((tmp_path / "out" / "o-N.tar.wds-job.json").read_text().splitlines()[0])
    assert head["settings"]["maxcount"] == 2 and type(head["settings"]["maxcount"]) is int


@pytest.mark.parametrize("pattern", ["o-%d-%d.tar", "o-%%d.tar", "o-%.0s.tar", "o-%s.tar", "o.tar"])
def test_a_destination_pattern_must_give_distinct_names(shards, tmp_path, pattern):
    with pytest.raises(ConfigError, match="destination"):
        map_shards(shout, shards, str(tmp_path / "out" / pattern))
    assert not list((tmp_path / "out").iterdir())


def test_a_sample_that_raises_goes_to_the_handler(shards, tmp_path, cluster):
    dest = str(tmp_path / "out" / "part-%03d.tar")
    summary = map_shards(bad_sample, shards, dest, client=cluster, handler=wds.ignore_and_continue)
    assert summary["failures"] == [
        {"key": "s01_0004", "error": "ValueError: cannot process this one", "input": shards[1]}
    ]
    assert "s01_0004" not in {k for k, _ in written(dest, len(SIZES))}
    strict = map_shards(bad_sample, shards, str(tmp_path / "out" / "strict-%03d.tar"), client=cluster, retries=0)
    assert len(strict["failures"]) == 1 and "cannot process this one" in strict["failures"][0]["error"]


def test_a_worker_killed_mid_shard_costs_only_that_shard(shards, tmp_path, monkeypatch):
    """The worker running shard 3 dies (its pid exits); the scheduler runs the shard again elsewhere: the
    output is complete and holds no sample twice."""
    marker = tmp_path / "died"
    monkeypatch.setenv("MAP_TEST_MARKER", str(marker))  # before the cluster starts: its workers inherit it
    dest = str(tmp_path / "out" / "part-%03d.tar")
    summary = map_shards(dies_once, shards, dest, workers=2)
    assert marker.exists()  # a worker did die
    assert not summary["failures"]
    assert written(dest, len(SIZES)) == expected(shards, shout)
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]  # no partial file left


def test_s3_with_credentials_only_in_the_workers_environment(moto_endpoint, tmp_path, monkeypatch):
    """Over moto: the credentials live in a profiles file the workers read; the scheduler's task state never
    holds them."""
    import boto3

    from .cloud import unique

    bucket = unique("dask")
    secret = "dask-secret-" + unique("s")
    client = boto3.client(
        "s3",
        endpoint_url=moto_endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=bucket)
    urls = []
    for path in write_shards(tmp_path, SIZES[:3]):
        name = path.rsplit("/", 1)[1]
        client.put_object(Bucket=bucket, Key=f"in/{name}", Body=pathlib.Path(path).read_bytes())
        urls.append(f"s3://{bucket}/in/{name}")
    profiles = tmp_path / "profiles.toml"
    profiles.write_text(
        f'["s3://{bucket}/"]\nendpoint_url = "{moto_endpoint}"\nkey = "testing"\n'
        f'secret = "testing"\nclient_kwargs = {{region_name = "us-east-1"}}\n'
        f'config_kwargs = {{user_agent_extra = "{secret}"}}\n'
    )
    monkeypatch.setenv("WDS_CLOUD_CONFIG", str(profiles))
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0")
    dask_client = distributed.Client(cluster)
    try:
        dest = f"s3://{bucket}/out/part-%03d.tar"
        summary = map_shards(shout, urls, dest, client=dask_client)
        held = dask_client.run_on_scheduler(
            lambda dask_scheduler: repr(
                [(key, task.run_spec, task.state) for key, task in dask_scheduler.tasks.items()]
            )
        )
    finally:
        dask_client.close()
        cluster.close()
    assert summary["done"] == 3 and not summary["failures"]
    assert secret not in held and "testing" not in held
    assert written(dest, 3) == expected(urls, shout)
    with pytest.raises(ConfigError, match="credential"):
        map_shards(shout, [f"https://user:{secret}@example.invalid/a.tar"], str(tmp_path / "x-%d.tar"))


def test_the_cli_runs_a_function_by_name(shards, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(__file__).resolve().parents[1]))
    dest = str(tmp_path / "out" / "cli-%03d.tar")
    out = subprocess.run(
        [sys.executable, "-m", "wds_cloud", "map", "tests.test_dask:shout", *shards, dest, "--workers", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    assert summary["done"] == len(SIZES)
    assert written(dest, len(SIZES)) == expected(shards, shout)
    bad = subprocess.run(
        [sys.executable, "-m", "wds_cloud", "map", "tests.test_dask:nothing", *shards, dest],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert bad.returncode != 0 and "has no 'nothing'" in bad.stderr


def test_without_the_extra_it_fails_at_once_with_the_install_line(shards, tmp_path):
    code = (
        "import sys; sys.modules['distributed'] = None\n"
        "from wds_cloud.cli import main\n"
        f"sys.exit(main(['map', 'json:dumps', {shards[0]!r}, {str(tmp_path / 'o-%d.tar')!r}]))"
    )
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0
    assert "pip install 'wds_cloud[dask]'" in out.stderr


def test_the_shard_tools_run_on_dask(shards, tmp_path):
    """reshard, index and verify take --workers (a local cluster) and --scheduler; they give what they give in
    one process (reshard: the same shards as one process, whatever the number of workers)."""
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(__file__).resolve().parents[1]))

    def cli(*args):
        out = subprocess.run(
            [sys.executable, "-m", "wds_cloud", *args, "--json"], capture_output=True, text=True, timeout=300, env=env
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout)

    dest = str(tmp_path / "out" / "re-%03d.tar")
    summary = cli("reshard", *shards, dest, "--maxcount", "4", "--workers", "2")
    assert summary["samples"] == sum(SIZES)
    names = sorted(p.name for p in (tmp_path / "out").glob("re-*.tar"))
    assert names == [f"re-{i:03d}.tar" for i in range(-(-sum(SIZES) // 4))]  # cut as one process cuts
    again = cli("reshard", *shards, dest, "--maxcount", "4", "--workers", "2")
    assert again["kept"] == len(names) and again["written"] == 0
    rows = cli("index", *shards, "--workers", "2")
    assert [r["nsamples"] for r in rows] == SIZES and all(pathlib.Path(r["index"]).exists() for r in rows)
    checked = cli("verify", *shards, "--workers", "2")
    assert checked["ok"] and len(checked["shards"]) == len(SIZES)


from .test_interleaved import mmc4  # noqa: E402,F401 (the MMC4 layout fixture)


def test_convert_on_dask_writes_what_one_process_writes(mmc4):  # noqa: F811
    """convert mmc4 --workers 2: the same shards, byte for byte, as the conversion in one process (so either
    run continues the other's job)."""
    from wds_cloud.interleaved import convert_mmc4

    root, jsonl, images = mmc4
    one = convert_mmc4([jsonl], images, str(root / "one-%03d.tar"), maxcount=3)
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(__file__).resolve().parents[1]))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "wds_cloud",
            "convert",
            "mmc4",
            jsonl,
            "--images",
            images,
            "--dest",
            str(root / "many-%03d.tar"),
            "--maxcount",
            "3",
            "--workers",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    many = json.loads(out.stdout)
    assert {k: many[k] for k in one} == one
    for i in range(one["shards"]):
        assert (root / f"many-{i:03d}.tar").read_bytes() == (root / f"one-{i:03d}.tar").read_bytes()


def test_the_console_script_imports_the_function_from_the_working_directory(shards, tmp_path):
    """`wds-cloud map mypkg.filters:keep_even ...` run from the folder holding mypkg/, as docs/dask.md shows it: the
    console script (unlike `python -m`) had only its own folder on sys.path, so `No module named 'mypkg'`; the
    workers of the local cluster import it too."""
    script = pathlib.Path(sys.executable).with_name("wds-cloud")
    if not script.exists():
        pytest.skip("the wds-cloud console script is not installed beside this interpreter")
    work = tmp_path / "work"
    (work / "mypkg").mkdir(parents=True)
    (work / "mypkg" / "__init__.py").write_text("")
    (work / "mypkg" / "filters.py").write_text(
        "def keep_even(sample):\n    return sample if int(sample['__key__'][-1]) % 2 == 0 else None\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    dest = str(tmp_path / "out" / "even-%03d.tar")
    out = subprocess.run(
        [str(script), "map", "mypkg.filters:keep_even", *shards, dest, "--workers", "1", "--json"],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["done"] == len(SIZES)


def test_a_scheduler_that_does_not_answer_is_one_line_naming_the_flag(shards, tmp_path, capsys):
    """`verify --scheduler tcp://127.0.0.1:PORT` with nothing listening: one line naming the address and the flag
    and what to do, exit 2; was distributed's raw "Timed out trying to connect ... after 30 s"."""
    import socket

    import dask

    from wds_cloud.cli import main

    with socket.socket() as probe:  # a port nothing listens on (bound, never listening)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        with dask.config.set({"distributed.comm.timeouts.connect": "1s"}):
            code = main(["verify", shards[0], "--scheduler", f"tcp://127.0.0.1:{port}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "nothing listens there" in err[0] and "--scheduler" in err[0] and "Traceback" not in err[0]


# adversary findings, issue 41


def test_a_rerun_removes_an_unlisted_file_at_a_finished_inputs_part_name(shards, tmp_path, cluster):
    """A regular file at ``o-000-001.tar`` (a later part name of finished input 0) that the record does not list is
    not kept: the rerun removes it and says so; the destination holds each sample once."""
    dest = str(tmp_path / "out" / "o-%03d.tar")
    map_shards(shout, shards, dest, client=cluster)
    planted = tmp_path / "out" / "o-000-001.tar"
    planted.write_bytes(pathlib.Path(dest % 1).read_bytes())
    again = map_shards(shout, shards, dest, client=cluster)
    assert again["skipped"] == len(SIZES) and again["removed"] == [str(planted)]
    assert not planted.exists()
    names = sorted(str(p) for p in (tmp_path / "out").glob("o-*.tar"))
    keys = [s["__key__"] for s in wds.WebDataset(names, shardshuffle=False)]
    assert len(keys) == len(set(keys)) and sorted(keys) == sorted(k for k, _ in expected(shards, shout))


def raises_config_error(path, sample):
    """Counts its calls in ``path``, then raises an error no retry mends."""
    with open(path, "a") as f:
        f.write("x")
    raise ConfigError("a setting no retry mends")


def test_an_error_no_retry_mends_is_not_retried(shards, tmp_path, cluster):
    """A task failing with our ConfigError (a missing profile, an unknown scheme, a refused URL, ...) fails its
    shard once: no retries, and the shard is not recorded as done."""
    import functools

    calls = tmp_path / "calls"
    dest = str(tmp_path / "out" / "c-%03d.tar")
    fn = functools.partial(raises_config_error, str(calls))
    summary = map_shards(fn, shards[:1], dest, client=cluster, retries=2)
    assert summary["done"] == 0 and len(summary["failures"]) == 1
    assert "a setting no retry mends" in summary["failures"][0]["error"]
    assert calls.read_text() == "x"
