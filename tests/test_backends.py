"""Every backend against a real server on loopback, through the shared conformance suite, and more."""

import os
import subprocess
import sys

import pytest

import wds_cloud as wds
from wds_cloud.errors import CredentialsError, MissingExtraError, ShardNotFoundError, TransferError
from wds_cloud.gopen import gopen, open_backend
from wds_cloud.testing.conformance import BackendConformance
from wds_cloud.writer import TarWriter

from .cloud import AIS_TOKEN, HTTP_TOKEN, free_port, unique


class TestFile(BackendConformance):
    @pytest.fixture
    def base_url(self, tmp_path):
        return f"{tmp_path}/"


class TestFileURL(BackendConformance):
    @pytest.fixture
    def base_url(self, tmp_path):
        return f"file://{tmp_path}/"


class TestHTTP(BackendConformance):
    @pytest.fixture
    def base_url(self, http_store):
        return f"{http_store[0].url}/{unique('p')}/"

    @pytest.fixture
    def storage_options(self):
        return {"headers": {"Authorization": f"Bearer {HTTP_TOKEN}"}}

    def bad_credentials(self, storage_options):
        return {"headers": {"Authorization": "Bearer wrong-token-123"}}

    @pytest.fixture
    def upstream(self, http_store):
        return http_store[0].url

    def route_through(self, proxy_url, base_url, storage_options):
        return base_url.replace(base_url.split("/")[2], proxy_url.split("/")[2]), storage_options


class TestS3(BackendConformance):
    throttle = (
        503,
        b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
        b"<Message>Please reduce your request rate.</Message></Error>",
    )

    @pytest.fixture
    def base_url(self, s3_bucket):
        return f"s3://{s3_bucket[0]}/prefix/"

    @pytest.fixture
    def storage_options(self, s3_bucket):
        return s3_bucket[1]

    def bad_credentials(self, storage_options):
        return {"endpoint_url": storage_options["endpoint_url"]}  # no credentials at all

    @pytest.fixture
    def upstream(self, moto_endpoint):
        return moto_endpoint

    def route_through(self, proxy_url, base_url, storage_options):
        return base_url, dict(storage_options, endpoint_url=proxy_url)


class TestGCS(BackendConformance):
    @pytest.fixture
    def base_url(self, gcs_bucket):
        return f"gs://{gcs_bucket[0]}/prefix/"

    @pytest.fixture
    def storage_options(self, gcs_bucket):
        return gcs_bucket[1]

    @pytest.fixture
    def upstream(self, gcs_endpoint):
        return gcs_endpoint

    def route_through(self, proxy_url, base_url, storage_options):
        return base_url, dict(storage_options, endpoint_url=proxy_url)


class TestAzure(BackendConformance):
    @pytest.fixture
    def base_url(self, az_container):
        return f"az://{az_container[0]}/prefix/"

    @pytest.fixture
    def storage_options(self, az_container):
        return az_container[1]

    def bad_credentials(self, storage_options):
        wrong = storage_options["connection_string"].replace("AccountKey=Eby8", "AccountKey=AAAA")
        return {"connection_string": wrong}

    @pytest.fixture
    def upstream(self, azurite_endpoint):
        return azurite_endpoint[0]

    def route_through(self, proxy_url, base_url, storage_options):
        connection = storage_options["connection_string"]
        endpoint = connection.split("BlobEndpoint=")[1].split("/devstoreaccount1")[0]
        return base_url, {"connection_string": connection.replace(endpoint, proxy_url)}


class TestAIS(BackendConformance):
    @pytest.fixture
    def base_url(self, ais_servers, monkeypatch):
        gateway, _, _, buckets = ais_servers
        bucket = unique("ais")
        buckets.add(("ais", bucket))
        monkeypatch.setenv("AIS_ENDPOINT", gateway.url)
        return f"ais://{bucket}/prefix/"

    @pytest.fixture
    def storage_options(self):
        return {"token": AIS_TOKEN}

    def bad_credentials(self, storage_options):
        return {"token": "wrong-token-456"}

    @pytest.fixture
    def upstream(self, ais_servers):
        """Faults go on the target (where the data flows); the gateway redirects through the proxy."""
        gateway, target, _, _ = ais_servers
        handler = gateway.httpd.RequestHandlerClass
        yield target.url
        handler.target = target.url

    def route_through(self, proxy_url, base_url, storage_options):
        import gc

        from .servers import AISGatewayHandler

        for cls in AISGatewayHandler.__subclasses__():
            cls.target = proxy_url
        gc.collect()
        return base_url, storage_options


