"""Tool reruns and job records at the size of a job, pinned by counting: a rerun with nothing to do and a record's
load cost the same per output at 20 and 200 outputs (file system calls counted, never timed); saving as outputs
finish writes each line once; a record of one record a line reads however far it passes the cap of a file; a
record of version 1 still reads; every line of a forged record is checked, naming the file, the line and the
field."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import pathlib

import pytest

from wds_cloud.errors import ConfigError, MalformedDataError
from wds_cloud.jobs import record as jobrecord
from wds_cloud.jobs.record import JobRecord, output_names, output_number, record_url

SETTINGS = {"function": "tests.test_scale_tools:ident", "per": "sample", "maxcount": None, "maxsize": None}


def ident(sample):
    """A map function (a rerun with nothing to do never calls it)."""
    return sample


ident.__module__, ident.__qualname__ = "tests.test_scale_tools", "ident"


def digest(data):
    return hashlib.sha256(data).hexdigest()


def finished_job(root, n, tool="map"):
    """A finished job of ``n`` inputs as its own record says: tiny outputs and the record the API writes."""
    out = root / "out"
    out.mkdir()
    dest = str(out / "o-%04d.tar")
    inputs = [str(root / "in" / f"i-{i:04d}.tar") for i in range(n)]
    settings = SETTINGS if tool == "map" else {"maxcount": 2}
    with JobRecord(dest, tool, inputs, settings) as record:
        record.begin()
        for i in range(n):
            data = b"%08d" % i
            pathlib.Path(dest % i).write_bytes(data)
            if tool == "map":
                record.add_input(i, [(dest % i, len(data), digest(data))])
            else:
                record.add(dest % i, len(data), digest(data))
            record.save_soon()
        record.flush()
    return dest, inputs, settings


class Counts:
    """Calls of the file system functions a rerun could repeat per pair of outputs."""

    NAMES = ("lstat", "stat", "realpath", "scandir", "listdir", "glob")

    def __init__(self, monkeypatch):
        self.calls = dict.fromkeys(self.NAMES, 0)
        for owner, name in (
            (os, "lstat"),
            (os, "stat"),
            (os.path, "realpath"),
            (os, "scandir"),
            (os, "listdir"),
            (glob, "glob"),
        ):
            monkeypatch.setattr(owner, name, self._counted(name, getattr(owner, name)))

    def _counted(self, name, fn):
        def counted(*args, **kwargs):
            self.calls[name] += 1
            return fn(*args, **kwargs)

        return counted


def count_calls(tmp_path, monkeypatch, n, run, tool="map"):
    root = tmp_path / str(n)
    root.mkdir()
    dest, inputs, settings = finished_job(root, n, tool)
    with monkeypatch.context() as patch:
        counts = Counts(patch)
        run(dest, inputs, settings)
    return counts.calls


def assert_constant_per_output(small, large, n_small=20, n_large=200):
    """Per output, the large job costs no more calls than the small one (a fixed overhead aside); listings of
    the destination are a fixed number whatever the size."""
    for name in Counts.NAMES:
        assert large[name] <= small[name] * n_large / n_small + 8, (name, small, large)
    for name in ("scandir", "listdir", "glob"):
        assert large[name] == small[name] <= 3, (name, small, large)


def map_rerun(dest, inputs, settings):
    from wds_cloud.dask import map_shards

    summary = map_shards(ident, inputs, dest)
    assert summary["skipped"] == len(inputs) and summary["done"] == 0 and not summary["removed"]


def test_a_map_rerun_with_nothing_to_do_costs_the_same_per_output_at_20_and_200(tmp_path, monkeypatch):
    """lstat, stat, realpath and listing calls of a rerun per output stay constant (they grew with the outputs:
    every file was compared with every recorded output through realpath, the folder listed per input)."""
    small = count_calls(tmp_path, monkeypatch, 20, map_rerun)
    large = count_calls(tmp_path, monkeypatch, 200, map_rerun)
    assert_constant_per_output(small, large)
    assert large["realpath"] <= 8  # per folder, not per output or pair


def test_loading_a_record_and_keeping_its_outputs_costs_the_same_per_output(tmp_path, monkeypatch):
    """A reshard record: loading it and keeping every output, at 20 and 200 outputs."""

    def rerun(dest, inputs, settings):
        with JobRecord(dest, "reshard", inputs, settings) as record:
            assert all(record.keep(dest % i) for i in range(len(inputs)))

    def load(dest, inputs, settings):
        JobRecord(dest, "reshard", inputs, settings).release()

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    small = count_calls(tmp_path / "a", monkeypatch, 20, rerun, "reshard")
    assert_constant_per_output(small, count_calls(tmp_path / "a", monkeypatch, 200, rerun, "reshard"))
    small = count_calls(tmp_path / "b", monkeypatch, 20, load, "reshard")
    large = count_calls(tmp_path / "b", monkeypatch, 200, load, "reshard")
    assert_constant_per_output(small, large)
    # loading stats no output (one listing, each name looked up): one lstat per input (is it a link to the record?)
    assert large["lstat"] - small["lstat"] <= 180


def test_saving_as_outputs_finish_writes_the_record_whole_once(tmp_path, monkeypatch):
    """200 outputs finished one by one, each followed by save_soon: the record is written whole once (when the
    job begins), every line after that appended once; the bytes written are the record's own."""
    writes = {"whole": 0, "appended": 0}
    real_gopen, real_write = jobrecord.gopen, os.write

    def gopen(url, mode="rb", *args, **kwargs):
        if url.endswith(".wds-job.json") and "w" in mode:
            writes["whole"] += 1
        return real_gopen(url, mode, *args, **kwargs)

    def write(fd, data):
        writes["appended"] += len(data)
        return real_write(fd, data)

    monkeypatch.setattr(jobrecord, "gopen", gopen)
    monkeypatch.setattr(os, "write", write)
    dest, inputs, _ = finished_job(tmp_path, 200, "reshard")
    monkeypatch.undo()
    lines = pathlib.Path(record_url(dest)).read_bytes().splitlines(keepends=True)
    head = sum(map(len, lines[: 1 + len(inputs)]))  # the header and the inputs, written when the job began
    assert len(lines) == 1 + 2 * len(inputs)
    assert writes["whole"] == 1 and writes["appended"] == sum(map(len, lines)) - head


