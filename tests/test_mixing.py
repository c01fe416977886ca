"""Dataset specs and weighted mixing: schema, shares, determinism, running out, exact resume, stores, stats."""

import collections
import itertools
import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import wds_cloud as wds
from wds_cloud.compat import MixedDataset
from wds_cloud.errors import ConfigError, SecurityError, StateMismatchError
from wds_cloud.gopen import gopen
from wds_cloud.resume.state import seal

from .start_methods import FORK_AND_PICKLE

SIZES = {"a": (4, 300), "b": (3, 200), "c": (2, 100)}  # source: (shards, samples per shard)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    for name, (count, per) in SIZES.items():
        for s in range(count):
            with wds.TarWriter(str(root / f"{name}-{s}.tar")) as w:
                for i in range(per):
                    w.write({"__key__": f"{name}{s}-{i:04d}", "txt": f"{name} {s} {i}".encode()})
    return root


def spec_for(root, **top):
    sources = [
        {"name": "a", "urls": f"{root}/a-{{0..3}}.tar", "weight": 5},
        {"name": "b", "urls": [f"{root}/b-{i}.tar" for i in range(3)], "weight": 3, "resampled": True},
        {"name": "c", "urls": f"{root}/c-{{0..1}}.tar", "weight": 2, "shuffle": 50},
    ]
    return dict({"version": 1, "seed": 7, "sources": sources}, **top)


def keys(ds):
    return [s["__key__"] for s in ds]


# the schema
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s: s.update(version=2), "'version' is 2"),
        (lambda s: s.update(sources=[]), "'sources' must be a non-empty list"),
        (lambda s: s.update(extra=1), "unknown top-level field"),
        (lambda s: s.update(samples_per_epoch=0), "'samples_per_epoch' must be a positive integer"),
        (lambda s: s["sources"][0].update(weight=-1), "source 'a': 'weight' must be a positive number"),
        (lambda s: s["sources"][1].update(wieght=1), "source 'b': unknown field(s) 'wieght'"),
        (lambda s: s["sources"][2].update(urls=[]), "source 'c': 'urls' must be"),
        (lambda s: s["sources"][2].update(resampled="yes"), "source 'c': 'resampled' must be true or false"),
        (lambda s: s["sources"][2].update(name="a"), "source name(s) 'a' appear more than once"),
        (lambda s: s["sources"][0].pop("name"), "sources[0]: 'name' is missing"),
        (lambda s: s["sources"][0].update(storage_options=[1]), "source 'a': 'storage_options' must be a mapping"),
    ],
)
def test_schema_errors_name_the_source_and_the_field(shards, change, message):
    spec = spec_for(shards)
    change(spec)
    with pytest.raises(ConfigError) as info:
        wds.from_spec(spec)
    assert message in str(info.value) and "docs/specs.md" in str(info.value)


def test_a_yaml_or_json_file_opens_as_a_webdataset(shards, tmp_path):
    yaml = pytest.importorskip("yaml")
    spec = spec_for(shards, samples_per_epoch=600)
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(spec))
    (tmp_path / "train.json").write_text(json.dumps(spec))
    from_yaml = wds.WebDataset(str(tmp_path / "train.yaml"))
    assert isinstance(from_yaml, MixedDataset) and isinstance(from_yaml, wds.WebDataset)
    expected = keys(wds.from_spec(spec))
    assert len(expected) == 600
    assert keys(from_yaml) == expected == keys(wds.WebDataset(str(tmp_path / "train.json")))
    # stages chain as on any WebDataset
    assert next(iter(wds.WebDataset(str(tmp_path / "train.yaml")).decode().to_tuple("txt")))[0].count(" ") == 2


def test_relative_urls_in_a_spec_file_are_resolved_against_it(shards):
    (shards / "rel.json").write_text(json.dumps({"version": 1, "sources": [{"name": "c", "urls": "c-{0..1}.tar"}]}))
    assert len(keys(wds.WebDataset(str(shards / "rel.json")))) == 200


def test_pipe_urls_in_a_spec_file_are_untrusted(tmp_path, monkeypatch):
    monkeypatch.delenv("WDS_ALLOW_UNTRUSTED_PIPES", raising=False)
    spec = {"version": 1, "sources": [{"name": "p", "urls": ["pipe:echo pwned > /dev/null"]}]}
    (tmp_path / "evil.json").write_text(json.dumps(spec))
    with pytest.raises(SecurityError):
        list(wds.WebDataset(str(tmp_path / "evil.json")))


