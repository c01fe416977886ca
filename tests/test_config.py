"""Settings are read from the environment in one place, and every variable read is documented."""

import dataclasses
import decimal
import math
import pathlib
import re

import numpy
import pytest

from wds_cloud import config
from wds_cloud.config import Settings, parse_size
from wds_cloud.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]


class RecordingEnviron(dict):
    """A mapping that remembers every key looked up."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.seen = set()

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)


def documented_variables():
    """The variables of config.ENV_DOCS, the data docs/environment.md's table is generated from."""
    return {name for row in config.ENV_DOCS for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row[0])}


def test_every_variable_read_is_documented():
    """Settings.from_environ looks up only variables that config.ENV_DOCS (docs/environment.md) lists."""
    env = RecordingEnviron()
    Settings.from_environ(env)
    undocumented = env.seen - documented_variables()
    assert not undocumented, f"document these in wds_cloud.config.ENV_DOCS: {sorted(undocumented)}"
    assert "<!-- generated: environment -->" in (ROOT / "docs" / "environment.md").read_text()
    assert set(config.ENV_VARS) == env.seen


def test_only_config_reads_the_environment():
    """No module but config.py touches os.environ or getenv."""
    offenders = []
    for path in list((ROOT / "wds_cloud").rglob("*.py")) + list((ROOT / "plugins").rglob("*.py")):
        if path.name == "config.py":
            continue
        text = path.read_text()
        if re.search(r"os\.environ|getenv\(|environ\.get", text):
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders


def test_typed_values():
    """Seeds are integers, sizes accept units, booleans accept the usual spellings."""
    s = Settings.from_environ(
        {
            "WDS_SEED": "42",
            "WDS_CACHE_SIZE": "50GB",
            "WDS_SECURE": "yes",
            "WDS_BUCKET": "b1",
            "WDS_REWRITE": "a=b;c=d",
            "GOPEN_REWRITE": "a=z",
        }
    )
    assert s.seed == 42 and s.cache_size == 50 * 10**9 and s.secure
    assert dict(s.template_vars)["BUCKET"] == "b1"
    assert s.rewrites == (("a", "b"), ("c", "d"), ("a", "z"))
    assert parse_size("x", "1e10") == 10**10 and parse_size("x", "512MiB") == 512 * 2**20


@pytest.mark.parametrize(
    "env, name",
    [
        ({"WDS_SEED": "abc"}, "WDS_SEED"),
        ({"WDS_SECURE": "maybe"}, "WDS_SECURE"),
        ({"WDS_CACHE_SIZE": "12 parsecs"}, "WDS_CACHE_SIZE"),
        ({"GOPEN_REWRITE": "nothing"}, "GOPEN_REWRITE"),
    ],
)
def test_bad_values_name_the_variable(env, name):
    """A malformed value raises ConfigError (a ValueError) naming the variable."""
    with pytest.raises(ConfigError, match=name) as info:
        Settings.from_environ(env)
    assert isinstance(info.value, ValueError)


def test_settings_are_frozen_and_hashable():
    """Settings cannot be changed in place and can key a cache."""
    s = Settings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.secure = True
    assert hash(s) == hash(Settings()) and s.replace(secure=True).secure


def test_show_seed_and_verbose_cache_do_what_the_docs_say(tmp_path, monkeypatch, caplog):
    """WDS_SHOW_SEED=1 logs the seeds in use; WDS_VERBOSE_CACHE=1 makes the shard cache log its activity."""
    import logging

    import wds_cloud as wds
    from wds_cloud.cache import FileCache

    with wds.ShardWriter(str(tmp_path / "s-%02d.tar"), maxcount=5) as sink:
        for i in range(10):
            sink.write({"__key__": f"{i:02d}", "txt": str(i)})
    monkeypatch.setenv("WDS_SHOW_SEED", "1")
    with caplog.at_level(logging.INFO, logger="wds_cloud"):
        list(wds.WebDataset(str(tmp_path / "s-{00..01}.tar"), shardshuffle=7).shuffle(4, seed=3))
    assert "shard order of 2 shards seeded with" in caplog.text and "shuffle(bufsize=4) seeded with 3" in caplog.text
    assert not FileCache(str(tmp_path / "c")).verbose
    monkeypatch.setenv("WDS_VERBOSE_CACHE", "1")
    assert FileCache(str(tmp_path / "c")).verbose


# --- every numeric setting is range-checked where it is read (issue 41, item 7) -------------------------------------

