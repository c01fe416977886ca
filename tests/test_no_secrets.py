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