def test_webdatasets_yaml_form_still_works(shards, tmp_path):
    pytest.importorskip("yaml")
    (tmp_path / "old.yaml").write_text(
        f"prefix: {shards}\ndatasets:\n  - name: c\n    shards: c-{{0..1}}.tar\n    perepoch: 2\n"
    )
    assert len(keys(wds.WebDataset(str(tmp_path / "old.yaml"), shardshuffle=False))) == 200


# shares and determinism
def test_weights_give_the_shares_within_one_percent_over_100k_samples(shards):
    spec = spec_for(shards, samples_per_epoch=100_000)
    for source in spec["sources"]:
        source["resampled"] = True
    ds = wds.from_spec(spec)
    counts = collections.Counter(s["__source__"] for s in ds)
    assert sum(counts.values()) == 100_000
    for name, weight in (("a", 0.5), ("b", 0.3), ("c", 0.2)):
        assert abs(counts[name] / 100_000 - weight) < 0.01, counts
    stats = ds.stats["sources"]
    assert stats["a"]["samples"] == counts["a"] and stats["a"]["target"] == pytest.approx(0.5)
    assert stats["a"]["bytes"] > 0 and abs(stats["c"]["share"] - 0.2) < 0.01


def test_the_mix_is_a_function_of_seed_epoch_rank_and_worker(shards, monkeypatch):
    spec = spec_for(shards, samples_per_epoch=400)
    ds = wds.from_spec(spec)
    epoch0, epoch1 = keys(ds), keys(ds)
    assert epoch0 == keys(wds.from_spec(spec)) and epoch0 != epoch1
    assert keys(wds.from_spec(spec_for(shards, samples_per_epoch=400, seed=8))) != epoch0
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    rank0 = keys(wds.from_spec(spec))
    monkeypatch.setenv("RANK", "1")
    rank1 = keys(wds.from_spec(spec))
    assert len(rank0) == len(rank1) == 200
    # each source split over the ranks like a single dataset: no sample of a finite source on both ranks
    finite = {k for k in rank0 if k.startswith(("a", "c"))} & {k for k in rank1 if k.startswith(("a", "c"))}
    assert not finite


def test_without_samples_per_epoch_the_epoch_ends_with_the_first_finite_source(shards):
    got = collections.Counter(s["__source__"] for s in wds.from_spec(spec_for(shards)))
    assert got["c"] == 200 or got["a"] == 1200  # one finite source ran out, and the epoch ended there
    assert got["b"] > 0


def test_with_samples_per_epoch_a_finite_source_that_runs_out_leaves_the_mix(shards):
    spec = spec_for(shards, samples_per_epoch=3000)
    got = collections.Counter(s["__source__"] for s in wds.from_spec(spec))
    assert got["c"] == 200 and got["a"] == 1200 and got["b"] == 1600  # both finite ones used up, b fills


# exact resume
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 1399), epochs_before=st.integers(0, 1), through_json=st.booleans())
@example(cut=0, epochs_before=1, through_json=False)  # after iter(), before the first sample of a later epoch
@example(cut=1399, epochs_before=0, through_json=True)  # before the last sample
def test_resume_through_the_mix_yields_exactly_the_rest(shards, cut, epochs_before, through_json):
    spec = spec_for(shards, samples_per_epoch=1400)
    reference = wds.from_spec(spec)
    for _ in range(epochs_before):
        keys(reference)
    expected = keys(reference)
    ds = wds.from_spec(spec)
    for _ in range(epochs_before):
        keys(ds)
    it = iter(ds)
    head = [next(it)["__key__"] for _ in range(cut)]
    state = ds.state_dict(strict=True)
    if through_json:
        state = json.loads(json.dumps(state))
    resumed = wds.from_spec(spec)
    resumed.load_state_dict(state)
    assert head + keys(resumed) == expected


def test_a_state_of_another_mix_is_refused(shards):
    ds = wds.from_spec(spec_for(shards, samples_per_epoch=100))
    it = iter(ds)
    next(it)
    state = ds.state_dict(strict=True)
    other = spec_for(shards, samples_per_epoch=100)
    other["sources"][0]["name"] = "renamed"
    with pytest.raises(StateMismatchError, match="resume with the spec"):
        wds.from_spec(other).load_state_dict(state)


