"""Test-wide fixtures: an environment scrubbed of the variables wds_cloud reads, and fresh state."""

from __future__ import annotations

import os

import pytest

try:
    from hypothesis import HealthCheck, settings

    settings.register_profile("default", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile(
        "ci", deadline=None, max_examples=60, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
    )
    settings.load_profile("ci" if os.environ.get("CI") else "default")
except ImportError:  # pragma: no cover
    pass


@pytest.fixture(autouse=True)
def _clean_wds_environment(monkeypatch):
    """Every test starts without WDS_*/GOPEN_* variables and with a fresh plugin registry."""
    from wds_cloud import config, utils
    from wds_cloud.io import open as gopen
    from wds_cloud.io import registry

    for name in list(os.environ):
        if (name.startswith(("WDS_", "GOPEN_")) or name in config.ENV_VARS) and name not in ("HOME", "XDG_CONFIG_HOME"):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WDS_CLOUD_CONFIG", os.path.join(os.path.dirname(__file__), "tests", "no-such-profiles.toml"))
    registry.reset()
    saved = dict(gopen._user_openers)
    security = utils.enforce_security
    yield
    gopen._user_openers.clear()
    gopen._user_openers.update(saved)
    utils.enforce_security = security
    registry.reset()
