"""Planted secrets never reach logs, errors, saved states or the cache directory."""

import json
import logging
import os

import pytest

import wds_cloud as wds
from wds_cloud.errors import redact

from . import servers
from .hostile import tar_of

TOKEN = "TOKENsecret123"
SIG = "SIGsecret456"
PASSWORD = "p@ss:word789"
SECRETS = [TOKEN, SIG, "secret456", "word789"]


def shard_bytes(n=20):
    return tar_of([(f"k{i:03d}", {"txt": f"sample {i}".encode()}) for i in range(n)])


def test_redact_covers_tokens_passwords_and_signatures():
    """redact(): a lone token as userinfo, passwords holding '@' and ':', and signed-query keys."""
    assert redact(f"https://{TOKEN}@host/x.tar") == "https://***@host/x.tar"
    assert redact(f"https://user:{PASSWORD}@host/x.tar") == "https://user:***@host/x.tar"
    assert (
        redact(f"http://h/x.tar?AWSAccessKeyId=AKIA1&Signature={SIG}&Expires=1")
        == "http://h/x.tar?AWSAccessKeyId=***&Signature=***&Expires=1"
    )
    assert redact(f"GET /x?sv=2020-01-01&sig={SIG} HTTP") == "GET /x?sv=***&sig=*** HTTP"


def scan(texts):
    found = [(secret, text[:200]) for text in texts for secret in SECRETS if secret in text]
    assert not found, found


def test_a_full_run_leaks_no_secret(tmp_path, caplog):
    """Reading through the cache with verbose logging, saving a state and meeting errors: no secret anywhere."""
    server, store = servers.http_server()
    try:
        store.put("/data/train-0.tar", shard_bytes())
        store.put("/data/train-1.tar", shard_bytes())
        base = server.url.replace("http://", f"http://{TOKEN}@") + "/data"
        urls = [f"{base}/train-{i}.tar?sig={SIG}" for i in range(2)]
        cache_dir = tmp_path / "cache"
        texts = []
        with caplog.at_level(logging.DEBUG, logger="wds_cloud"):
            os.environ["GOPEN_VERBOSE"] = "1"
            try:
                ds = wds.WebDataset(urls, shardshuffle=False, cache_dir=str(cache_dir), verbose=True).shuffle(5, seed=1)
                it = iter(ds)
                for _ in range(7):
                    next(it)
                texts.append(json.dumps(ds.state_dict()))
                rest = list(it)
                assert len(rest) == 33
                for bad in (
                    f"{base}/missing.tar?sig={SIG}",
                    f"nope://user:{PASSWORD}@h/x?token={TOKEN}",
                    f"http://{TOKEN}@127.0.0.1:9/x.tar?sig={SIG}",
                ):
                    with pytest.raises(Exception) as info:
                        wds.gopen(bad, retries=1).read()
                    texts.append(str(info.value))
                    texts.append(repr(info.value))
                with pytest.raises(ValueError) as info:
                    wds.gopen(
                        f"{server.url}/x.tar",
                        storage_options={"headers": {"Authorization": f"Bearer {TOKEN}\n"}},
                        retries=1,
                    ).read()
                texts.append(str(info.value))
            finally:
                del os.environ["GOPEN_VERBOSE"]
        texts.extend(record.getMessage() for record in caplog.records)
        for root, _, names in os.walk(cache_dir):
            for name in names:
                texts.append(name)
                with open(os.path.join(root, name), "rb") as f:
                    if name.endswith(".meta"):
                        texts.append(f.read().decode("utf-8", "replace"))
        scan(texts)
        assert texts and any("***" in t for t in texts)
    finally:
        server.stop()