def _stopped_and_resumed(loader, batches):
    """The keys of one uninterrupted pass of ``loader()``, and of a pass stopped after ``batches`` batches
    (a strict state taken) and finished by a new loader from that state."""
    expected = [k for batch in loader() for k in batch[0]]
    first = loader()
    it = iter(first)
    head = [k for _ in range(batches) for k in next(it)[0]]
    state = first.state_dict(strict=True)
    del it
    again = loader()
    again.load_state_dict(state)
    return expected, head + [k for batch in again for k in batch[0]]


@pytest.mark.parametrize("start_method", FORK_AND_PICKLE, indirect=True)  # spawn: tests/test_start_methods.py
def test_resume_through_the_mix_with_dataloader_workers(shards, start_method):
    torch = pytest.importorskip("torch")  # noqa: F841
    spec = spec_for(shards, samples_per_epoch=600)

    def loader():
        return wds.WebLoader(
            wds.from_spec(spec).to_tuple("__key__"), batch_size=10, num_workers=2, multiprocessing_context=start_method
        )

    expected, resumed = _stopped_and_resumed(loader, 17)
    assert resumed == expected
    assert len(expected) == 600


# stores and profiles
def test_a_mix_of_s3_and_local_sources_with_their_own_profiles(shards, s3_bucket, tmp_path, monkeypatch):
    """Three sources: local disk, and two S3 prefixes, one configured by a named profile, one by its own
    storage options (the dataset has none, and the profiles file no URL-prefix table)."""
    bucket, options = s3_bucket
    for name, count in (("c", 2), ("b", 3)):
        for s in range(count):
            with (
                open(shards / f"{name}-{s}.tar", "rb") as f,
                gopen(f"s3://{bucket}/{name}/{name}-{s}.tar", "wb", storage_options=options) as out,
            ):
                out.write(f.read())
    profiles = tmp_path / "profiles.toml"
    profiles.write_text(
        f'[profiles.moto]\nendpoint_url = "{options["endpoint_url"]}"\nkey = "testing"\nsecret = "testing"\n'
    )
    monkeypatch.setenv("WDS_CLOUD_CONFIG", str(profiles))
    spec = {
        "version": 1,
        "seed": 3,
        "sources": [
            {"name": "local", "urls": f"{shards}/a-{{0..3}}.tar", "weight": 1, "resampled": True},
            {"name": "by-profile", "urls": f"s3://{bucket}/c/c-{{0..1}}.tar", "weight": 1, "profile": "moto"},
            {"name": "by-options", "urls": f"s3://{bucket}/b/b-{{0..2}}.tar", "weight": 1, "storage_options": options},
        ],
    }
    ds = wds.from_spec(spec)
    got = collections.Counter(s["__source__"] for s in ds)
    assert got["by-profile"] == 200 or got["by-options"] == 600  # a finite source ended the epoch
    assert min(got.values()) > 100
    assert ds.stats["sources"]["by-options"]["transfer"].bytes > 0
    spec["sources"][1]["profile"] = "nosuch"
    with pytest.raises(ConfigError, match=r"no profile 'nosuch'.*\[profiles.nosuch\]"):
        wds.from_spec(spec)


def test_a_remote_spec_over_http_is_data(shards, http_store, monkeypatch):
    """A spec fetched from a server: its relative URLs resolve against it, and its pipe: URLs do not run."""
    from .cloud import HTTP_TOKEN

    server, store = http_store
    for s in range(2):
        store.put(f"/spec/c-{s}.tar", (shards / f"c-{s}.tar").read_bytes())
    store.put(
        "/spec/train.json", json.dumps({"version": 1, "sources": [{"name": "c", "urls": "c-{0..1}.tar"}]}).encode()
    )
    options = {"headers": {"Authorization": f"Bearer {HTTP_TOKEN}"}}
    ds = wds.WebDataset(f"{server.url}/spec/train.json", storage_options=options)
    assert isinstance(ds, MixedDataset) and len(keys(ds)) == 200
    store.put(
        "/spec/evil.json", json.dumps({"version": 1, "sources": [{"name": "p", "urls": ["pipe:echo pwned"]}]}).encode()
    )
    monkeypatch.delenv("WDS_ALLOW_UNTRUSTED_PIPES", raising=False)
    with pytest.raises(SecurityError):
        list(wds.WebDataset(f"{server.url}/spec/evil.json", storage_options=options))


def test_stats_count_what_this_process_drew(shards):
    spec = spec_for(shards, samples_per_epoch=300)
    ds = wds.from_spec(spec)
    it = iter(ds)
    for _ in range(100):
        next(it)
    resumed = wds.from_spec(spec)
    resumed.load_state_dict(ds.state_dict(strict=True))
    assert len(keys(resumed)) == 200 and resumed.stats["samples"] == 200
    assert len(keys(resumed)) == 300 and resumed.stats["samples"] == 500