#: what careless users and hostile environments put in numeric variables: each must be accepted meaning something
#: sane (within the documented range) or refused by a ConfigError naming the variable
HOSTILE_TEXT = [
    "nan",
    "NaN",
    "inf",
    "-inf",
    "Infinity",
    "-1",
    "0",
    "1",
    "1e999",
    "-1e999",
    "1e-999",
    "",
    " 5 ",
    "0x10",
    "1_000",
    "5.5",
    "true",
    "1e3",
    "+7",
    "\u0665",  # an Arabic-Indic five: int() and float() take it
    "9" * 5000,  # past int()'s digit limit
    "18446744073709551616",
    "1e308GB",
]


@pytest.mark.parametrize("name", config.ENV_VARS)
def test_every_variable_accepts_sane_values_or_names_itself(name):
    """Every variable read, given each hostile spelling, is accepted within its documented range or refused by a
    ConfigError naming the variable and its range -- never another exception, never nonsense accepted."""
    for value in HOSTILE_TEXT:
        try:
            settings = Settings.from_environ({name: value})
        except ConfigError as exc:
            assert name in str(exc) and isinstance(exc, ValueError), value
            if name in config.BOUNDS:
                assert config.BOUNDS[name].describe() in str(exc), str(exc)
            continue
        if name not in config.BOUNDS:
            continue
        bound = config.BOUNDS[name]
        got = getattr(settings, bound.field)
        if value.strip() == "":
            assert got == getattr(Settings(), bound.field), value  # unset: the default
            continue
        assert got is not None and not isinstance(got, bool), value
        assert isinstance(got, int) if bound.kind in ("count", "size") else isinstance(got, float), value
        assert math.isfinite(got) and bound.least <= got <= bound.most, (value, got)


def test_numeric_variables_all_have_a_documented_range():
    """A variable that takes a number (refuses a word, takes a few digits) has a bound in config.BOUNDS, so a new
    one is range-checked and fuzzed by the test above without anyone listing it; each bound's range is in the
    docs."""
    numeric = set()
    for name in config.ENV_VARS:
        try:
            Settings.from_environ({name: "abc"})
        except ConfigError:
            for digits in ("5", "65536"):  # a part size is at least 64 KiB
                try:
                    Settings.from_environ({name: digits})
                except ConfigError:
                    continue
                numeric.add(name)
    assert numeric == set(config.BOUNDS)
    rows = {name: row for row in config.ENV_DOCS for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row[0])}
    for name, bound in config.BOUNDS.items():
        assert bound.describe() in rows[name][1], (name, rows[name][1])
        assert hasattr(Settings(), bound.field)
    import importlib.util

    spec = importlib.util.spec_from_file_location("generated", ROOT / "docs" / "_hooks" / "generated.py")
    generated = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generated)
    assert config.BOUNDS["WDS_RETRY_TIMEOUT"].describe() in generated.environment_page()


@pytest.mark.parametrize(
    "name, value",
    [
        ("WDS_RETRY_TIMEOUT", "-1"),
        ("WDS_RETRY_TIMEOUT", "1e999"),
        ("WDS_RETRY_TIMEOUT", "0"),
        ("WDS_RETRY_TIMEOUT", "1e-9"),  # a socket timeout the kernel would read as none at all
        ("WDS_RETRY_BACKOFF", "-1"),
        ("WDS_RETRY_BACKOFF", "nan"),
        ("WDS_RETRIES", "-5"),
        ("WDS_PROGRESS_INTERVAL", "nan"),
        ("WDS_PROGRESS_INTERVAL", "-5"),
        ("WDS_MAX_MEMBER_SIZE", "1e999"),
        ("WDS_CONCURRENCY", "100000"),
        ("WDS_SEED", "9" * 5000),
    ],
)
def test_issue_values_are_refused_before_any_request(http_store, monkeypatch, name, value):
    """The issue's cases: a bad retry or progress setting is a ConfigError naming the variable and its range
    when a remote read begins, not a header diagnosis, a raw OverflowError or ValueError on the first 503."""
    from wds_cloud.io.open import gopen
    from wds_cloud.testing.faults import FaultProxy

    server, store = http_store
    store.put("/config/x.bin", b"x" * 1000)
    proxy = FaultProxy(server.url, error_first=1)  # the first answer is a 503: the backoff is used
    try:
        monkeypatch.setenv(name, value)
        with pytest.raises(ConfigError) as info:
            with gopen(proxy.url + "/config/x.bin", storage_options={"headers": {"Authorization": "Bearer t0k"}}):
                pass
    finally:
        proxy.stop()
    message = str(info.value)
    assert name in message and config.BOUNDS[name].describe() in message and "newline" not in message
    assert "t0k" not in message