# Credentials in every spelling (issue 41): one list of names, used by redact() and by every check that refuses
# secrets in URLs.  VALUE is the secret; it must appear nowhere.
VALUE = "Vsecret42xyz"
CREDENTIAL_NAMES = [
    "token",
    "access_token",
    "private_token",
    "auth_token",
    "X-Auth-Token",
    "x-auth-token",
    "X_AUTH_TOKEN",
    "authToken",
    "X%2DAuth%2DToken",
    "X%252DAuth%252DToken",
    "%58-Auth-Token",
    "X-Amz-Signature",
    "X-Amz-Security-Token",
    "X-Amz-Credential",
    "X-Goog-Signature",
    "X-Goog-Credential",
    "AWSAccessKeyId",
    "GoogleAccessId",
    "sig",
    "Signature",
    "key",
    "api_key",
    "apikey",
    "ApiKey",
    "x-api-key",
    "access_key",
    "accessKey",
    "secret",
    "client_secret",
    "password",
    "passwd",
    "pwd",
    "session",
    "sessionid",
    "JSESSIONID",
    "authorization",
    "oauth_verifier",
    "credential",
    "sas_token",
    "jwt",
]
HARMLESS_NAMES = [
    "keyframe",
    "keys",
    "author",
    "authority",
    "signal",
    "signed",
    "design",
    "page",
    "sp",
    "X-Amz-Date",
    "X-Amz-Expires",
    "X-Amz-SignedHeaders",
    "versionId",
]


@pytest.mark.parametrize("name", CREDENTIAL_NAMES)
def test_redact_knows_every_spelling_of_a_credential_parameter(name):
    """A query (or fragment) parameter whose name, decoded and in any case, holds token, auth, key, sig, signature,
    credential, password, secret or session has its value removed, wherever it stands in the text."""
    for url in (
        f"https://h/d/x.tar?{name}={VALUE}",
        f"https://h/d/x.tar?n=1&{name}={VALUE}&m=2",
        f"https://h/d/x.tar;{name}={VALUE}",
        f"https://h/cb#{name}={VALUE}",
        f"https://h/d/x.tar?{name}%3D{VALUE}",
        f"opening 'https://h/d/x.tar?{name}={VALUE}' failed",
    ):
        shown = redact(url)
        assert VALUE not in shown and "***" in shown, (url, shown)
    assert redact(f"https://h/d/x.tar?n=1&{name}={VALUE}&m=2").endswith("&m=2")


@pytest.mark.parametrize("name", HARMLESS_NAMES)
def test_redact_keeps_parameters_that_are_not_credentials(name):
    """Names that only look alike (keyframe, author, signal, X-Amz-Date) keep their values: errors stay useful."""
    assert redact(f"https://h/d/x.tar?{name}=12") == f"https://h/d/x.tar?{name}=12"


@pytest.mark.parametrize(
    "url",
    [
        f"s3://AKIAEXAMPLE:{VALUE}@bucket/x.tar",
        f"//user:{VALUE}@host/x.tar",
        f"https://us%40er:{VALUE}%40x@host/x.tar",
        f"https://{VALUE}@host/x.tar",
        f"pipe:curl -s -H 'X-Auth-Token: {VALUE}' https://h/x.tar",
        f'pipe:curl -s --header "Authorization: Bearer {VALUE}" https://h/x.tar',
        f"pipe:curl -s -H'PRIVATE-TOKEN:{VALUE}' https://h/x.tar",
    ],
)
def test_redact_removes_userinfo_and_header_values_in_commands(url):
    """Userinfo in any scheme (and scheme-relative), and credential headers a pipe: command sends."""
    shown = redact(url)
    assert VALUE not in shown and "***" in shown, shown


