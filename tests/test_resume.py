"""Exact mid-epoch resume: save anywhere, rebuild, load, continue; the concatenation is the uninterrupted run."""

import gzip
import io
import json
import pathlib
import tarfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wds_cloud as wds
from wds_cloud.errors import StateMismatchError


def write_shards(directory, sizes, compress=False, payload=0):
    """Shards holding ``sizes[i]`` samples each (keys unique across shards); returns the URLs."""
    urls = []
    for s, n in enumerate(sizes):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for i in range(n):
                for ext, data in (("txt", f"{s}/{i}".encode()), ("bin", bytes([i % 251]) * (payload + i % 7))):
                    info = tarfile.TarInfo(f"s{s:02d}_{i:04d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        data = gzip.compress(buf.getvalue(), mtime=0) if compress else buf.getvalue()
        path = directory / (f"p{s:02d}.tar.gz" if compress else f"p{s:02d}.tar")
        path.write_bytes(data)
        urls.append(str(path))
    return urls


def keys_of(items):
    return [sample["__key__"] for sample in items]


def resume_in_pieces(build, cuts):
    """Read ``build()`` in pieces ending at ``cuts``: each piece on a new dataset loaded with the last state."""
    got, state = [], None
    for cut in cuts:
        ds = build()
        if state is not None:
            ds.load_state_dict(state)
        it = iter(ds)
        while len(got) < cut:
            try:
                got.append(next(it))
            except StopIteration:
                break
        state = json.loads(json.dumps(ds.state_dict()))  # the state survives a trip through JSON
    ds = build()
    if state is not None:
        ds.load_state_dict(state)
    got.extend(ds)
    return got, state


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    directory = tmp_path_factory.mktemp("uneven")
    return write_shards(directory, [13, 1, 20, 7, 16]), write_shards(directory, [13, 1, 20, 7, 16], compress=True)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    compressed=st.booleans(),
    bufsize=st.sampled_from([1, 5, 30, 200]),
    shardshuffle=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_interrupt_anywhere_local(uneven, data, compressed, bufsize, shardshuffle, seed):
    """Any number of interruptions at any points: the pieces concatenate to the uninterrupted run."""
    urls = uneven[1] if compressed else uneven[0]

    def build():
        return wds.WebDataset(urls, shardshuffle=shardshuffle, seed=seed).shuffle(
            bufsize, initial=bufsize // 2 + 1, seed=seed + 1
        )

    samples = list(build())
    full = keys_of(samples)
    assert sorted(full) == sorted(set(full)) and len(full) == 57
    cuts = sorted(data.draw(st.lists(st.integers(0, len(full)), max_size=4)))
    got, _ = resume_in_pieces(build, cuts)
    assert got == samples  # whole samples, every field (__local_path__ included), not only their keys


@pytest.mark.parametrize("where", ["start", "mid_shard", "buffer_full", "shard_boundary", "last_shard", "end"])
def test_named_interruption_points(tmp_path, where):
    """The points the issue names, without shuffling shards so that boundaries are known."""
    urls = write_shards(tmp_path, [10, 10, 10])
    cut = {"start": 0, "mid_shard": 14, "buffer_full": 6, "shard_boundary": 10, "last_shard": 25, "end": 30}[where]

    def build():
        return wds.WebDataset(urls, shardshuffle=False).shuffle(4, initial=4, seed=3)

    full = keys_of(build())
    got, state = resume_in_pieces(build, [cut])
    assert keys_of(got) == full


def test_no_shuffle_offsets_and_consumed_shards_are_not_reopened(tmp_path, monkeypatch):
    """Without a sample shuffle the state is the shard cursor and the next header's offset; finished
    shards are never opened again."""
    urls = write_shards(tmp_path, [10, 10, 10])
    expected = keys_of(wds.WebDataset(urls, shardshuffle=False))
    ds = wds.WebDataset(urls, shardshuffle=False)
    it = iter(ds)
    first = [next(it) for _ in range(15)]
    state = ds.state_dict()
    reader = [s for _, kind, s in state["stages"] if kind == "TarSamples"][0]
    assert reader["shard"] == 1 and reader["url"] == urls[1] and reader["offset"] % 512 == 0
    opened = []
    from wds_cloud import cache

    original = cache.StreamingOpen.open

    def spy(self, url, offset=0):
        opened.append((url, offset))
        return original(self, url, offset)

    monkeypatch.setattr(cache.StreamingOpen, "open", spy)
    ds2 = wds.WebDataset(urls, shardshuffle=False)
    ds2.load_state_dict(state)
    rest = list(ds2)
    assert keys_of(first + rest) == expected
    assert opened == [(urls[1], reader["offset"]), (urls[2], 0)]


def test_state_is_small_json(tmp_path):
    urls = write_shards(tmp_path, [400, 400])
    ds = wds.WebDataset(urls, shardshuffle=True).shuffle(300).decode().to_tuple("__key__", "txt").batched(8)
    it = iter(ds)
    for _ in range(40):
        next(it)
    state = ds.state_dict()
    text = json.dumps(state)
    shuffle = [s for _, kind, s in state["stages"] if kind == "Shuffle"][0]
    buffered = len(shuffle["buffer"])
    assert buffered > 100
    positions = len(json.dumps(shuffle["buffer"]))
    assert len(text) - positions < 1024, text[:2000]
    assert positions / buffered < 16  # a few bytes per buffered sample: [shard, first block, blocks]


def test_later_stages_and_epochs(tmp_path):
    """decode/to_tuple/batched after the shuffle; the state names the epoch, the next pass is the next epoch."""
    urls = write_shards(tmp_path, [9, 9, 9])

    def build():
        return (
            wds.WebDataset(urls, shardshuffle=True, seed=11)
            .shuffle(6, seed=1)
            .decode()
            .to_tuple("__key__", "txt")
            .batched(4, collation_fn=list)
        )

    reference = build()
    epoch0 = list(reference)
    epoch1 = list(reference)
    assert epoch0 != epoch1
    ds = build()
    it = iter(ds)
    head = [next(it) for _ in range(3)]
    state = ds.state_dict()
    again = build()
    again.load_state_dict(state)
    assert head + list(again) == epoch0
    assert list(again) == epoch1  # the following pass is epoch 1, as it would have been


def test_resampled_with_epoch(tmp_path):
    urls = write_shards(tmp_path, [10, 10, 10])

    def build():
        return wds.WebDataset(urls, resampled=True, seed=4).shuffle(7, seed=2).with_epoch(45)

    full = keys_of(build())
    assert len(full) == 45
    for cut in (0, 12, 44, 45):
        got, _ = resume_in_pieces(build, [cut])
        assert keys_of(got) == full


@pytest.mark.parametrize("equal_work", [25, 40])
def test_equal_work_resume(tmp_path, equal_work):
    urls = write_shards(tmp_path, [10, 10, 10])

    def build():
        return wds.WebDataset(urls, shardshuffle=True, seed=4, equal_work=equal_work).shuffle(5, seed=2)

    full = keys_of(build())
    assert len(full) == equal_work
    for cut in (3, 24, 31):
        got, _ = resume_in_pieces(build, [cut])
        assert keys_of(got) == full


def test_mismatches_say_what_differs(tmp_path):
    urls = write_shards(tmp_path, [10, 10, 10])
    ds = wds.WebDataset(urls, shardshuffle=True, seed=1).shuffle(5, seed=2)
    it = iter(ds)
    for _ in range(7):
        next(it)
    state = ds.state_dict()
    cases = [
        (lambda: wds.WebDataset(urls, shardshuffle=True, seed=9).shuffle(5), "seed: saved 1, here 9"),
        (lambda: wds.WebDataset(urls[:2], shardshuffle=True, seed=1).shuffle(5), "shards: saved 3, here 2"),
        (lambda: wds.WebDataset(urls, shardshuffle=True, seed=1).shuffle(8), "bufsize: saved 5, here 8"),
        (lambda: wds.WebDataset(urls, shardshuffle=True, seed=1), "saved 'Shuffle', here None"),
    ]
    for build, expected in cases:
        with pytest.raises(StateMismatchError, match=expected.replace("(", r"\(")):
            build().load_state_dict(state)
    with pytest.raises(StateMismatchError, match="not a wds_cloud pipeline state"):
        wds.WebDataset(urls).load_state_dict({"hello": 1})
    # the shard list matches, but another rank's state is refused when iteration starts
    state["stages"][1][2]["identity"]["rank"] = 1
    state["stages"][1][2]["identity"]["world_size"] = 2
    other = wds.WebDataset(urls, shardshuffle=True, seed=1).shuffle(5, seed=2)
    other.load_state_dict(state)
    with pytest.raises(StateMismatchError, match="rank: saved 1, here 0"):
        list(other)


def test_changed_shard_is_detected(tmp_path):
    urls = write_shards(tmp_path, [10, 10])
    ds = wds.WebDataset(urls, shardshuffle=False).shuffle(5, seed=2)
    it = iter(ds)
    for _ in range(8):
        next(it)
    state = ds.state_dict()
    write_shards(tmp_path, [10, 10], payload=100)  # same names, samples at other offsets
    again = wds.WebDataset(urls, shardshuffle=False).shuffle(5, seed=2)
    again.load_state_dict(state)
    with pytest.raises((StateMismatchError, wds.CorruptShardError), match="changed|corrupt"):
        list(again)


def test_second_shuffle_cannot_be_saved_mid_buffer(tmp_path):
    urls = write_shards(tmp_path, [10, 10])
    ds = wds.WebDataset(urls).shuffle(5).shuffle(5)
    it = iter(ds)
    next(it)
    with pytest.raises(StateMismatchError, match="not fed by a shard reader"):
        ds.state_dict(strict=True)
    assert "not fed by a shard reader" in ds.state_dict()["inexact"]


@pytest.fixture(scope="module")
def s3_shards(moto_endpoint, tmp_path_factory):
    """Four shards of uneven sizes in a bucket on the moto server: (urls, storage_options)."""
    import boto3

    from .cloud import unique

    options = {"key": "testing", "secret": "testing", "endpoint_url": moto_endpoint}
    client = boto3.client(
        "s3",
        endpoint_url=moto_endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    bucket = unique("resume")
    client.create_bucket(Bucket=bucket)
    urls = []
    for path in write_shards(tmp_path_factory.mktemp("s3"), [12, 5, 9, 14], payload=200):
        name = path.rsplit("/", 1)[1]
        client.put_object(Bucket=bucket, Key=f"d/{name}", Body=pathlib.Path(path).read_bytes())
        urls.append(f"s3://{bucket}/d/{name}")
    return urls, options


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), bufsize=st.sampled_from([1, 9, 50]), seed=st.integers(0, 2**31 - 1))
def test_interrupt_anywhere_s3(s3_shards, data, bufsize, seed):
    """Remote shards: buffered samples come back with ranged reads, consumed shards stay unread."""
    urls, options = s3_shards

    def build():
        return wds.WebDataset(urls, shardshuffle=True, seed=seed, storage_options=options).shuffle(bufsize, seed=seed)

    samples = list(build())
    assert len(samples) == 40
    cuts = sorted(data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=3)))
    got, _ = resume_in_pieces(build, cuts)
    assert got == samples