def test_rank_must_lie_within_the_world():
    """RANK (or LOCAL_RANK standing in for it) at or past WORLD_SIZE, and LOCAL_RANK past LOCAL_WORLD_SIZE, are
    refused: a split by such a rank would give this process no shards, silently."""
    with pytest.raises(ConfigError, match="RANK=4.*WORLD_SIZE=4"):
        Settings.from_environ({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ConfigError, match="LOCAL_RANK=2.*WORLD_SIZE=2"):
        Settings.from_environ({"LOCAL_RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="LOCAL_RANK=8.*LOCAL_WORLD_SIZE=8"):
        Settings.from_environ({"LOCAL_RANK": "8", "LOCAL_WORLD_SIZE": "8"})
    ok = Settings.from_environ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (ok.rank, ok.world_size, ok.local_rank, ok.local_world_size) == (3, 4, 1, 2)


HOSTILE_NUMBERS = [
    float("nan"),
    float("inf"),
    float("-inf"),
    -1,
    0,
    0.0,
    1e-999,
    10**400,
    2.5,
    True,
    "1e999",
    "-1",
    " 5 ",
    "nan",
    numpy.int64(-1),
    numpy.int64(8),
    numpy.float32("nan"),
    numpy.float64(2.5),
    numpy.bool_(True),
    decimal.Decimal("5"),
]


@pytest.mark.parametrize("name", sorted({b.keyword for b in config.BOUNDS.values() if b.keyword}))
@pytest.mark.parametrize("value", HOSTILE_NUMBERS, ids=repr)
def test_keywords_share_the_variables_ranges(name, value):
    """The Python arguments that set what a variable sets (ReadOptions/WebDataset/gopen keywords) are checked
    against the same range, by the same function: accepted within it or a ConfigError naming the argument."""
    bound = next(b for b in config.BOUNDS.values() if b.keyword == name)
    try:
        got = config.check_setting(name, value)
    except ConfigError as exc:
        assert f"{name}=" in str(exc) and bound.describe() in str(exc)
        return
    assert not isinstance(got, bool) and math.isfinite(got) and bound.least <= got <= bound.most


@pytest.mark.parametrize(
    "keywords, name",
    [
        ({"timeout": -1}, "timeout"),
        ({"timeout": float("nan")}, "timeout"),
        ({"timeout": 1e999}, "timeout"),
        ({"retries": -5}, "retries"),
        ({"retries": 10**6}, "retries"),
    ],
)
def test_gopen_keywords_are_range_checked(http_store, keywords, name):
    """gopen's retries= and timeout= are refused out of range by a ConfigError naming the argument (a negative
    timeout was reported as a header holding a newline; an infinite one raised OverflowError)."""
    from wds_cloud.io.open import gopen

    server, store = http_store
    store.put("/config/y.bin", b"y" * 100)
    with pytest.raises(ConfigError, match=f"{name}=") as info:
        with gopen(server.url + "/config/y.bin", **keywords):
            pass
    assert "newline" not in str(info.value)


@pytest.mark.parametrize(
    "keywords, name",
    [
        ({"concurrency": 10**6}, "concurrency"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"prefetch": -1}, "prefetch"),
        ({"part_size": float("nan")}, "part_size"),
        ({"part_size": float("inf")}, "part_size"),
        ({"part_size": "1e999"}, "part_size"),
        ({"max_member_size": float("inf")}, "max_member_size"),
        ({"timeout": float("nan")}, "timeout"),
    ],
)
def test_dataset_keywords_are_range_checked(http_store, keywords, name):
    """WebDataset's transfer and limit keywords get the variables' ranges: a ConfigError naming the argument,
    by the time the first shard is read at the latest, never a raw ValueError or OverflowError."""
    import wds_cloud as wds

    server, store = http_store
    store.put("/config/empty.tar", b"\0" * 1024)
    with pytest.raises(ConfigError, match=f"{name}="):
        list(wds.WebDataset(server.url + "/config/empty.tar", shardshuffle=False, **keywords))


def test_retry_policy_checks_its_fields():
    """RetryPolicy, built directly, refuses a negative backoff, a NaN timeout and no attempts; the delay of a
    late attempt stays finite and never negative."""
    import random

    from wds_cloud.io.resilient import RetryPolicy

    for bad in ({"backoff": -1.0}, {"timeout": float("nan")}, {"attempts": 0}, {"max_backoff": float("inf")}):
        with pytest.raises(ConfigError):
            RetryPolicy(**bad)
    policy = RetryPolicy(attempts=1000, backoff=10.0)
    delays = [policy.delay(n, random.Random(n)) for n in (1, 2, 500, 1000, 5000)]
    assert all(0 <= d <= 10.0 for d in delays)


def test_a_value_error_that_is_not_a_header_is_not_called_one(http_store):
    """httpstream.request diagnoses a header holding a newline only when one does: a bad timeout reaching it is
    a ConfigError naming the timeout, not "a request header holds a newline or NUL"."""
    from wds_cloud.io import httpstream

    server, _ = http_store
    for timeout in (-1.0, float("nan"), 1e999):
        with pytest.raises(ConfigError, match="timeout=") as info:
            httpstream.request("GET", server.url + "/config/none", timeout=timeout)
        assert "newline" not in str(info.value)


def test_settings_built_directly_are_range_checked():
    """Settings(...) and settings.replace(...) check numeric fields against the same bounds."""
    with pytest.raises(ConfigError, match="retry_timeout"):
        Settings(retry_timeout=-1.0)
    with pytest.raises(ConfigError, match="progress_interval"):
        Settings().replace(progress_interval=float("nan"))
    assert Settings(concurrency=None, max_sample_size=None).concurrency is None


@pytest.mark.parametrize("line", ["concurrency = 1e999", "concurrency = true", "part_size = nan", "prefetch = 100000"])
def test_profile_transfer_keys_get_the_same_ranges(tmp_path, monkeypatch, line):
    """A storage profile's transfer keys (TOML: inf, nan, true are valid there) are held to the variables' ranges:
    a ConfigError naming the key and its range."""
    from wds_cloud.io.parallel import Fetcher

    profile = tmp_path / "profiles.toml"
    profile.write_text(f'["http://fast.example/"]\n{line}\n')
    monkeypatch.setenv("WDS_CLOUD_CONFIG", str(profile))
    key = line.split(" =")[0]
    with pytest.raises(ConfigError, match=f"{key}=") as info:
        Fetcher().options("http://fast.example/x.tar")
    assert config.BOUNDS[f"WDS_{key.upper()}"].describe() in str(info.value)


@pytest.mark.parametrize("value", ["1.5", "1.1KiB", "3.25", 2.5])
def test_a_size_that_is_part_of_a_byte_is_refused_not_cut(monkeypatch, value):
    """``WDS_MAX_MEMBER_SIZE=1.5`` was taken as 1 byte (every member refused, the error blaming the shard): a size
    that is not a whole number of bytes is refused, naming the bytes it came to; whole ones with units pass."""
    with pytest.raises(ConfigError, match="not a whole number of them"):
        config.check_setting("WDS_MAX_MEMBER_SIZE", value)
    with pytest.raises(ConfigError, match="WDS_MAX_MEMBER_SIZE"):
        monkeypatch.setenv("WDS_MAX_MEMBER_SIZE", str(value))
        config.current()
    monkeypatch.delenv("WDS_MAX_MEMBER_SIZE")
    import numpy as np

    import wds_cloud as wds

    for keyword in ("max_member_size", "max_sample_size"):  # a Python float was cut (1.5 -> 1): adversary finding
        for number in (1.5, 10.9, np.float64(600000.5)):
            with pytest.raises(ConfigError, match=f"{keyword}=.*not a whole number"):
                wds.WebDataset(["/no/such.tar"], **{keyword: number})
        assert wds.WebDataset(["/no/such.tar"], **{keyword: np.float64(600000.0)}) is not None
    assert [config.check_setting("WDS_MAX_MEMBER_SIZE", v) for v in ("1.5GiB", "0.3GB", "2.3GB", "1e3")] == [
        3 << 29,
        300_000_000,
        2_300_000_000,
        1000,
    ]


NOWHERE = "http://127.0.0.1:1/x.tar"  # never opened: the settings are refused when the dataset is built


@pytest.mark.parametrize("value", [0, 1, 16, 100, 511, (64 << 10) - 1, "1", "16KB", "0.06MiB"])
def test_a_part_size_below_the_floor_is_refused_alike_from_every_source(tmp_path, monkeypatch, value):
    """part_size=1 was taken and reads then hung or crawled (a request per byte): a part size below 64 KiB is a
    ConfigError naming the value, the range with its units and the fix, worded alike from an argument, a
    profile's key and WDS_PART_SIZE; 64 KiB itself is taken from each, and the docs state that floor."""
    import wds_cloud as wds
    from wds_cloud.io.parallel import Fetcher

    assert config.BOUNDS["WDS_PART_SIZE"].describe() == "from 64 KiB to 4 GiB"
    rule = "accepts a size (a number of bytes such as 4096, or with a unit such as 256MB or 2GiB) from 64 KiB to 4 GiB"
    with pytest.raises(ConfigError) as argument:
        wds.WebDataset(NOWHERE, part_size=value)
    assert str(argument.value) == (
        f"part_size={value!r} is out of range: part_size {rule}; pass a value within that range, or leave it out "
        "for the default (WDS_PART_SIZE)"
    )
    monkeypatch.setenv("WDS_PART_SIZE", str(value))
    with pytest.raises(ConfigError) as variable:
        config.current()
    assert str(variable.value) == (
        f"WDS_PART_SIZE={str(value)!r} is out of range: WDS_PART_SIZE {rule}; set it within that range, or unset it "
        "for the default"
    )
    monkeypatch.delenv("WDS_PART_SIZE")
    profile = tmp_path / "profiles.toml"
    profile.write_text(f'["http://fast.example/"]\npart_size = {value!r}\n')  # an int, or a TOML literal string
    monkeypatch.setenv("WDS_CLOUD_CONFIG", str(profile))
    with pytest.raises(ConfigError) as key:
        Fetcher().options("http://fast.example/x.tar")
    assert str(key.value) == (
        f'part_size={value!r} (in the profile ["http://fast.example/"] of {profile}) is out of range: part_size '
        f"{rule}; set it within that range there, or remove it for the default (WDS_PART_SIZE)"
    )
    # the floor itself, from each source
    profile.write_text('["http://fast.example/"]\npart_size = "64KiB"\n')
    assert Fetcher().options("http://fast.example/x.tar").part_size == 64 << 10
    monkeypatch.setenv("WDS_PART_SIZE", "65536")
    assert config.current().part_size == 64 << 10
    assert wds.WebDataset(NOWHERE, part_size="64KiB").options.part_size == 64 << 10
    for page in ("cloud.md", "parallel-reads.md"):
        assert "at least 64 KiB" in (ROOT / "docs" / page).read_text(), page


@pytest.mark.parametrize(
    "keyword, bad",
    [
        ("part_size", 0),
        ("part_size", "lots"),
        ("part_size", 1.5),
        ("concurrency", 0),
        ("concurrency", "four"),
        ("concurrency", 2000),
        ("max_concurrency", 0),
        ("max_concurrency", 2.5),
        ("prefetch", -1),
        ("prefetch", 65),
        ("prefetch", "next"),
    ],
)
def test_an_argument_is_refused_as_informatively_as_its_variable(monkeypatch, keyword, bad):
    """part_size=0 as an argument said only "give a whole number of at least 1" (no bytes, no "16MB"), where
    WDS_PART_SIZE=0 named the value, the range with its units and the fix: an argument's refusal now says what its
    variable's does (the kind, with units and spellings, and the range), and how to fix an argument."""
    import wds_cloud as wds

    variable = config.variable_for(keyword)
    with pytest.raises(ConfigError) as argument:
        wds.WebDataset(NOWHERE, **{keyword: bad})
    monkeypatch.setenv(variable, str(bad))
    with pytest.raises(ConfigError) as environment:
        config.current()
    said, told = str(argument.value), str(environment.value)
    assert said.startswith(f"{keyword}={bad!r} ") and told.startswith(f"{variable}={str(bad)!r} ")
    accepts = told.split(f"{variable} accepts ", 1)[1].split(";")[0]
    assert f": {keyword} accepts {accepts}; pass a value within that range, or leave it out for the default " in said
    assert said.endswith(f"({variable})")


def test_a_count_given_as_text_is_taken_as_its_variable_takes_it(monkeypatch):
    """concurrency='4' was refused ("is not a count") where WDS_CONCURRENCY=4, text, is taken: an argument takes
    the text its variable takes (and a whole float), holding the number; text and number are one value."""
    import wds_cloud as wds

    options = wds.ReadOptions(concurrency="4", max_concurrency=" 8 ", prefetch="0", part_size="16MB", retries=3.0)
    assert options.transfer == {"part_size": 16_000_000, "concurrency": 4, "max_concurrency": 8, "prefetch": 0}
    assert options.retries == 3 and type(options.retries) is int
    assert wds.WebDataset(NOWHERE, concurrency="4").options.concurrency == 4
    assert wds.WebDataset(NOWHERE, options=options, part_size=16_000_000, concurrency=4).options == options
    for name, value in options.transfer.items():
        monkeypatch.setenv(config.variable_for(name), str(value))
    assert dataclasses.asdict(config.current())["concurrency"] == options.concurrency