@pytest.mark.parametrize("name", ["private_token", "auth_token", "X-Auth-Token", "X%2DAuth%2DToken", "apikey"])
def test_map_shards_refuses_every_spelling_before_anything_runs(tmp_path, name):
    """map_shards refuses an input or destination carrying a credential (it would sit in the Dask task graph), with
    a message that does not show it, before a cluster starts or a job record is written."""
    pytest.importorskip("distributed")
    from wds_cloud.dask import map_shards
    from wds_cloud.errors import ConfigError

    for inputs, dest in (
        ([f"https://h.invalid/a.tar?{name}={VALUE}"], str(tmp_path / "out-%d.tar")),
        ([str(tmp_path / "a.tar")], f"https://h.invalid/out-%d.tar?{name}={VALUE}"),
        ([str(tmp_path / "a.tar")], f"https://h.invalid/out.tar?{name}={VALUE}"),
    ):
        with pytest.raises(ConfigError) as info:
            map_shards(lambda s: s, inputs, dest, client=object())
        assert VALUE not in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_job_records_keep_no_credential(tmp_path):
    """A job record lists its inputs redacted, whatever the credential's spelling; a destination carrying one is
    refused (its output names would be the record's keys)."""
    from wds_cloud.errors import ConfigError
    from wds_cloud.jobs.record import JobRecord

    inputs = [f"https://h.invalid/in-{i}.tar?{name}={VALUE}" for i, name in enumerate(CREDENTIAL_NAMES)]
    record = JobRecord(str(tmp_path / "out-%d.tar"), "reshard", inputs, {"maxcount": 2})
    record.begin()
    text = (tmp_path / "out-N.tar.wds-job.json").read_text()
    assert VALUE not in text and text.count("***") == len(inputs)
    with pytest.raises(ConfigError) as info:
        JobRecord(f"https://h.invalid/out-%d.tar?X-Auth-Token={VALUE}", "reshard", [str(tmp_path / "a.tar")], {})
    assert VALUE not in str(info.value)


def test_new_spellings_reach_no_state_log_or_error(tmp_path, caplog):
    """Shards whose URLs carry private_token, auth_token, X-Auth-Token (plain and encoded) and an api key: the
    dataset's and a RandomMix's states, the log records and the error messages never show the values."""
    server, store = servers.http_server()
    try:
        names = ["private_token", "auth_token", "X-Auth-Token", "X%2DAuth%2DToken", "apikey", "sig"]
        for i in range(len(names)):
            store.put(f"/data/train-{i}.tar", shard_bytes(5))
        urls = [f"{server.url}/data/train-{i}.tar?{name}={VALUE}" for i, name in enumerate(names)]
        texts = []
        with caplog.at_level(logging.DEBUG, logger="wds_cloud"):
            ds = wds.WebDataset(urls, shardshuffle=False).shuffle(4, seed=1)
            it = iter(ds)
            for _ in range(8):
                next(it)
            texts.append(json.dumps(ds.state_dict()))
            mix = wds.RandomMix(
                [wds.WebDataset(urls[:3], shardshuffle=False), wds.WebDataset(urls[3:], shardshuffle=False)], seed=3
            )
            mixed = iter(mix)
            for _ in range(7):
                next(mixed)
            if hasattr(mix, "state_dict"):
                texts.append(json.dumps(mix.state_dict()))
            for name in names:
                with pytest.raises(Exception) as info:
                    wds.gopen(f"{server.url}/data/missing.tar?{name}={VALUE}", retries=1).read()
                texts += [str(info.value), repr(info.value), repr(getattr(info.value, "url", ""))]
        texts.extend(record.getMessage() for record in caplog.records)
        found = [t[:200] for t in texts if VALUE in t]
        assert not found, found
    finally:
        server.stop()


