"""Brace specs are counted before they are expanded: a range of billions is refused at once, by our error."""

import itertools
import subprocess
import sys

import braceexpand
import pytest
from hypothesis import given
from hypothesis import strategies as st

import wds_cloud as wds
from wds_cloud.errors import ConfigError, MalformedDataError
from wds_cloud.shardlists import expand_urls
from wds_cloud.utils import count_braces, expand_braces


@pytest.mark.parametrize(
    "spec",
    ["a{0..9}", "a{00..10}b{1,2,3}", "{a,b{1..5}}x", "x{a..e}", "p{0..10..2}", "lit{x}", "{1..3}{a,b}{c,d,e}"]
    + ["no braces", "{,a}", "{a..c..2}", "{}", "{5..1}", "{-3..3}", "s3://b/{x,y}/t-{000..099}.tar"],
)
def test_the_count_is_what_braceexpand_gives(spec):
    assert count_braces(spec) == len(list(braceexpand.braceexpand(spec)))


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), max_size=3), st.integers(1, 4))
def test_counts_of_generated_specs(ranges, alternatives):
    spec = "".join(f"x{{{a}..{b}}}" for a, b in ranges) + "{" + ",".join(f"a{i}" for i in range(alternatives)) + "}"
    expected = len(list(braceexpand.braceexpand(spec)))
    assert count_braces(spec) == expected


def test_a_huge_range_is_refused_before_it_is_built():
    """``braceexpand`` builds a range's values before the first: 10**11 names would take gigabytes."""
    with pytest.raises(ConfigError, match="100,000,000,000 URLs, more than 1,000,000,000"):
        wds.WebDataset("data/train-{0..99999999999}.tar", shardshuffle=False)
    with pytest.raises(ConfigError, match="more than 1,000,000"):
        list(wds.tariterators.shardlist("t-{0..99999999999}.tar"))
    with pytest.raises(ConfigError, match="more than 1,000,000,000"):
        wds.utils.glob_with_braces("/nonexistent/{0..99999999999}")
    with pytest.raises(MalformedDataError, match="names 100,000,000,000 URLs"):
        expand_urls("t-{0..99999999999}.tar", 1000, "spec.yaml")
    assert len(list(itertools.islice(expand_braces("t-{0..999999999}.tar"), 3))) == 3  # a billion: names made lazily


def test_the_command_line_refuses_a_huge_range_with_exit_2(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "wds_cloud", "verify", "t-{0000..99999999999}.tar", "--json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 2 and "more than 1,000,000,000" in done.stderr + done.stdout
    assert "Traceback" not in done.stderr