def test_resume_rereads_only_the_buffered_samples(http_store, tmp_path):
    """Over HTTP: after resume the bytes read again are those of the buffered samples (one bounded
    request per run of adjacent samples); the consumed part of the shard is not read again."""
    from .cloud import HTTP_TOKEN, unique

    server, store = http_store
    prefix = "/" + unique("resume")
    urls = []
    for path in write_shards(tmp_path, [60, 60], payload=3000):
        key = f"{prefix}/{path.rsplit('/', 1)[1]}"
        store.put(key, pathlib.Path(path).read_bytes())
        urls.append(server.url + key)
    options = {"headers": {"Authorization": f"Bearer {HTTP_TOKEN}"}}

    def build():
        return wds.WebDataset(urls, shardshuffle=False, storage_options=options).shuffle(10, initial=10, seed=3)

    full = keys_of(build())
    ds = build()
    it = iter(ds)
    head = [next(it) for _ in range(70)]
    state = ds.state_dict()
    shuffle = [s for _, kind, s in state["stages"] if kind == "Shuffle"][0]
    reader_state = [s for _, kind, s in state["stages"] if kind == "TarSamples"][0]
    buffered = 512 * sum(blocks for _, _, blocks in shuffle["buffer"])
    assert reader_state["url"] == urls[1]
    again = build()
    again.load_state_dict(state)
    before = len(store.requests)
    rest = list(again)
    assert keys_of(head + rest) == full
    assert again._reader.last_refetch["bytes"] == buffered
    assert again._reader.last_refetch["samples"] == len(shuffle["buffer"])
    ranges = [r for _, key, r in store.requests[before:]]
    assert all(r is not None for r in ranges)  # nothing read from the start again
    size = len(store.objects[prefix + "/p01.tar"])
    # every byte read: the buffered samples, then shard 1 from the saved offset to its end
    assert again.stats.bytes == buffered + size - reader_state["offset"]