def test_a_record_past_the_cap_of_a_file_loads_line_by_line(tmp_path, monkeypatch):
    """With WDS_MAX_DATA_FILE_SIZE at 64 KiB, a record of 3,000 outputs (several times that) loads: the cap is a
    line's; a line longer than it is refused naming the line."""
    monkeypatch.setenv("WDS_MAX_DATA_FILE_SIZE", str(64 << 10))
    dest, inputs, settings = finished_job(tmp_path, 3000, "reshard")
    assert os.path.getsize(record_url(dest)) > 4 * (64 << 10)
    with JobRecord(dest, "reshard", inputs, settings) as record:
        assert record.count() == 3000 and record.keep(dest % 2999)
    with open(record_url(dest), "ab") as f:
        f.write(json.dumps({"output": "o-9999.tar", "size": 1, "sha256": "0" * 64, "x": "y" * (70 << 10)}).encode())
    with pytest.raises(MalformedDataError, match="line 6002 of the job record is longer"):
        JobRecord(dest, "reshard", inputs, settings)


def v1_record(dest, inputs, outputs, done=None, tool="map", settings=SETTINGS):
    """A record as version 1 wrote it: one JSON document on one line."""
    doc = {"format": "wds_cloud.job", "version": 1, "tool": tool, "inputs": inputs, "settings": settings}
    doc.update(destination=dest, outputs=outputs)
    if done is not None:
        doc["done"] = done
    pathlib.Path(record_url(dest)).write_text(json.dumps(doc, sort_keys=True, separators=(",", ":")))


@pytest.mark.parametrize("indent", [None, 2])
def test_a_version_1_record_still_reads_and_is_written_again_as_lines(tmp_path, indent):
    """A map record of version 1 (one document, on one line or several) loads; the rerun keeps its outputs; the
    first save writes it as lines, which load again."""
    (tmp_path / "out").mkdir()
    dest = str(tmp_path / "out" / "o-%03d.tar")
    inputs = [f"in-{i}.tar" for i in range(3)]
    entries = {}
    for i in range(2):
        pathlib.Path(dest % i).write_bytes(b"x" * (i + 1))
        entries[dest % i] = {"size": i + 1, "sha256": digest(b"x" * (i + 1))}
    v1_record(dest, inputs, entries, {"0": [dest % 0], "1": [dest % 1]})
    if indent:
        path = pathlib.Path(record_url(dest))
        path.write_text(json.dumps(json.loads(path.read_text()), indent=indent))
    with JobRecord(dest, "map", inputs, SETTINGS) as record:
        assert record.finished(1) == [dest % 1] and record.finished(2) is None
        assert record.keep(dest % 0) and record.keep(dest % 1)
        pathlib.Path(dest % 2).write_bytes(b"zzz")
        record.add_input(2, [(dest % 2, 3, digest(b"zzz"))])
        record.flush()
    assert json.loads(pathlib.Path(record_url(dest)).read_text().splitlines()[0])["version"] == 2
    with JobRecord(dest, "map", inputs, SETTINGS) as record:
        assert [record.finished(i) for i in range(3)] == [[dest % i] for i in range(3)]