class TestThirdPartyPlugin(BackendConformance):
    """The docs example plugin passes the same suite."""

    @pytest.fixture
    def base_url(self, installed_example):
        return f"mem://{unique('b')}/"


def tiny_shard(n=3) -> bytes:
    import io

    out = io.BytesIO()
    with TarWriter(out) as writer:
        for i in range(n):
            writer.write({"__key__": f"{i:03d}", "txt": f"t{i}"})
    return out.getvalue()


def test_use_ais_for_routes_cloud_schemes_through_the_gateway(ais_servers, monkeypatch):
    """USE_AIS_FOR=s3:gs sends s3:// and gs:// reads to AIStore with provider=aws / gcp."""
    gateway, _, store, buckets = ais_servers
    buckets.update({("aws", "cloudbkt"), ("gcp", "gbkt")})
    store.put("aws/cloudbkt/data/shard.tar", tiny_shard())
    store.put("gcp/gbkt/shard.tar", tiny_shard(2))
    monkeypatch.setenv("AIS_ENDPOINT", gateway.url)
    monkeypatch.setenv("AIS_AUTHN_TOKEN", AIS_TOKEN)
    monkeypatch.setenv("USE_AIS_FOR", "s3:gs")
    samples = list(wds.WebDataset("s3://cloudbkt/data/shard.tar", shardshuffle=False))
    assert [s["__key__"] for s in samples] == ["000", "001", "002"]
    assert samples[0]["__url__"] == "s3://cloudbkt/data/shard.tar"
    assert len(list(wds.WebDataset("gs://gbkt/shard.tar", shardshuffle=False))) == 2
    assert any(method == "GET" and key == "aws/cloudbkt/data/shard.tar" for method, key, _ in store.requests)


def test_ais_without_endpoint_says_what_to_set(monkeypatch):
    """An ais:// URL without AIS_ENDPOINT names the variable."""
    with pytest.raises(ValueError, match="set AIS_ENDPOINT"):
        gopen("ais://bucket/x.tar")


def test_missing_ais_bucket(ais_servers, monkeypatch):
    """A missing AIS bucket is a ShardNotFoundError naming the URL."""
    monkeypatch.setenv("AIS_ENDPOINT", ais_servers[0].url)
    with pytest.raises(ShardNotFoundError, match="ais://nobucket/x.tar"):
        gopen("ais://nobucket/x.tar", storage_options={"token": AIS_TOKEN})


def test_connection_refused_is_a_connection_error():
    """A refused connection raises TransferError (a ConnectionError) naming the endpoint, not 'not found'."""
    port = free_port()
    with pytest.raises(ConnectionError) as info:
        gopen(f"http://127.0.0.1:{port}/shard.tar")
    assert isinstance(info.value, TransferError) and f"127.0.0.1:{port}" in str(info.value)
    assert not isinstance(info.value, FileNotFoundError)


def test_s3_dead_endpoint_is_a_connection_error():
    """An S3 endpoint that is not there gives TransferError, naming endpoint_url."""
    options = {
        "key": "k",
        "secret": "s",
        "endpoint_url": f"http://127.0.0.1:{free_port()}",
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2},
    }
    with pytest.raises(TransferError, match="endpoint_url"):
        gopen("s3://bucket/x.tar", storage_options=options)


def test_s3_standard_environment(s3_bucket, monkeypatch):
    """With no storage options, AWS_ENDPOINT_URL and the AWS_* keys configure s3:// (S3-compatible stores)."""
    bucket, options = s3_bucket
    with gopen(f"s3://{bucket}/env.tar", "wb", storage_options=options) as f:
        f.write(tiny_shard())
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    assert len(list(wds.WebDataset(f"s3://{bucket}/env.tar", shardshuffle=False))) == 3


def test_missing_s3_credentials_name_the_settings(s3_bucket):
    """No AWS credentials: the error names the variables and options to set, and no secret."""
    bucket, options = s3_bucket
    with pytest.raises(CredentialsError, match="AWS_ACCESS_KEY_ID.*AWS_PROFILE"):
        gopen(f"s3://{bucket}/x.tar", storage_options={"endpoint_url": options["endpoint_url"]})