def test_a_shuffle_after_a_mix_names_the_fix_that_fits_a_mix(shards):
    """The inexact state of a shuffle after a mix points at 'shuffle:' per source, as docs/specs.md does."""
    ds = wds.from_spec(spec_for(shards)).shuffle(10)
    why = ds.resume_blocker()
    assert "shuffle: N" in why and "tarfile_to_samples" not in why


# a sample shuffle after a mix resumes exactly: the mix says where each buffered sample came from
def plain_spec(root, **top):
    """Sources without shuffles of their own: the sample shuffle comes after the mix."""
    spec = spec_for(root, **top)
    for source in spec["sources"]:
        source.pop("shuffle", None)
    return spec


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 599), epochs_before=st.integers(0, 1))
@example(cut=0, epochs_before=0)
@example(cut=599, epochs_before=1)
def test_a_shuffle_after_a_spec_mix_resumes_exactly(shards, cut, epochs_before):
    spec = plain_spec(shards, samples_per_epoch=600)

    def dataset():
        return wds.from_spec(spec).shuffle(100)

    reference = dataset()
    for _ in range(epochs_before):
        keys(reference)
    expected = keys(reference)
    ds = dataset()
    for _ in range(epochs_before):
        keys(ds)
    it = iter(ds)
    head = [next(it)["__key__"] for _ in range(cut)]
    state = json.loads(json.dumps(ds.state_dict(strict=True)))
    resumed = dataset()
    resumed.load_state_dict(state)
    assert head + keys(resumed) == expected
    assert len(expected) == 600


def test_a_yaml_spec_then_shuffle_resumes_as_webdataset_users_write_it(shards, tmp_path):
    """``WebDataset("train.yaml").shuffle(1000)``: exact, with the seed of the spec."""
    path = tmp_path / "train.yaml"
    path.write_text(json.dumps(plain_spec(shards)))  # JSON is YAML
    expected = keys(wds.WebDataset(str(path)).shuffle(1000))
    assert expected == keys(wds.WebDataset(str(path)).shuffle(1000))  # the spec's seed seeds the shuffle too
    ds = wds.WebDataset(str(path)).shuffle(1000)
    it = iter(ds)
    head = [next(it)["__key__"] for _ in range(333)]
    state = ds.state_dict(strict=True)
    resumed = wds.WebDataset(str(path)).shuffle(1000)
    resumed.load_state_dict(state)
    assert head + keys(resumed) == expected


def test_a_shuffle_after_a_spec_mix_resumes_exactly_with_dataloader_workers(shards):
    pytest.importorskip("torch")
    spec = plain_spec(shards, samples_per_epoch=600)

    def loader():
        return wds.WebLoader(wds.from_spec(spec).shuffle(50).to_tuple("__key__"), batch_size=10, num_workers=2)

    expected, resumed = _stopped_and_resumed(loader, 23)
    assert resumed == expected
    assert sorted(expected) == sorted(set(expected)) and len(expected) == 600


@pytest.mark.parametrize("cut", [0, 1, 120, 899])
def test_a_shuffle_after_random_mix_resumes_exactly(shards, cut):
    def pipeline():
        sources = [
            wds.WebDataset(f"{shards}/a-{{0..3}}.tar", shardshuffle=False),
            wds.WebDataset(f"{shards}/c-{{0..1}}.tar", shardshuffle=False),
        ]
        return wds.DataPipeline(wds.RandomMix(sources, [3, 1], seed=4, longest=True), wds.shuffle(64, seed=9))

    expected = keys(pipeline())
    assert len(expected) == 1400 and expected == keys(pipeline())
    ds = pipeline()
    it = iter(ds)
    head = [next(it)["__key__"] for _ in range(cut)]
    state = json.loads(json.dumps(ds.state_dict(strict=True)))
    resumed = pipeline()
    resumed.load_state_dict(state)
    assert head + keys(resumed) == expected