def test_a_run_killed_mid_line_leaves_a_record_its_rerun_reads(tmp_path):
    """A last line without its end (a run killed while appending) is ignored, its output written again; the next
    save writes the record whole, never gluing a line to the cut one."""
    dest, inputs, settings = finished_job(tmp_path, 5, "reshard")
    with open(record_url(dest), "ab") as f:
        f.write(b'{"output":"o-0005.ta')
    with JobRecord(dest, "reshard", inputs, settings) as record:
        assert record.count() == 5
        pathlib.Path(dest % 5).write_bytes(b"five")
        record.add(dest % 5, 4, digest(b"five"))
        record.save_soon()
        record.flush()
    with JobRecord(dest, "reshard", inputs, settings) as record:
        assert record.count() == 6 and record.keep(dest % 5)


def test_an_output_written_again_is_listed_once(tmp_path):
    """An output found changed and written again replaces its line (the record is written whole, once) rather
    than listing it twice, which a load refuses."""
    dest, inputs, settings = finished_job(tmp_path, 3, "reshard")
    pathlib.Path(dest % 1).write_bytes(b"changed")
    with JobRecord(dest, "reshard", inputs, settings) as record:
        assert not record.keep(dest % 1)
        record.add(dest % 1, 7, digest(b"changed"))
        record.flush()
    with JobRecord(dest, "reshard", inputs, settings) as record:
        assert record.count() == 3 and record.keep(dest % 1)


# every line of a forged record is checked


def forged(tmp_path, change):
    """A finished map job of 3 inputs whose record's lines ``change`` rewrites (the list of parsed lines)."""
    dest, inputs, _ = finished_job(tmp_path, 3)
    path = pathlib.Path(record_url(dest))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    change(lines, dest)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return dest, inputs


def out_line(name, data=b"x"):
    return {"output": name, "size": len(data), "sha256": digest(data)}


def done_line(index, *names):
    return {"done": index, "outputs": [out_line(n) for n in names]}


NAMES = [
    "../out/o-0001.tar",
    "..%2fo-0001.tar",
    "%2e%2e/o-0001.tar",
    "sub/o-0001.tar",
    "o-0001.tar/..",
    "..\\o-0001.tar",
    "/etc/o-0001.tar",
    "o-001.tar",
    "o-00001.tar",
    "o-0001.tar\x00",
    "o-0001-000.tar",
    "o-0001.tar.",
    "o-N.tar.wds-job.json",
    "x" * 100_000,
    7,
    None,
]


@pytest.mark.parametrize("name", NAMES, ids=range(len(NAMES)))
def test_a_name_that_is_not_the_inputs_own_is_refused_naming_line_and_field(tmp_path, name):
    """A done line naming anything but its input's own file name, in any spelling of a climb or another folder."""

    def change(lines, dest):
        lines[-2] = {"done": 1, "outputs": [{"output": name, "size": 1, "sha256": "0" * 64}]}

    dest, inputs = forged(tmp_path, change)
    with pytest.raises(MalformedDataError) as caught:
        JobRecord(dest, "map", inputs, SETTINGS)
    message = str(caught.value)
    assert record_url(dest) in message and "line 6" in message and "'output'" in message and "remove" in message


def _real(lines, dest, index, output):
    """Input ``index``'s line forged to name input ``output``'s output, with that file's true size and checksum."""
    data = pathlib.Path(dest % output).read_bytes()
    item = {"output": f"o-{output:04d}.tar", "size": len(data), "sha256": digest(data)}
    lines[4 + index] = {"done": index, "outputs": [item]}