def test_stateful_dataloader_two_workers(tmp_path):
    pytest.importorskip("torch")
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    urls = write_shards(tmp_path, [11, 9, 14, 6, 10])

    def build():
        return (
            wds.WebDataset(urls, shardshuffle=True, seed=3)
            .shuffle(8, seed=7)
            .to_tuple("__key__")
            .batched(3, collation_fn=lambda s: [k for (k,) in s])
        )

    def loader(ds):
        return sdl.StatefulDataLoader(ds, batch_size=None, num_workers=2)

    full = list(loader(build()))
    assert sorted(k for b in full for k in b) == sorted(keys_of(wds.WebDataset(urls)))
    for cut in (1, 9, len(full) - 1):
        first = loader(build())
        it = iter(first)
        head = [next(it) for _ in range(cut)]
        state = first.state_dict()
        del it
        second = loader(build())
        second.load_state_dict(state)
        assert head + list(second) == full


@pytest.mark.parametrize("num_workers", [0, 2])
def test_webloader_resume(tmp_path, num_workers):
    pytest.importorskip("torch")
    urls = write_shards(tmp_path, [11, 9, 14, 6, 10])

    def loader():
        ds = (
            wds.WebDataset(urls, shardshuffle=True, seed=3)
            .shuffle(8, seed=7)
            .to_tuple("__key__")
            .batched(3, collation_fn=lambda s: [k for (k,) in s])
        )
        return wds.WebLoader(ds, batch_size=None, num_workers=num_workers)

    full = list(loader())
    for cut in (0, 2, 5, len(full) - 2, len(full)):
        got, _ = resume_in_pieces(loader, [cut])
        assert got == full


