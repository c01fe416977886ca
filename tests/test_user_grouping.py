"""Code that composes webdataset's public generators itself (as open_clip's trainer does) sees exactly what
webdataset yields: member dicts, and ``eof_value`` only where asked, also after a damaged shard."""

import gzip
import io
import tarfile

import pytest

import wds_cloud as wds
from wds_cloud.tariterators import base_plus_ext, tar_file_expander, url_opener, valid_sample


def grouping_as_documented(data, keys=base_plus_ext, lcase=True, suffixes=None):
    """A grouping written here after webdataset's documented behaviour: it reads every item as a member dict
    (``fname``, ``data``, ``__url__``), starts a sample when the key changes or a field repeats, and yields
    every valid sample, the last one of the stream too."""
    current = None
    for item in data:
        name, value = item["fname"], item["data"]
        prefix, suffix = keys(name)
        if prefix is None:
            continue
        if lcase:
            suffix = suffix.lower()
        if current is None or prefix != current["__key__"] or suffix in current:
            if valid_sample(current):
                yield current
            current = {"__key__": prefix, "__url__": item["__url__"]}
        if suffixes is None or suffix in suffixes:
            current[suffix] = value
    if valid_sample(current):
        yield current


def tar_bytes(prefix, n):
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for i in range(n):
            for ext in ("txt", "cls"):
                data = f"{prefix}{i}.{ext}".encode() * 40
                info = tarfile.TarInfo(f"{prefix}{i:03d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


@pytest.fixture
def shards(tmp_path):
    """Five shards, the middle three damaged: truncated, a corrupt header, a bad gzip stream."""
    good = [tar_bytes(p, 6) for p in "abcde"]
    (tmp_path / "0.tar").write_bytes(good[0])
    (tmp_path / "1.tar").write_bytes(good[1][: 512 * 9 + 100])  # cut inside a member
    corrupt = bytearray(good[2])
    corrupt[4 * 1024 + 148 : 4 * 1024 + 156] = b"99999999"  # a header checksum that does not match
    (tmp_path / "2.tar").write_bytes(bytes(corrupt))
    packed = gzip.compress(good[3])
    (tmp_path / "3.tar.gz").write_bytes(packed[: len(packed) // 2])  # a gzip stream cut short
    (tmp_path / "4.tar").write_bytes(good[4])
    return [str(tmp_path / n) for n in ("0.tar", "1.tar", "2.tar", "3.tar.gz", "4.tar")]


def pipeline(urls, calls, eof_value):
    def handler(exn):
        calls.append(type(exn).__name__)
        return True

    def samples(src):
        streams = url_opener(src, handler=handler)
        members = tar_file_expander(streams, handler=handler, eof_value=eof_value)
        return grouping_as_documented(members)

    return wds.DataPipeline(wds.SimpleShardList(urls), wds.split_by_worker, samples)


@pytest.mark.parametrize("eof_value", [None])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_trainers_own_grouping_survives_damaged_shards(shards, workers, eof_value):
    """No KeyError at the first damaged shard: every clean shard's samples arrive, through DataLoader workers."""
    calls: list = []
    loader = wds.WebLoader(pipeline(shards, calls, eof_value), batch_size=None, num_workers=workers)
    keys = [s["__key__"] for s in loader]
    assert {f"a{i:03d}" for i in range(6)} <= set(keys) and {f"e{i:03d}" for i in range(6)} <= set(keys)
    if workers == 0:
        assert len(calls) >= 3  # the handler saw each damaged shard


def test_the_expander_yields_member_dicts_and_markers_only_where_asked(shards):
    calls: list = []
    for eof_value, allowed in ((None, set()), ({}, {0})):
        items = list(
            tar_file_expander(
                url_opener(iter([{"url": u} for u in shards]), handler=lambda e: True),
                handler=lambda e: calls.append(e) or True,
                eof_value=eof_value,
            )
        )
        markers = [x for x in items if "fname" not in x]
        assert {len(x) for x in markers} <= allowed
        assert len(markers) == (0 if eof_value is None else 2)  # the two clean shards end with the marker
        assert all(set(x) == {"fname", "data", "__url__"} for x in items if "fname" in x)


# What webdataset 1.0.2 gives for exactly this code over exactly these shards (recorded by running it:
# bench/.venv has it; it is never a dependency of ours): the same keys.  The handler is called once per
# damaged shard here; webdataset's count depends on where the damage is (twice for a truncation, never for
# a corrupt header after the first member: it ends that shard silently), a documented difference.
WEBDATASET_KEYS = {
    None: [
        "a000",
        "a001",
        "a002",
        "a003",
        "a004",
        "a005",
        "b000",
        "b001",
        "c000",
        "c001",
        "d000",
        "d001",
        "e000",
        "e001",
        "e002",
        "e003",
        "e004",
        "e005",
    ],
    # the default eof_value is an end-of-shard dict without "fname": a grouping that reads every item's
    # fname fails with KeyError at the end of the first shard, in webdataset as here
    "default": ["a000", "a001", "a002", "a003", "a004", KeyError],
}
HANDLER_CALLS = {None: 3, "default": 0}  # one per damaged shard reached; a tarfile.ReadError each


@pytest.mark.parametrize("eof", [None, "default"])
def test_the_same_samples_as_webdataset_and_one_handler_call_per_damaged_shard(shards, eof):
    calls: list = []

    def handler(exn):
        calls.append(exn)
        return True

    kw = {} if eof == "default" else {"eof_value": None}
    members = tar_file_expander(url_opener(iter([{"url": u} for u in shards]), handler=handler), handler=handler, **kw)
    keys: list = []
    try:
        for sample in grouping_as_documented(members):
            keys.append(sample["__key__"])
    except KeyError:
        keys.append(KeyError)
    assert keys == WEBDATASET_KEYS[eof]
    assert len(calls) == HANDLER_CALLS[eof]
    assert all(isinstance(exn, tarfile.ReadError) for exn in calls)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_same_samples_as_webdataset_through_dataloader_workers(shards, workers):
    torch = pytest.importorskip("torch")
    calls: list = []
    loader = torch.utils.data.DataLoader(pipeline(shards, calls, None), batch_size=None, num_workers=workers)
    assert sorted(s["__key__"] for s in loader) == WEBDATASET_KEYS[None]
    loader = wds.WebLoader(pipeline(shards, calls, None), batch_size=None, num_workers=workers)
    assert sorted(s["__key__"] for s in loader) == WEBDATASET_KEYS[None]
    if workers == 0:
        assert len(calls) == 2 * HANDLER_CALLS[None]
