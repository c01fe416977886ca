"""Settings are read from the environment in one place, and every variable read is documented."""

import dataclasses
import pathlib
import re

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