def test_random_mix_alone_resumes_and_a_changed_state_is_refused(shards):
    def pipeline():
        sources = [
            wds.WebDataset(f"{shards}/b-{{0..2}}.tar", shardshuffle=False),
            wds.WebDataset(f"{shards}/c-{{0..1}}.tar", shardshuffle=False),
        ]
        return wds.DataPipeline(wds.RandomMix(sources, seed=1))

    expected = keys(pipeline())
    ds = pipeline()
    it = iter(ds)
    head = [next(it)["__key__"] for _ in range(50)]
    state = ds.state_dict(strict=True)
    resumed = pipeline()
    resumed.load_state_dict(state)
    assert head + keys(resumed) == expected
    stage = state["stages"][0][2]
    for field, value in (("rng", [1, -1]), ("active", [0, 0]), ("active", [5]), ("sources", [])):
        changed = json.loads(json.dumps(state))
        changed["stages"][0][2] = dict(stage, **{field: value})
        with pytest.raises(StateMismatchError):
            pipeline().load_state_dict(changed)


def test_a_shuffle_after_interleaved_documents_resumes_exactly(tmp_path):
    """``interleaved()`` maps each sample to a document: a shuffle after it refetches the samples and maps
    them again."""
    with wds.TarWriter(str(tmp_path / "docs.tar")) as w:
        for i in range(60):
            doc = {"text_list": [f"doc {i}"], "image_info": []}
            w.write({"__key__": f"d{i:03d}", "json": json.dumps(doc).encode()})

    def pipeline():
        return wds.DataPipeline(
            wds.SimpleShardList(str(tmp_path / "docs.tar")),
            wds.tarfile_to_samples(),
            wds.interleaved(imagespec=None),
            wds.shuffle(16, seed=2),
        )

    expected = keys(pipeline())
    ds = pipeline()
    it = iter(ds)
    head = [next(it)["__key__"] for _ in range(21)]
    resumed = pipeline()
    resumed.load_state_dict(ds.state_dict(strict=True))
    assert head + keys(resumed) == expected


def test_a_mix_whose_sources_shuffle_too_gives_an_inexact_state_that_warns_once_on_load(shards):
    """Sources that keep buffers of their own and a shuffle after the mix: no reader names the samples in the
    outer buffer.  Training goes on; the state says so, loading it warns once that the epoch restarts."""
    ds = wds.from_spec(spec_for(shards)).shuffle(10)
    it = iter(ds)
    next(it)
    with pytest.raises(wds.NotResumableError, match="shuffle in one place"):
        ds.state_dict(strict=True)
    state = ds.state_dict()
    again = wds.from_spec(spec_for(shards)).shuffle(10)
    with pytest.warns(wds.InexactResumeWarning, match="epoch starts again") as caught:
        again.load_state_dict(state)
    assert len([w for w in caught if issubclass(w.category, wds.InexactResumeWarning)]) == 1


def test_a_dataset_seed_seeds_its_sample_shuffles(shards):
    """``WebDataset(url, seed=S).shuffle(n)``: the same S, the same order, epoch after epoch; another S or no
    seed, another order."""
    url = f"{shards}/a-{{0..3}}.tar"

    def run(**kw):
        ds = wds.WebDataset(url, shardshuffle=False, **kw).shuffle(200)
        return keys(ds), keys(ds)

    first, second = run(seed=5)
    assert run(seed=5) == (first, second)
    assert first != second  # each epoch its own order
    assert run(seed=6)[0] != first
    assert run()[0] != run()[0]  # without a seed, as before: a fresh seed each pass
    explicit = wds.WebDataset(url, shardshuffle=False, seed=5).shuffle(200, seed=1)
    assert keys(explicit) == keys(wds.WebDataset(url, shardshuffle=False, seed=99).shuffle(200, seed=1))


def test_a_spec_file_is_read_once_whatever_it_holds(tmp_path, monkeypatch):
    """WebDataset reads a spec file once: what decides its class (a mix, webdataset's ``datasets:``) is what it
    then uses; as a file:// URL too."""
    from wds_cloud.io import datafile

    for s in range(2):
        with wds.TarWriter(str(tmp_path / f"x-{s:03d}.tar")) as sink:
            for i in range(3):
                sink.write({"__key__": f"{s}_{i}", "txt": b"a"})
    (tmp_path / "d.yaml").write_text("datasets:\n  - name: a\n    shards: x-{000..001}.tar\n")
    (tmp_path / "m.yaml").write_text("version: 1\nsources:\n  - name: a\n    urls: x-{000..001}.tar\n")
    reads = []
    load = datafile.load
    monkeypatch.setattr(datafile, "load", lambda url, *a, **kw: reads.append(url) or load(url, *a, **kw))
    for name in ("d.yaml", "m.yaml"):
        for url in (str(tmp_path / name), f"file://{tmp_path / name}"):
            reads.clear()
            assert len(list(wds.WebDataset(url, shardshuffle=False))) == 6
            assert reads == [url]


