"""The shard cache directory is not trusted: planted links are never followed, locks do not pile up,
and entries of URLs with credentials are private."""

import os
import stat

from wds_cloud.io.shardcache import ShardCache

from .remote import Remote

DATA = os.urandom(300_000)


def read_through(cache: ShardCache, url: str, data: bytes = DATA) -> bytes:
    with cache.open(url, lambda offset: Remote(data, offset)) as stream:
        return stream.read()


def test_planted_links_are_never_followed(tmp_path):
    """Links planted as the entry, its .part and its .lock leave their targets untouched, and are replaced."""
    cache = ShardCache(str(tmp_path / "cache"))
    url = "https://host/data/shard-0.tar"
    path = cache.path_for(url)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    targets = {}
    for suffix in ("", ".part", ".lock"):
        target = tmp_path / f"precious{suffix or '.entry'}"
        target.write_bytes(b"precious")
        os.symlink(target, path + suffix)
        targets[suffix] = target
    with open(path + ".meta", "w") as f:  # a planted record inviting a resume from the planted .part
        f.write('{"url": "x", "size": 300000, "version": "v1", "complete": false}')
    assert read_through(cache, url) == DATA
    assert all(t.read_bytes() == b"precious" for t in targets.values())
    assert not os.path.islink(path) and stat.S_ISREG(os.stat(path).st_mode)
    assert read_through(cache, url) == DATA  # and it is a hit now


def test_a_planted_link_as_a_complete_entry_is_refused(tmp_path):
    """A complete-looking entry that is a link to another file is not served; the shard is fetched again."""
    cache = ShardCache(str(tmp_path / "cache"))
    url = "https://host/data/shard-1.tar"
    assert read_through(cache, url) == DATA
    path = cache.path_for(url)
    outside = tmp_path / "outside.tar"
    outside.write_bytes(DATA)  # same size, so only the link gives it away
    os.unlink(path)
    os.symlink(outside, path)
    assert read_through(cache, url) == DATA
    assert not os.path.islink(path) and outside.read_bytes() == DATA


def test_lock_files_leave_with_their_entries(tmp_path):
    """Evicting entries removes their lock files: the directory does not fill with stale locks."""
    cache = ShardCache(str(tmp_path / "cache"), size_limit=700_000)
    for i in range(12):
        assert read_through(cache, f"https://host/data/shard-{i}.tar") == DATA
    names = os.listdir(cache.directory)
    entries = [n for n in names if n.endswith(".tar")]
    locks = [n for n in names if n.endswith(".lock") and not n.startswith(".")]
    assert len(entries) <= 2 and len(locks) <= len(entries) + 1


def test_entries_of_urls_with_credentials_are_private(tmp_path):
    """A URL carrying a credential makes an entry only its owner can read; others follow the umask."""
    old = os.umask(0o022)
    try:
        cache = ShardCache(str(tmp_path / "cache"))
        secret = "https://host/data/shard-2.tar?sig=SECRET"
        plain = "https://host/data/shard-3.tar"
        read_through(cache, secret)
        read_through(cache, plain)
        assert stat.S_IMODE(os.stat(cache.path_for(secret)).st_mode) & 0o077 == 0
        assert stat.S_IMODE(os.stat(cache.path_for(plain)).st_mode) == 0o644
        assert all("SECRET" not in name for name in os.listdir(cache.directory))
    finally:
        os.umask(old)
