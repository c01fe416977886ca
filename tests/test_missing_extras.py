"""Every scheme whose extra is missing says which extra to install, for reads, writes and listings."""

import subprocess
import sys

import pytest

SCRIPT = r"""
import sys
for name in {blocked!r}:
    sys.modules[name] = None  # makes 'import name' fail as if the package were not installed
import wds_cloud as wds
from wds_cloud.errors import MissingExtraError
url = {url!r}
for action in ("read", "write"):
    try:
        if action == "read":
            wds.gopen(url).read(1)
        else:
            with wds.gopen(url, "wb") as out:
                out.write(b"x")
    except MissingExtraError as exc:
        print(action, "MissingExtraError", exc)
    except BaseException as exc:
        print(action, "OTHER", type(exc).__name__, exc)
"""

CASES = [
    ("s3://bucket/x.tar", ["s3fs", "botocore", "aiobotocore", "boto3"], "wds_cloud[s3]"),
    ("gs://bucket/x.tar", ["gcsfs"], "wds_cloud[gs]"),
    ("gcs://bucket/x.tar", ["gcsfs"], "wds_cloud[gs]"),
    ("az://container/x.tar", ["adlfs"], "wds_cloud[az]"),
    ("abfs://container/x.tar", ["adlfs"], "wds_cloud[az]"),
]


@pytest.mark.parametrize("url,blocked,hint", CASES, ids=[c[0].split(":")[0] for c in CASES])
def test_a_missing_extra_is_named(url, blocked, hint):
    """Without its packages a scheme raises MissingExtraError with the pip install line, not an import error."""
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(blocked=blocked, url=url)], capture_output=True, text=True, timeout=300
    )
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout + out.stderr
    for line in lines:
        assert "MissingExtraError" in line and hint in line, line