def test_webloader_new_order_each_epoch(tmp_path):
    """Without set_epoch, each pass of a WebLoader (workers started afresh) is a new epoch."""
    pytest.importorskip("torch")
    urls = write_shards(tmp_path, [5] * 8)
    ds = wds.WebDataset(urls, shardshuffle=True, seed=3).to_tuple("__key__")
    loader = wds.WebLoader(ds, batch_size=None, num_workers=2)
    first, second = [k for (k,) in loader], [k for (k,) in loader]
    assert sorted(first) == sorted(second) and first != second


def test_data_pipeline_resume(tmp_path):
    """The composable form, as webdataset users write it."""
    urls = write_shards(tmp_path, [8, 13, 6])

    def build():
        return wds.DataPipeline(
            wds.SimpleShardList(urls, seed=2),
            wds.split_by_worker,
            wds.tarfile_to_samples(),
            wds.shuffle(6, seed=4),
            wds.to_tuple("__key__", "txt"),
        )

    full = [k for k, _ in build()]
    assert len(full) == 27
    for cut in (1, 6, 13, 26):
        ds = build()
        it = iter(ds)
        head = [next(it)[0] for _ in range(cut)]
        again = build()
        again.load_state_dict(json.loads(json.dumps(ds.state_dict())))
        assert head + [k for k, _ in again] == full


def test_state_urls_are_data(tmp_path):
    """A state naming a shard outside the dataset (a pipe: command, say) is refused, never run."""
    urls = write_shards(tmp_path, [10, 10])
    ds = wds.WebDataset(urls, shardshuffle=False).shuffle(5, seed=2)
    it = iter(ds)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(ds.state_dict()))
    shuffle = [s for _, kind, s in state["stages"] if kind == "Shuffle"][0]
    marker = tmp_path / "ran"
    shuffle["urls"][0][1] = f"pipe:touch {marker}; cat {urls[0]}"
    again = wds.WebDataset(urls, shardshuffle=False).shuffle(5, seed=2)
    with pytest.raises(StateMismatchError, match="shard list does not"):
        again.load_state_dict(state)
    assert not marker.exists()