# Credentials in pipe: commands and in URL spellings a browser or proxy reads leniently (adversary findings,
# issue 41): each is hidden by redact(), to the end of its shell word, and refused by map_shards before anything
# runs, with the refusal showing it as ***.
SECRET_COMMANDS = [
    f"pipe:wget -qO- --http-password={VALUE} http://h.invalid/x.tar",
    f"pipe:wget -qO- --http-password {VALUE} http://h.invalid/x.tar",
    f"pipe:curl -s --oauth2-bearer {VALUE} http://h.invalid/x.tar",
    f"pipe:curl -s --oauth2-bearer={VALUE} http://h.invalid/x.tar",
    f"pipe:curl -s -b session={VALUE} http://h.invalid/x.tar",
    f"pipe:curl -s -bsession={VALUE} http://h.invalid/x.tar",
    f"pipe:curl -sb session={VALUE} http://h.invalid/x.tar",
    f"pipe:curl -s --cookie 'sid=1; session={VALUE}' http://h.invalid/x.tar",
    f"pipe:curl -s --cookie=sid={VALUE} http://h.invalid/x.tar",
    f"pipe:env API_TOKEN={VALUE} curl -s http://h.invalid/x.tar",
    f"pipe:API_TOKEN={VALUE} curl -s http://h.invalid/x.tar",
    f"pipe:export AWS_SECRET_ACCESS_KEY={VALUE}; aws s3 cp s3://b/x.tar -",
    f"pipe:sh -c 'MY_PASSWORD={VALUE} fetch x.tar'",
    f"pipe:curl -s -HAuthorization:Bearer\\ {VALUE} http://h.invalid/x.tar",
    f"pipe:curl -s -H Authorization:Bearer\\ {VALUE} http://h.invalid/x.tar",
    f"pipe:curl -s --header=Cookie:a=b\\;session={VALUE} http://h.invalid/x.tar",
    f"pipe:curl -s -u user:pass\\ {VALUE} http://h.invalid/x.tar",
    f"pipe:curl -s -d password={VALUE} http://h.invalid/x.tar",
    f"pipe:curl -s --api-key '{VALUE} more' http://h.invalid/x.tar",
]
SECRET_URLS = [
    f"https:\\\\u:{VALUE}@h.invalid/x.tar",
    f"https:\\/u:{VALUE}@h.invalid/x.tar",
    f"https:///u:{VALUE}@h.invalid/x.tar",
    f"https:u:{VALUE}@h.invalid/x.tar",
    f"HTTPS:////{VALUE}@h.invalid/x.tar",
    f"s3:///KEY:{VALUE}@bucket/x.tar",
    f"http://h.invalid/x.tar?token\t={VALUE}",
    f"http://h.invalid/x.tar?token ={VALUE}",
    f"http://h.invalid/x.tar?\ttoken={VALUE}",
    f"http://h.invalid/x.tar?to\x00ken={VALUE}",
    f"http://h.invalid/x.tar?n=1&token=\t{VALUE}",
]
PLAIN_COMMANDS = [
    "pipe:curl -s -L http://h.invalid/x.tar",
    "pipe:wget -qO- http://h.invalid/x.tar",
    "pipe:curl -s --anyauth http://h.invalid/x.tar",
    "pipe:curl -s -b cookies.txt http://h.invalid/x.tar",
    "pipe:aws s3 cp s3://b/session=3/x.tar -",
    "pipe:ffmpeg -i in.mp4 -b:v 1M -f tar -",
    "pipe:env LANG=C curl -s http://h.invalid/x.tar?n=1&m=2",
    "sftp:user@h.invalid/x.tar",
]


@pytest.mark.parametrize("text", SECRET_COMMANDS + SECRET_URLS)
def test_redact_hides_credentials_in_commands_and_lenient_url_spellings(text):
    """Credential options (--opt=v, --opt v, -bv, -b v), environment assignments (env TOKEN=v cmd), header values
    to the end of the shell word, and userinfo or parameters hidden by backslashes, extra slashes, tabs or control
    characters: hidden whole, in the URL and in any message quoting it."""
    for shown in (redact(text), redact(f"opening {text} failed"), redact(f"opening '{text}' failed")):
        assert VALUE not in shown and "***" in shown, shown
        assert not any(part in shown for part in ("secret42", "Vsecret", "42xyz")), shown


@pytest.mark.parametrize("text", PLAIN_COMMANDS)
def test_redact_keeps_commands_that_hold_no_credential(text):
    """A flag taking no value (--anyauth), a cookie file (-b file), a partition path (session=3 inside a URL), a
    bitrate (-b:v) and a harmless variable stay as written: errors stay useful and map_shards accepts them."""
    assert redact(text) == text


@pytest.mark.parametrize("text", SECRET_COMMANDS[::3] + SECRET_URLS[::2])
def test_map_shards_refuses_credentials_in_commands_and_lenient_urls(tmp_path, text):
    """map_shards refuses an input whose command or lenient URL spelling carries a credential, before a cluster
    starts or a job record is written, and its message shows the value as ***."""
    pytest.importorskip("distributed")
    from wds_cloud.dask import map_shards
    from wds_cloud.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        map_shards(lambda s: s, [text], str(tmp_path / "out-%d.tar"), client=object())
    assert VALUE not in str(info.value) and "***" in str(info.value)
    assert list(tmp_path.iterdir()) == []
