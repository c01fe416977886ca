"""The hook contract between wds_cloud and its storage plugins.

A plugin is a module (or object) with functions marked ``@hookimpl`` whose names
are the hooks below.  It is found through the ``wds_cloud`` entry-point group::

    [project.entry-points.wds_cloud]
    myscheme = "my_package.plugin_module"

Built-in backends are declared exactly the same way.  Plugins are loaded lazily,
once per process, the first time a URL is opened (or ``wds-cloud backends`` runs),
after the allow/block lists ``WDS_PLUGINS`` / ``WDS_DISABLE_PLUGINS`` are applied.
Every hook is documented in ``docs/plugins.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from ..config import Settings
    from .registry import Registrar

PROJECT = "wds_cloud"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

__all__ = ["hookspec", "hookimpl", "PROJECT", "wds_cloud_register_backends", "wds_cloud_rewrite_url"]


@hookspec
def wds_cloud_register_backends(register: "Registrar") -> None:
    """Register the storage backends this plugin provides.

    Called once for every loaded plugin when the registry is built (lazily, on
    first use, and again in a forked child process).  Not ``firstresult``: every
    implementation is called and the return value is ignored.

    :param register: a callable ``register(scheme, factory, *, override=False,
        requires=(), extra=None, description="")``.  ``scheme`` is the URL scheme
        without the colon (``"s3"``); ``factory(settings, **storage_options)``
        returns a :class:`wds_cloud.backend.Backend`.  ``requires`` lists the modules
        the backend imports at open time and ``extra`` the ``wds_cloud`` extra that
        installs them; ``wds-cloud backends`` and the unknown-scheme error use both
        to tell the user what to install.  Two plugins registering one scheme is an
        error naming both, unless exactly one of them passes ``override=True``.
    """


@hookspec(firstresult=True)
def wds_cloud_rewrite_url(url: str, settings: "Settings") -> Optional[str]:
    """Rewrite a URL before it is opened, or return ``None`` to leave it alone.

    Called by ``gopen`` for every URL that no ``WDS_REWRITE``/``GOPEN_REWRITE``
    rule matched.  ``firstresult``: the first implementation that returns a
    string wins and the others are not called.  A result starting with ``pipe:``
    is refused unless the user set ``WDS_ALLOW_UNTRUSTED_PIPES=1``.

    :param url: the URL as the user (or the shard list) gave it.
    :param settings: the :class:`wds_cloud.config.Settings` in force.
    """