def test_gcs_emulator_environment(gcs_bucket, monkeypatch):
    """STORAGE_EMULATOR_HOST points gs:// at an emulator without storage options."""
    bucket, options = gcs_bucket
    with gopen(f"gs://{bucket}/env.tar", "wb", storage_options=options) as f:
        f.write(tiny_shard())
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", options["endpoint_url"])
    assert (
        len(list(wds.WebDataset(f"gs://{bucket}/env.tar", shardshuffle=False, storage_options={"token": "anon"}))) == 3
    )


def test_azure_connection_string_environment(az_container, monkeypatch):
    """AZURE_STORAGE_CONNECTION_STRING configures az:// and abfs:// without storage options."""
    container, options = az_container
    with gopen(f"az://{container}/env.tar", "wb", storage_options=options) as f:
        f.write(tiny_shard())
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", options["connection_string"])
    assert len(list(wds.WebDataset(f"abfs://{container}/env.tar", shardshuffle=False))) == 3


def test_per_bucket_profiles(s3_bucket, tmp_path, monkeypatch):
    """Profiles from WDS_CLOUD_CONFIG give each bucket its endpoint and credentials; the longest prefix wins."""
    bucket, options = s3_bucket
    with gopen(f"s3://{bucket}/p.tar", "wb", storage_options=options) as f:
        f.write(tiny_shard())
    config = tmp_path / "profiles.toml"
    config.write_text(f'''
["s3://"]
endpoint_url = "http://127.0.0.1:1"
key = "wrong"
secret = "wrong"

["s3://{bucket}/"]
endpoint_url = "{options["endpoint_url"]}"
key = "testing"
secret = "testing"
''')
    monkeypatch.setenv("WDS_CLOUD_CONFIG", str(config))
    assert len(list(wds.WebDataset(f"s3://{bucket}/p.tar", shardshuffle=False))) == 3


def test_bad_profiles_file(tmp_path, monkeypatch):
    """A malformed profiles file is a ConfigError naming the file and the expected form."""
    config = tmp_path / "profiles.toml"
    config.write_text("this is = = not toml")
    monkeypatch.setenv("WDS_CLOUD_CONFIG", str(config))
    with pytest.raises(ValueError, match="profiles.toml.*TOML table per URL prefix"):
        gopen("s3://bucket/x.tar")


def test_credentials_never_in_reprs_or_errors(az_container):
    """Backends' reprs and errors never show keys or connection strings."""
    container, options = az_container
    backend = open_backend(f"az://{container}/x", storage_options=options)
    assert "AccountKey" not in repr(backend) and "Eby8" not in repr(backend)
    with pytest.raises(ShardNotFoundError) as info:
        gopen(f"az://{container}/missing.tar", storage_options=options)
    assert "Eby8" not in str(info.value)
    settings = wds.Settings.from_environ({"AIS_AUTHN_TOKEN": "sekret-token"})
    assert "sekret" not in repr(settings)


