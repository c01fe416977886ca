"""The wds-cloud console script."""

import os
import subprocess
import sys

import wds_cloud
from wds_cloud.cli import main


def test_backends_lists_file_and_pipe(capsys):
    """`wds-cloud backends` lists each scheme with its plugin, distribution and status."""
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "file:" in out and "pipe:" in out and "wds_cloud" in out and "ready" in out


def test_help_and_version():
    """The installed console script answers --help and --version."""
    script = os.path.join(os.path.dirname(sys.executable), "wds-cloud")
    help_text = subprocess.run([script, "--help"], capture_output=True, text=True, check=True).stdout
    assert "backends" in help_text
    version = subprocess.run([sys.executable, "-m", "wds_cloud.cli", "--version"], capture_output=True,
                             text=True, check=True).stdout
    assert wds_cloud.__version__ in version


def test_no_command_prints_help(capsys):
    """Without a command the usage is printed and the exit status is 2."""
    assert main([]) == 2
    assert "usage" in capsys.readouterr().out