# states of a mix carry a checksum and are checked field by field (issue 41)
def _two_sources(root):
    """A RandomMix of 1,200 samples of 'a' and 200 of 'c', in shard order (each source's order is fixed)."""
    return [
        wds.WebDataset(f"{root}/a-{{0..3}}.tar", shardshuffle=False),
        wds.WebDataset(f"{root}/c-{{0..1}}.tar", shardshuffle=False),
    ]


def _state_at(make, cut):
    ds = make()
    it = iter(ds)
    head = [next(it)["__key__"] for _ in range(cut)]
    return head, json.loads(json.dumps(ds.state_dict()))


def _resealed(state):
    return seal({k: v for k, v in state.items() if k != "checksum"})


def test_a_random_mix_state_carries_a_checksum_and_an_unsealed_one_is_refused(shards):
    """RandomMix.state_dict() is sealed; a state without a checksum (an earlier version's, or edited) is refused
    with the fix: take a new state."""

    def make():
        return wds.RandomMix(_two_sources(shards), [3, 1], seed=4, longest=True)

    expected = keys(make())
    head, state = _state_at(make, 100)
    assert isinstance(state.get("checksum"), str)
    resumed = make()
    resumed.load_state_dict(state)
    assert head + keys(resumed) == expected
    unsealed = {k: v for k, v in state.items() if k != "checksum"}
    with pytest.raises(StateMismatchError, match="take a new state") as info:
        make().load_state_dict(unsealed)
    assert info.value.field == "checksum"
    changed = dict(state, rng=[state["rng"][0], state["rng"][1] + 1])  # not sealed again
    with pytest.raises(StateMismatchError, match="checksum|draws"):  # the count check may see it first
        make().load_state_dict(changed)
    changed = seal(dict(state, rng=[state["rng"][0], state["rng"][1] + 1]))  # sealed again: the count is checked
    with pytest.raises(StateMismatchError, match="draws") as info:
        make().load_state_dict(changed)
    assert info.value.field == "rng"


@pytest.mark.parametrize("longest", [True, False])
def test_a_source_taken_out_of_active_in_a_resealed_random_mix_state_is_refused(shards, longest):
    """The issue's case: a source removed from 'active' and the state sealed again would never give its samples;
    it is refused (StateMismatchError) before a sample is drawn."""

    def make():
        return wds.RandomMix(_two_sources(shards), [3, 1], seed=4, longest=longest)

    _, state = _state_at(make, 40)
    for active in ([0], [1], []):
        forged = _resealed(dict(state, active=active))
        ds = make()
        try:
            ds.load_state_dict(forged)
        except StateMismatchError:
            continue
        with pytest.raises(StateMismatchError, match="still has samples|none of its datasets has ended"):
            next(iter(ds))


def test_a_source_that_really_ended_may_be_left_out_of_active(shards):
    """A legitimate state taken after a source ended (longest=True) resumes exactly."""

    def make():
        return wds.RandomMix(_two_sources(shards), [1, 3], seed=4, longest=True)

    expected = keys(make())
    head, state = _state_at(make, 900)  # 'c' (200 samples, weight 3) has ended by then
    assert state["active"] == [0]
    resumed = make()
    resumed.load_state_dict(state)
    assert head + keys(resumed) == expected


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda s: s.update(rng=[10**5000, s["rng"][1]]), "rng"),
        (lambda s: s.update(rng=[1 << 64, s["rng"][1]]), "rng"),
        (lambda s: s.update(rng=[s["rng"][0], 10**6]), "rng"),  # more draws than samples given
        (lambda s: s.update(rng=[s["rng"][0], True]), "rng"),
        (lambda s: s.update(active=[1, 0]), "active"),
        (lambda s: s.update(active=[0, 0]), "active"),
        (lambda s: s.update(extra=1), "extra"),
        (lambda s: s.update(fresh=True), "active"),  # a fresh state holds no generator and no active list
        (lambda s: s.update(sources=s["sources"][::-1]), None),
    ],
)
def test_a_resealed_random_mix_state_is_checked_field_by_field(shards, change, field):
    """Seeds bounded (a seed of 5,000 digits is refused at load, not a raw ValueError when the pass begins),
    counts of draws no more than possible, 'active' in order, unknown keys refused: StateMismatchError."""

    def make():
        return wds.RandomMix(_two_sources(shards), [3, 1], seed=4, longest=True)

    _, state = _state_at(make, 30)
    changed = dict(state)
    change(changed)
    try:
        forged = _resealed(changed)
    except StateMismatchError:  # no JSON holds a 5,000-digit number: the dict as a pickle would carry it
        forged = changed
    with pytest.raises(StateMismatchError) as info:
        make().load_state_dict(forged)
    if field is not None:
        assert info.value.field == field


