"""docs/backends.md's examples run as they are, each against the emulator its section starts (the same
servers as the backend tests), with the endpoint in the variable the example reads."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

from .cloud import azurite_endpoint, gcs_endpoint, moto_endpoint, unique  # noqa: F401 (fixtures)

PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "backends.md"


def section_code(scheme: str) -> str:
    """The ```python blocks of the section whose title names ``scheme``."""
    text = PAGE.read_text()
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    (section,) = [s for s in sections if s.split("\n", 1)[0].count(scheme)]
    blocks = re.findall(r"^```python\n(.*?)^```", section, re.S | re.M)
    assert blocks, scheme
    return "\n\n".join(blocks)


def run(code: str, cwd: pathlib.Path, **env: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300, env={**os.environ, **env}
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_every_section_is_tested():
    titles = [line[3:] for line in PAGE.read_text().splitlines() if line.startswith("## ")]
    assert [t.split()[0].strip("`") for t in titles] == [
        "Local",
        "pipe:",
        "s3://",
        "gs://",
        "az://",
        "http(s)://",
        "ais://",
    ]


def test_local_files(tmp_path):
    assert run(section_code("Local files"), tmp_path).split() == ["30"]


def test_pipe(tmp_path):
    assert run(section_code("`pipe:`"), tmp_path).strip() == "from a pipe"


def test_s3_against_moto(tmp_path, moto_endpoint):  # noqa: F811
    assert run(section_code("s3://"), tmp_path, S3_ENDPOINT=moto_endpoint, S3_BUCKET=unique("doc")).split() == ["30"]


def test_gs_against_the_emulator(tmp_path, gcs_endpoint):  # noqa: F811
    assert run(section_code("gs://"), tmp_path, GCS_ENDPOINT=gcs_endpoint, GCS_BUCKET=unique("doc")).split() == ["30"]


def test_az_against_azurite(tmp_path, azurite_endpoint):  # noqa: F811
    endpoint, _ = azurite_endpoint
    assert run(section_code("az://"), tmp_path, AZ_ENDPOINT=endpoint, AZ_CONTAINER=unique("doc")).split() == ["30"]


def test_http(tmp_path):
    assert run(section_code("http(s)://"), tmp_path).split() == ["30"]


def extra_requirements(extra: str) -> list[str]:
    """What ``pip install -e '.[extra]'`` asks for: the extra's requirements, with the extras of
    ``wds_cloud[...]`` it names expanded."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    extras = tomllib.loads((PAGE.parent.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    out = []
    for requirement in extras[extra]:
        named = re.fullmatch(r"wds_cloud\[([\w,]+)\]", requirement.replace(" ", ""))
        out += [r for name in named.group(1).split(",") for r in extra_requirements(name)] if named else [requirement]
    return out


def test_the_test_extra_holds_torch_to_the_torch_extras_range():
    """The test extra installs torchdata and pytorch-lightning, which need torch: it asks for torch with the
    torch extra's range, so a resolver never picks a torch outside it (it installed the newest CUDA build)."""
    from packaging.requirements import Requirement

    def torch_ranges(extra):
        return {str(Requirement(r).specifier) for r in extra_requirements(extra) if Requirement(r).name == "torch"}

    assert torch_ranges("torch") and torch_ranges("test") == torch_ranges("torch")
    assert torch_ranges("all") in (set(), torch_ranges("torch"))
    # new user: `pip install '.[gpu]'` over the supported CPU torch replaced it with the newest CUDA torch (2.14)
    assert torch_ranges("gpu") == torch_ranges("torch")
