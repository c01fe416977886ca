"""Commands and credentials the user did not allow: specs are data, rewrites keep the mark, redirects are checked."""

import http.server
import importlib
import io
import json
import posixpath
import tarfile
import threading
import urllib.parse

import pytest

import wds_cloud as wds
from wds_cloud.errors import SecurityError
from wds_cloud.io import UntrustedURL, untrusted
from wds_cloud.testing.objects import HTTPObjectHandler, Server, Store

gopen_module = importlib.import_module("wds_cloud.gopen")


def shard(tmp_path, name="s.tar"):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("a.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    path = tmp_path / name
    path.write_bytes(buf.getvalue())
    return path


def test_yaml_spec_urls_are_untrusted(tmp_path, monkeypatch):
    """A pipe: URL in a .yaml spec's shards runs only with WDS_ALLOW_UNTRUSTED_PIPES=1."""
    pytest.importorskip("yaml")
    path = shard(tmp_path)
    spec = tmp_path / "train.yaml"
    spec.write_text(f"datasets:\n  - name: one\n    shards: ['pipe:cat {path}']\n")
    with pytest.raises(SecurityError, match="WDS_ALLOW_UNTRUSTED_PIPES"):
        list(wds.WebDataset(str(spec)))
    monkeypatch.setenv("WDS_ALLOW_UNTRUSTED_PIPES", "1")
    assert [s["__key__"] for s in wds.WebDataset(str(spec))] == ["a"]


@pytest.mark.parametrize("target", ["PIPE:cat ", "Pipe:cat ", "pipe:cat "])
def test_rewrites_to_pipe_are_untrusted_whatever_the_case(tmp_path, monkeypatch, target):
    """A rewrite rule producing PIPE:/Pipe:/pipe: makes an untrusted URL, refused by default."""
    path = shard(tmp_path)
    monkeypatch.setenv("WDS_REWRITE", f"mirror/={target}{tmp_path}/")
    rewritten = gopen_module.rewrite_url("mirror/s.tar")
    assert isinstance(rewritten, UntrustedURL)
    with pytest.raises(SecurityError, match="WDS_ALLOW_UNTRUSTED_PIPES"):
        wds.gopen("mirror/s.tar")
    monkeypatch.setenv("WDS_ALLOW_UNTRUSTED_PIPES", "1")
    with wds.gopen("mirror/s.tar") as stream:
        assert stream.read() == path.read_bytes()


def test_the_untrusted_mark_survives_rewriting(monkeypatch):
    """An untrusted URL (from a spec) stays untrusted after a rewrite rule maps it."""
    monkeypatch.setenv("WDS_REWRITE", "pipe:echo=pipe:cat")
    assert isinstance(gopen_module.rewrite_url(untrusted("pipe:echo x")), UntrustedURL)


class Recorder(http.server.BaseHTTPRequestHandler):
    """Answers by the server's ``routes``: a path -> (status, headers); records each request's headers."""

    def do_GET(self):
        self.server.seen.append((self.path, dict(self.headers)))
        status, headers = self.server.routes.get(self.path, (200, {"Content-Length": "2"}))
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if status == 200:
            self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


@pytest.fixture
def servers():
    made = []

    def start(routes):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
        server.routes, server.seen = routes, []
        threading.Thread(target=server.serve_forever, daemon=True).start()
        made.append(server)
        return server

    yield start
    for server in made:
        server.shutdown()
        server.server_close()


def test_a_redirect_to_pipe_or_file_is_refused_once(servers):
    """A redirect to pipe: or file: is a SecurityError at the first answer, never retried."""
    for location in ("pipe:touch /tmp/owned", "file:///etc/passwd"):
        server = servers({"/x.tar": (302, {"Location": location, "Content-Length": "0"})})
        with pytest.raises(SecurityError, match="not an http"):
            wds.gopen(f"http://127.0.0.1:{server.server_port}/x.tar").read()
        assert len(server.seen) == 1


def test_credentials_do_not_follow_a_redirect_to_another_host(servers):
    """Authorization goes to the host it was given for, not to where a redirect points."""
    other = servers({})
    first = servers(
        {
            "/x.tar": (302, {"Location": f"http://127.0.0.1:{other.server_port}/y.tar", "Content-Length": "0"}),
            "/same.tar": (302, {"Location": "/z.tar", "Content-Length": "0"}),
        }
    )
    options = {"headers": {"Authorization": "Bearer SECRET", "X-Api-Key": "SECRET"}}
    with wds.gopen(f"http://127.0.0.1:{first.server_port}/x.tar", storage_options=options) as stream:
        assert stream.read() == b"ok"
    assert first.seen[0][1].get("Authorization") == "Bearer SECRET"
    assert "Authorization" not in other.seen[0][1] and "X-Api-Key" not in other.seen[0][1]
    with wds.gopen(f"http://127.0.0.1:{first.server_port}/same.tar", storage_options=options) as stream:
        assert stream.read() == b"ok"
    assert first.seen[-1][0] == "/z.tar" and first.seen[-1][1].get("Authorization") == "Bearer SECRET"


def test_a_gcs_write_with_rejected_credentials_fails_at_once(servers):
    """GCS answering 401 fails a write with CredentialsError at the first answer (gcsfs would retry six times)."""
    pytest.importorskip("gcsfs")
    from wds_cloud.errors import CredentialsError

    refusing = servers({})
    refusing.routes = RefuseAll()
    with pytest.raises(CredentialsError):
        with wds.gopen(
            "gs://bucket/out.tar",
            "wb",
            storage_options={"endpoint_url": f"http://127.0.0.1:{refusing.server_port}", "token": "anon"},
        ) as out:
            out.write(b"x" * 100)
    assert len(refusing.seen) == 1


class RefuseAll(dict):
    """Routes that answer 401 to every path."""

    def get(self, path, default=None):
        return (401, {"Content-Length": "0"})


@pytest.mark.parametrize("scheme", ["s3", "gs", "az", "ais", "https"])
def test_relative_names_in_a_remote_file_resolve_in_its_folder_for_every_scheme(scheme):
    """A description, spec or index in a bucket may name its shards relative to itself (urllib's urljoin
    knows only some schemes: it turned s3://b/d/ + a.tar into a bare a.tar, refused as leaving the folder)."""
    from wds_cloud.io.security import resolve

    origin = f"{scheme}://bucket/dir/dataset.json"
    assert resolve("a.tar", origin) == f"{scheme}://bucket/dir/a.tar"
    assert resolve("sub/./b.tar", origin) == f"{scheme}://bucket/dir/sub/b.tar"
    for climbing in ("../x.tar", "sub/../../x.tar", "/etc/passwd"):
        with pytest.raises(SecurityError, match="leaves|names a file of this machine"):
            resolve(climbing, origin)


def test_a_wids_description_in_a_bucket_mirrored_by_a_rewrite_reads_its_relative_shards(tmp_path, monkeypatch):
    """WDS_REWRITE mapping a bucket to a local mirror: a description there names its shards relative to itself."""
    import json

    for name in ("a", "b"):
        with wds.TarWriter(str(tmp_path / f"{name}.tar")) as sink:
            for i in range(4):
                sink.write({"__key__": f"{name}{i}", "txt": "x"})
    (tmp_path / "d.json").write_text(
        json.dumps({"wids_version": 1, "shardlist": [{"url": "a.tar", "nsamples": 4}, {"url": "b.tar", "nsamples": 4}]})
    )
    monkeypatch.setenv("WDS_REWRITE", f"s3://bucket/={tmp_path}/")
    dataset = wds.ShardListDataset("s3://bucket/d.json")
    assert len(dataset) == 8 and dataset[5]["__key__"] == "b1"


# Containment decided on what the server sees (issue 41): a relative name is decoded as the server will decode it


class DecodingWebServer(HTTPObjectHandler):
    """A web server as many are: it percent-decodes the path (again, as a proxy in front decodes once more),
    takes a backslash for a separator and resolves dot segments, so ``/data/%2e%2e/x`` answers ``/x``."""

    def _key(self):
        path = urllib.parse.urlsplit(self.path).path
        while urllib.parse.unquote(path) != path:
            path = urllib.parse.unquote(path)
        return posixpath.normpath(path.replace("\\", "/"))


CLIMBING = [
    "%2e%2e/private/secret.tar",
    "%2E%2e/private/secret.tar",
    ".%2e/private/secret.tar",
    "%2e./private/secret.tar",
    "..%2fprivate%2fsecret.tar",
    "..%2Fprivate/secret.tar",
    "sub%2f..%2f..%2fprivate%2fsecret.tar",
    "%252e%252e/private/secret.tar",
    "%252e%252e%252fprivate%252fsecret.tar",
    "..\\private\\secret.tar",
    "..%5cprivate%5csecret.tar",
    "%5c%5cotherhost/private/secret.tar",
    "%2f%2fotherhost/private/secret.tar",
    "%2fprivate/secret.tar",
    "ok%00.tar",
    "ok%0a.tar",
]


@pytest.fixture
def decoding_server():
    store = Store()
    server = Server(type("Handler", (DecodingWebServer,), {"store": store}))
    store.put("/private/secret.tar", tar_bytes("secret"))
    store.put("/data/a b.tar", tar_bytes("inside"))
    yield server, store
    server.stop()


def tar_bytes(key):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(f"{key}.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    return buf.getvalue()


def never_asked_for_the_secret(store):
    assert not [r for r in store.requests if "private" in r[1] or "otherhost" in r[1]], store.requests


@pytest.mark.parametrize("name", CLIMBING)
def test_a_wids_description_cannot_climb_in_another_spelling(decoding_server, name):
    """A wids description in /data/ naming a shard in an encoded spelling of '..', a separator or a backslash is
    refused with SecurityError naming the file and the field; the server is never asked for /private/."""
    server, store = decoding_server
    store.put("/data/d.json", json.dumps({"wids_version": 1, "shardlist": [{"url": name, "nsamples": 1}]}).encode())
    with pytest.raises(SecurityError) as info:
        wds.ShardListDataset(f"{server.url}/data/d.json", transformations=[])[0]
    assert "d.json" in str(info.value) and "url" in str(info.value)
    never_asked_for_the_secret(store)


@pytest.mark.parametrize("name", CLIMBING)
def test_a_json_shard_list_cannot_climb_in_another_spelling(decoding_server, name):
    """A JSON shard list served from /data/ (and a wids index read by WebDataset) refuses the same spellings."""
    server, store = decoding_server
    store.put("/data/list.json", json.dumps([name]).encode())
    store.put("/data/index.json", json.dumps({"shardlist": [{"url": name, "nsamples": 1}]}).encode())
    for source in ("list.json", "index.json"):
        with pytest.raises(SecurityError) as info:
            list(wds.WebDataset(f"{server.url}/data/{source}", shardshuffle=False))
        assert source in str(info.value)
    never_asked_for_the_secret(store)


def test_an_encoded_name_that_stays_inside_is_read(decoding_server):
    """A name the server decodes to a file inside the folder (a space, an encoded dot that climbs nowhere) reads."""
    server, store = decoding_server
    store.put(
        "/data/d.json", json.dumps({"wids_version": 1, "shardlist": [{"url": "a%20b.tar", "nsamples": 1}]}).encode()
    )
    assert wds.ShardListDataset(f"{server.url}/data/d.json", transformations=[])[0]["__key__"] == "inside"
    store.put("/data/list.json", json.dumps(["sub/%2e%2e/a%20b.tar"]).encode())
    assert [s["__key__"] for s in wds.WebDataset(f"{server.url}/data/list.json", shardshuffle=False)] == ["inside"]


@pytest.mark.parametrize("scheme", ["s3", "gs", "az", "ais", "https", "file"])
@pytest.mark.parametrize("name", CLIMBING + ["..", "sub/../..", "a/" + "%2e%2e/" * 3 + "x.tar"])
def test_every_scheme_decides_containment_after_decoding(scheme, name):
    """resolve() percent-decodes a relative name until it is stable before the folder check, for every scheme, and
    refuses names that decode to a separator, a NUL or a control character."""
    from wds_cloud.io.security import resolve

    origin = f"{scheme}://bucket/dir/dataset.json" if scheme != "file" else "/srv/data/dir/dataset.json"
    with pytest.raises(SecurityError, match="dataset.json"):
        resolve(name, origin, field="shardlist[0].url")


@pytest.mark.parametrize("scheme", ["s3", "https", "file"])
def test_a_base_in_another_spelling_cannot_climb(scheme):
    """A 'base' read from a file is resolved and decoded as a name is: an encoded '..' in it is refused."""
    from wds_cloud.io.security import resolve_base

    origin = f"{scheme}://bucket/dir/dataset.json" if scheme != "file" else "/srv/data/dir/dataset.json"
    for base in ("%2e%2e/", "..%2f", "sub%2f%2e%2e%2f%2e%2e"):
        with pytest.raises(SecurityError, match="leaves|separator"):
            resolve_base(base, origin)


def test_an_absurdly_long_name_is_refused():
    """A name far longer than any server takes is refused as malformed data, naming the file and field."""
    from wds_cloud.io.security import resolve

    with pytest.raises(ValueError, match="dataset.json.*shardlist\\[0\\].url|longer"):
        resolve("a" * 100_000 + ".tar", "https://bucket/dir/dataset.json", field="shardlist[0].url")


def test_an_mmc4_image_name_in_another_spelling_stays_in_its_folder(tmp_path):
    """confined(): the images folder's names are decoded before the check too (a file named '%2e%2e' is refused
    rather than guessed at)."""
    from wds_cloud.io.security import confined

    (tmp_path / "images").mkdir()
    for name in ("%2e%2e/secret.jpg", "..%2fsecret.jpg", "..\\secret.jpg", "a%00.jpg"):
        with pytest.raises(SecurityError, match="image_name"):
            confined(str(tmp_path / "images"), name, "docs.jsonl line 1", "image_info[].image_name")


def test_a_data_file_named_without_a_folder_confines_its_names_to_the_working_folder(tmp_path, monkeypatch):
    """A description or shard list given as a bare name (``d.json``) is in ./: its names may not climb out of it
    either, in any spelling (they were not checked at all)."""
    from wds_cloud.io.security import resolve

    monkeypatch.chdir(tmp_path)
    assert resolve("a.tar", "d.json") == "a.tar" and resolve("sub/a.tar", "list.json") == "sub/a.tar"
    for name in ("../x.tar", "%2e%2e/x.tar", "..%2fx.tar", "sub/../../x.tar"):
        with pytest.raises(SecurityError, match="d.json"):
            resolve(name, "d.json")
    (tmp_path / "list.json").write_text(json.dumps(["%2e%2e/private/secret.tar"]))
    with pytest.raises(SecurityError, match="list.json"):
        list(wds.WebDataset("list.json", shardshuffle=False))


def test_a_local_name_leaving_its_folder_through_a_link_is_refused_however_often_the_folder_is_read(tmp_path):
    """Links out of a description's folder are refused for a name, its last part and a sub-folder, also after the
    folder's real path was remembered and a sub-folder was then replaced by a link (checked by inode)."""
    import os

    from wds_cloud.io import security

    outside = tmp_path / "outside"
    outside.mkdir()
    folder = tmp_path / "data"
    (folder / "sub").mkdir(parents=True)
    origin = str(folder / "d.json")
    assert security.resolve("a.tar", origin) == str(folder / "a.tar")
    assert security.resolve("sub/b.tar", origin) == str(folder / "sub" / "b.tar")
    (folder / "c.tar").symlink_to(outside / "c.tar")
    with pytest.raises(SecurityError):
        security.resolve("c.tar", origin)
    (folder / "sub").rmdir()
    (folder / "sub").symlink_to(outside)  # the sub-folder remembered above is now a link out
    with pytest.raises(SecurityError):
        security.resolve("sub/b.tar", origin)
    os.unlink(folder / "sub")
    (folder / "inside").mkdir()
    (folder / "sub").symlink_to(folder / "inside")  # a link that stays inside is followed
    assert security.resolve("sub/b.tar", origin) == str(folder / "sub" / "b.tar")