def _spec_mix(root):
    """A mix of 300 samples per epoch; each source in its shard order (to tell a gap or a repeat)."""
    spec = plain_spec(root, samples_per_epoch=300)
    for source in spec["sources"]:
        source["shardshuffle"] = False
    return spec


def _resealed_pipeline(state, stage_index, stage_state):
    stages = [list(entry) for entry in state["stages"]]
    stages[stage_index][2] = _resealed(stage_state)
    return _resealed(dict(state, stages=stages))


def test_a_spec_mix_state_carries_its_own_checksum_and_is_checked(shards):
    """The mix stage's state is sealed too; without its checksum, with an unknown key, or with a source added to
    'dropped' that has not ended (sealed again, pipeline and stage), it is refused."""
    spec = _spec_mix(shards)
    expected = keys(wds.from_spec(spec))
    head, state = _state_at(lambda: wds.from_spec(spec), 50)
    index = next(i for i, entry in enumerate(state["stages"]) if entry[1] == "MixSource")
    mix = state["stages"][index][2]
    assert isinstance(mix.get("checksum"), str)
    resumed = wds.from_spec(spec)
    resumed.load_state_dict(state)
    assert head + keys(resumed) == expected
    unsealed = [list(entry) for entry in state["stages"]]
    unsealed[index][2] = {k: v for k, v in mix.items() if k != "checksum"}
    with pytest.raises(StateMismatchError, match="take a new state"):
        wds.from_spec(spec).load_state_dict(_resealed(dict(state, stages=unsealed)))
    with pytest.raises(StateMismatchError, match="extra"):
        wds.from_spec(spec).load_state_dict(_resealed_pipeline(state, index, dict(mix, extra=1)))
    dropped = dict(mix, dropped=[0], draws=mix["draws"] + 1)
    ds = wds.from_spec(spec)
    with pytest.raises(StateMismatchError, match="still has samples"):
        ds.load_state_dict(_resealed_pipeline(state, index, dropped))
        next(iter(ds))


def _in_source_order(got, root):
    """Each source's keys in ``got`` come once each, in that source's order, from its first (no repeats, no gaps)."""
    by_source = collections.defaultdict(list)
    for key in got:
        by_source[key[0]].append(key)
    for name, seen in by_source.items():
        count, per = SIZES[name]
        order = [f"{name}{s}-{i:04d}" for s in range(count) for i in range(per)]
        if seen != order[: len(seen)]:
            return False
    return True


_RANDOM_MIX_FORGERIES = [
    ("rng count", lambda s, d: s.update(rng=[s["rng"][0], max(0, s["rng"][1] + d)])),
    ("rng seed", lambda s, d: s.update(rng=[s["rng"][0] + d, s["rng"][1]])),
    ("huge seed", lambda s, d: s.update(rng=[(1 << 64) + abs(d), s["rng"][1]])),
    ("drop active", lambda s, d: s.update(active=[i for i in s["active"] if i != d % 2])),
    ("add active", lambda s, d: s.update(active=sorted({*s["active"], d % 2}))),
    ("no active", lambda s, d: s.update(active=[])),
    ("unknown key", lambda s, d: s.update(extra=d)),
    ("fresh", lambda s, d: s.update(fresh=True)),
    ("swap sources", lambda s, d: s.update(sources=s["sources"][::-1])),
    ("one source", lambda s, d: s.update(sources=s["sources"][:1])),
]


_EXPECTED: dict = {}