def test_webloader_resume_with_loader_batching(tmp_path):
    """batch_size=N in the loader: torch collates in the workers; the state rides along with each batch."""
    pytest.importorskip("torch")
    urls = write_shards(tmp_path, [11, 9, 14, 6, 10])

    def loader():
        ds = wds.WebDataset(urls, shardshuffle=True, seed=3).shuffle(8, seed=7).to_tuple("__key__", "txt")
        return wds.WebLoader(ds, batch_size=4, num_workers=2)

    full = [list(b[0]) for b in loader()]
    assert sorted(k for b in full for k in b) == sorted(keys_of(wds.WebDataset(urls)))
    for cut in (3, len(full) - 1):
        first = loader()
        it = iter(first)
        head = [list(next(it)[0]) for _ in range(cut)]
        state = json.loads(json.dumps(first.state_dict()))
        del it
        second = loader()
        second.load_state_dict(state)
        assert head + [list(b[0]) for b in second] == full


def test_resume_through_the_shard_cache(s3_shards, tmp_path):
    """With a cache the current shard is read from the cached copy (or filled whole), and resume stays exact."""
    urls, options = s3_shards

    def build():
        return wds.WebDataset(
            urls, shardshuffle=True, seed=6, storage_options=options, cache_dir=str(tmp_path / "cache")
        ).shuffle(7, seed=1)

    samples = list(build())  # fills the cache
    full = keys_of(samples)
    for cuts in ([5], [18, 33]):
        got, _ = resume_in_pieces(build, cuts)
        assert got == samples  # every field: __local_path__ names the cache entry, as in the first read
    cold = tmp_path / "cold"

    def build_cold():
        return wds.WebDataset(urls, shardshuffle=True, seed=6, storage_options=options, cache_dir=str(cold)).shuffle(
            7, seed=1
        )

    got, _ = resume_in_pieces(build_cold, [21])
    assert keys_of(got) == full


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 3 workers on a 2-core machine
@pytest.mark.parametrize("sizes,equal_work", [([5, 5, 8], 7), ([2, 10, 14], 20)])
def test_webloader_resume_with_equal_work(tmp_path, sizes, equal_work):
    """Found by fuzzing: a worker that reached its equal_work count, or that goes over its shard again
    and again, continues exactly; a state taken right after loading (before any item) is the loaded one."""
    pytest.importorskip("torch")
    urls = write_shards(tmp_path, sizes)

    def loader():
        ds = (
            wds.WebDataset(urls, shardshuffle=True, seed=9, equal_work=equal_work)
            .shuffle(3, seed=9)
            .to_tuple("__key__")
            .batched(5, collation_fn=lambda s: [k for (k,) in s])
        )
        return wds.WebLoader(ds, batch_size=None, num_workers=3)

    full = list(loader())
    assert sum(len(b) for b in full) == 3 * equal_work
    for cut in (2, 4, len(full) - 1):
        got, state = resume_in_pieces(loader, [cut])
        assert got == full
        second = loader()
        second.load_state_dict(state)
        iter(second)
        assert second.state_dict() == state  # loaded, not yet read: still the loaded state


@pytest.mark.parametrize("num_workers", [None, 0, 2])
def test_state_between_epochs_is_the_start_of_the_next(tmp_path, num_workers):
    """A state taken after iter() but before the first item of the next epoch starts that epoch."""
    if num_workers is not None:
        pytest.importorskip("torch")
    urls = write_shards(tmp_path, [6, 7, 5, 8])

    def build():
        ds = wds.WebDataset(urls, shardshuffle=True, seed=2).shuffle(4, seed=3).to_tuple("__key__")
        return ds if num_workers is None else wds.WebLoader(ds, batch_size=None, num_workers=num_workers)

    reference = build()
    epochs = [list(reference), list(reference)]
    assert epochs[0] != epochs[1]
    ds = build()
    assert list(ds) == epochs[0]
    it = iter(ds)  # epoch 1 made, not begun
    state = json.loads(json.dumps(ds.state_dict()))
    del it
    again = build()
    again.load_state_dict(state)
    assert list(again) == epochs[1]