CHANGES = {
    "another input's output with its true checksum": (lambda lines, dest: _real(lines, dest, 1, 0), "'output'"),
    "an input listed twice": (lambda lines, dest: lines.append(dict(lines[-1])), "'done'"),
    "an output listed twice": (lambda lines, dest: lines.append(out_line("o-0002.tar")), "'output'"),
    "an input the job lacks": (lambda lines, dest: lines.append(done_line(3, "o-0003.tar")), "'done'"),
    "an input number as text": (lambda lines, dest: lines.__setitem__(-1, done_line("2", "o-0002.tar")), "'done'"),
    "an input number as a bool": (lambda lines, dest: lines.__setitem__(-1, done_line(True, "o-0001.tar")), "'done'"),
    "no outputs": (lambda lines, dest: lines.__setitem__(-1, {"done": 2, "outputs": []}), "'outputs'"),
    "a second part before the first": (
        lambda lines, dest: lines.__setitem__(-1, done_line(2, "o-0002-001.tar", "o-0002.tar")),
        "'output'",
    ),
    "a negative size": (lambda lines, dest: lines[-1]["outputs"][0].update(size=-1), "'size'"),
    "a size as a bool": (lambda lines, dest: lines[-1]["outputs"][0].update(size=True), "'size'"),
    "a size past a petabyte": (lambda lines, dest: lines[-1]["outputs"][0].update(size=10**30), "'size'"),
    "a checksum of capitals": (lambda lines, dest: lines[-1]["outputs"][0].update(sha256="A" * 64), "'sha256'"),
    "a field no line has": (lambda lines, dest: lines[-1].update(extra=1), "the line"),
    "an input line among the outputs": (lambda lines, dest: lines.append({"input": "x"}), "the line"),
    "a list for a line": (lambda lines, dest: lines.append([1]), "the line"),
    "a header field no header has": (lambda lines, dest: lines[0].update(extra=1), "the header"),
    "the inputs counted as text": (lambda lines, dest: lines[0].update(inputs="3"), "'inputs'"),
    "a missing input line": (lambda lines, dest: lines.pop(3), "'input'"),
}


@pytest.mark.parametrize("case", sorted(CHANGES))
def test_every_field_of_every_line_is_checked(tmp_path, case):
    """Each forged line: our MalformedDataError naming the record, the line and the field, never a skip."""
    change, field = CHANGES[case]
    dest, inputs = forged(tmp_path, change)
    with pytest.raises(MalformedDataError) as caught:
        JobRecord(dest, "map", inputs, SETTINGS)
    message = str(caught.value)
    assert record_url(dest) in message and " line " in message and field in message, message


def test_a_middle_line_that_is_not_json_is_refused(tmp_path):
    """Only a last line may be cut (a killed append): one in the middle is damage, refused by its number."""
    dest, inputs, _ = finished_job(tmp_path, 3)
    path = pathlib.Path(record_url(dest))
    lines = path.read_text().splitlines()
    lines[5] = lines[5][:10]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(MalformedDataError, match="line 6: the line is not JSON"):
        JobRecord(dest, "map", inputs, SETTINGS)


def test_a_header_claiming_other_inputs_is_another_job_before_any_is_read(tmp_path):
    """A header counting 10**12 inputs: another job's record (ConfigError with the conflict), nothing allocated
    for the claim; an input line that differs is named by its position."""
    for number, (change, said) in enumerate(
        (
            (lambda lines, dest: lines[0].update(inputs=10**12), "1000000000000 inputs"),
            (lambda lines, dest: lines[2].update(input="elsewhere.tar"), "input 1 elsewhere.tar"),
        )
    ):
        (tmp_path / str(number)).mkdir()
        dest, inputs = forged(tmp_path / str(number), change)
        with pytest.raises(ConfigError, match="another job") as caught:
            JobRecord(dest, "map", inputs, SETTINGS)
        assert not isinstance(caught.value, MalformedDataError) and said in str(caught.value)
        assert caught.value.conflict[0][0] == "inputs"


@pytest.mark.parametrize(
    "pattern", ["o-%03d.tar", "o-%d", "o-%06d.tar.gz", "out.%d", "a.b.%04d", "v2-%d-x.tar", "%d.tar", "o-%d0.tar"]
)
def test_output_numbers_read_back_exactly_the_names_output_names_gives(pattern):
    """Every name output_names gives reads back into its input and part; other spellings read back as None."""
    dest = "/data/set.v2/" + pattern
    for index in (0, 1, 7, 10, 999, 12345):
        for part, name in enumerate(output_names(dest, index, 3)):
            base = name.rsplit("/", 1)[1]
            assert output_number(dest, base) == (index, part), (base, index, part)
            for other in ("x" + base, base + "x", "0" + base, base.replace(".", "-000.", 1)):
                found = output_number(dest, other)
                assert found is None or output_names(dest, found[0], found[1] + 1)[-1].endswith("/" + other)