def _small_sources(root):
    """600 samples of 'b' and 200 of 'c', each in shard order."""
    return [
        wds.WebDataset(f"{root}/b-{{0..2}}.tar", shardshuffle=False),
        wds.WebDataset(f"{root}/c-{{0..1}}.tar", shardshuffle=False),
    ]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    cut=st.integers(0, 799),
    forgery=st.sampled_from(range(len(_RANDOM_MIX_FORGERIES))),
    delta=st.integers(-3, 3),
    longest=st.booleans(),
)
@example(cut=40, forgery=3, delta=1, longest=True)  # the case: 'c' taken out of the mix
@example(cut=790, forgery=4, delta=1, longest=True)  # an ended source put back: it is met and leaves again
def test_a_forged_random_mix_state_gives_the_exact_rest_or_is_refused(shards, cut, forgery, delta, longest):
    """Mutate a RandomMix state, seal it again, load it, iterate: StateMismatchError, or every sample of the
    pass once (each source in its order, none dropped, none twice); unchanged, exactly the rest."""

    def make():
        return wds.RandomMix(_small_sources(shards), [3, 1], seed=4, longest=longest)

    expected = _EXPECTED.get(longest) or _EXPECTED.setdefault(longest, keys(make()))
    ds = make()
    it = iter(ds)
    head = [s["__key__"] for s in itertools.islice(it, cut)]
    state = json.loads(json.dumps(ds.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    assert head + keys(resumed) == expected
    changed = json.loads(json.dumps(state))
    _RANDOM_MIX_FORGERIES[forgery][1](changed, delta)
    try:
        forged = _resealed(changed)
        again = make()
        again.load_state_dict(forged)
        rest = [s["__key__"] for s in itertools.islice(iter(again), 2000)]
    except StateMismatchError:
        return
    assert _RANDOM_MIX_FORGERIES[forgery][0] not in ("huge seed", "unknown key", "fresh", "swap sources", "one source")
    got = head + rest
    assert len(got) == len(set(got)) and _in_source_order(got, shards)
    if longest:
        assert sorted(got) == sorted(expected)  # nothing dropped: every sample of both sources came
    else:  # the pass ends when a source ends: one of them came whole
        assert any(sum(k[0] == name for k in got) == SIZES[name][0] * SIZES[name][1] for name in "bc")


_MIX_SOURCE_FORGERIES = [
    ("drop a source", lambda s, d: s.update(dropped=[d % 2], draws=s["count"] + 1)),
    ("drop the resampled one", lambda s, d: s.update(dropped=[1], draws=s["count"] + 1)),
    ("draws", lambda s, d: s.update(draws=max(0, s["draws"] + d))),
    (
        "count and taken",
        lambda s, d: s.update(count=s["count"] + d, taken=[max(0, s["taken"][0] + d), *s["taken"][1:]]),
    ),
    ("count past the epoch", lambda s, d: s.update(count=10**6 + d, taken=[10**6 + d, 0, 0], draws=10**6 + d)),
    ("quota", lambda s, d: s.update(quota=s["count"] + d)),
    ("pass", lambda s, d: s.update({"pass": s["pass"] + d})),
    ("unknown key", lambda s, d: s.update(seed=d)),
    ("names", lambda s, d: s.update(names=s["names"][::-1])),
    ("swap sources", lambda s, d: s.update(sources=s["sources"][::-1])),
]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 299), forgery=st.sampled_from(range(len(_MIX_SOURCE_FORGERIES))), delta=st.integers(-2, 2))
@example(cut=50, forgery=0, delta=0)  # source 'a' (never ended) said to have left the mix
def test_a_forged_spec_mix_state_gives_the_exact_rest_or_is_refused(shards, cut, forgery, delta):
    """Mutate the mix stage's state of a spec mix (samples_per_epoch), seal stage and pipeline again, load,
    iterate: StateMismatchError, or no sample twice, each source in its order, and no source left out early."""
    spec = _spec_mix(shards)
    make = lambda: wds.from_spec(spec)  # noqa: E731
    expected = keys(make())
    head, state = _state_at(make, cut)
    index = next(i for i, entry in enumerate(state["stages"]) if entry[1] == "MixSource")
    mix = json.loads(json.dumps(state["stages"][index][2]))
    _MIX_SOURCE_FORGERIES[forgery][1](mix, delta)
    try:
        ds = make()
        ds.load_state_dict(_resealed_pipeline(state, index, mix))
        rest = [s["__key__"] for s in itertools.islice(iter(ds), 3000)]
    except StateMismatchError:
        return
    assert _MIX_SOURCE_FORGERIES[forgery][0] not in (
        "drop a source",  # 'a' never ends, 'b' is resampled: neither can have left the mix
        "drop the resampled one",
        "count past the epoch",
        "unknown key",
        "names",
        "swap sources",
    )
    got = head + rest
    # 'b' is resampled (its samples may repeat); 'a' and 'c' come once each, in order
    plain = [k for k in got if k[0] != "b"]
    assert len(plain) == len(set(plain)) and _in_source_order(plain, shards)
    if forgery == 2 and delta == 0:  # unchanged
        assert got == expected