def test_missing_extra_names_the_install_line(monkeypatch):
    """Without s3fs, s3:// fails at open time with the pip install line; the plugin still imports."""
    monkeypatch.setitem(sys.modules, "s3fs", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'wds_cloud\[s3\]'"):
        gopen("s3://bucket/x.tar", storage_options={"key": "k", "secret": "s"})


def test_backends_command_lists_every_scheme_ready():
    """`wds-cloud backends` shows every built-in scheme, ready once its extra is installed."""
    script = os.path.join(os.path.dirname(sys.executable), "wds-cloud")
    out = subprocess.run([script, "backends"], capture_output=True, text=True, check=True).stdout
    for scheme in ("file", "pipe", "http", "https", "s3", "gs", "gcs", "az", "abfs", "ais"):
        line = next(line for line in out.splitlines() if line.startswith(f"{scheme}:"))
        assert line.rstrip().endswith("ready"), line


def test_use_ais_for_naming_a_scheme_aistore_cannot_proxy_is_a_config_error(monkeypatch):
    """USE_AIS_FOR=s3:ftp fails on open with a ConfigError naming 'ftp' and the schemes it may list."""
    from wds_cloud.errors import ConfigError

    monkeypatch.setenv("USE_AIS_FOR", "s3:ftp")
    with pytest.raises(ConfigError, match="ftp") as info:
        gopen("s3://bucket/object.tar")
    assert "gs" in str(info.value)


@pytest.mark.parametrize(
    "options, env, bucket, key",
    [
        (
            {"key": "AKIDEXAMPLE", "secret": "s3cr3t", "endpoint_url": "http://127.0.0.1:9000"},
            {},
            "bench",
            "a/b c+d~é.tar",
        ),
        (
            {
                "key": "AKIDEXAMPLE",
                "secret": "s3cr3t",
                "token": "tok",
                "client_kwargs": {"endpoint_url": "https://minio.local:9000/base/", "region_name": "eu-west-1"},
            },
            {},
            "Up_per",
            "x//y.tar",
        ),
        (
            {},
            {"AWS_ACCESS_KEY_ID": "AKIDENV", "AWS_SECRET_ACCESS_KEY": "envsecret", "AWS_DEFAULT_REGION": "us-west-2"},
            "my-bucket",
            "shards/train-000001.tar",
        ),
        ({"key": "AKIDEXAMPLE", "secret": "s3cr3t"}, {"AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9"}, "b.with.dots", "k"),
        ({"anon": True, "client_kwargs": {"region_name": "us-east-1"}}, {}, "public-data", "x y.tar"),
    ],
)
def test_s3_urls_signed_without_a_client_equal_botocores(options, env, bucket, key, monkeypatch):
    """The GET URL presigned without a botocore client (no service model to parse) is the client's SigV4 URL."""
    import datetime

    import botocore.auth

    from plugins.s3 import S3Backend
    from wds_cloud.config import current

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    frozen = datetime.datetime(2026, 11, 24, 1, 2, 3)
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda *a, **k: frozen)
    backend = S3Backend(current(), **options)
    ours = backend.signer.presign(bucket, key)
    assert ours is not None
    # SigV4 always (botocore's client still presigns with SigV2 at a custom endpoint in us-east-1; Cloudflare R2
    # and AWS regions opened since 2014 accept only SigV4)
    if not options.get("anon"):
        options = dict(options, config_kwargs={"signature_version": "s3v4"})
        backend = S3Backend(current(), **options)
    theirs = backend.client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=3600)
    assert ours == theirs


@pytest.mark.parametrize(
    "options, env, bucket",
    [
        ({"config_kwargs": {"s3": {"use_accelerate_endpoint": True}}}, {}, "my-bucket"),
        ({"config_kwargs": {"s3": {"addressing_style": "virtual"}}, "endpoint_url": "http://127.0.0.1:9"}, {}, "b"),
        ({"client_kwargs": {"region_name": "cn-north-1"}}, {}, "my-bucket"),
        ({"client_kwargs": {"region_name": "us-west-2"}}, {"AWS_USE_FIPS_ENDPOINT": "true"}, "my-bucket"),
        ({"client_kwargs": {"region_name": "us-west-2"}}, {}, "Not_DNS"),
        ({"client_kwargs": {"region_name": "us-west-2"}}, {}, "arn:aws:s3:us-west-2:123456789012:accesspoint/ap"),
    ],
)
def test_s3_unusual_addressing_is_left_to_botocore(options, env, bucket, monkeypatch):
    """Accelerate, FIPS, other partitions, addressing settings, non-DNS buckets, ARNs: the client signs."""
    from plugins.s3 import S3Backend
    from wds_cloud.config import current

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDENV")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "envsecret")
    backend = S3Backend(current(), **options)
    assert backend.signer.presign(bucket, "k.tar") is None
    assert backend.presign(bucket, "k.tar").startswith(("https://", "http://"))


def test_a_local_read_at_an_offset_no_file_has_leaves_no_open_file(tmp_path):
    """A seek that fails (a negative offset, as a tampered state may give) closes the file it opened
    (it was left to the garbage collector: a ResourceWarning the state fuzz test met once)."""
    import gc
    import warnings

    from wds_cloud.gopen import gopen

    path = tmp_path / "s.tar"
    path.write_bytes(b"x" * 1024)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        for offset in (-5, 1 << 70):
            with pytest.raises((OSError, ValueError, OverflowError)):
                gopen(str(path), offset=offset)
            gc.collect()
