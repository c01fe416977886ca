"""Commands and credentials the user did not allow: specs are data, rewrites keep the mark, redirects are checked."""

import http.server
import importlib
import io
import tarfile
import threading

import pytest

import wds_cloud as wds
from wds_cloud.errors import SecurityError
from wds_cloud.io import UntrustedURL, untrusted

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
