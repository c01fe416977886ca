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

import dataclasses
from collections.abc import Callable, Iterable
from typing import Optional

import pluggy

from ..config import Settings
from ..errors import PluginError
from .backend import Backend, missing_modules

PROJECT = "wds_cloud"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

__all__ = [
    "hookspec",
    "hookimpl",
    "PROJECT",
    "wds_cloud_register_backends",
    "wds_cloud_rewrite_url",
    "wds_cloud_route_url",
    "Registrar",
    "Claim",
]


@hookspec
def wds_cloud_register_backends(register: Registrar) -> None:
    """Register the storage backends this plugin provides.

    Called once for every loaded plugin when the registry is built (lazily, on
    first use, and again in a forked child process).  Not ``firstresult``: every
    implementation is called and the return value is ignored.  The order in which
    plugins are called does not matter (so ``tryfirst``/``trylast`` mean nothing here):
    every claim is collected first, then conflicts are resolved as described below.

    :param register: a callable ``register(scheme, factory, *, override=False,
        requires=(), extra=None, description="")``.  ``scheme`` is the URL scheme
        without the colon (``"s3"``); ``factory(settings, **storage_options)``
        returns a :class:`wds_cloud.io.Backend`.  ``requires`` lists the modules
        the backend imports at open time and ``extra`` the ``wds_cloud`` extra that
        installs them; ``wds-cloud backends`` and the unknown-scheme error use both
        to tell the user what to install.  Two plugins registering one scheme is an
        error naming both, unless exactly one of them passes ``override=True``.
    """


@hookspec(firstresult=True)
def wds_cloud_rewrite_url(url: str, settings: Settings) -> Optional[str]:
    """Rewrite a URL before it is opened, or return ``None`` to leave it alone.

    Called by ``gopen`` for every URL that no ``WDS_REWRITE``/``GOPEN_REWRITE``
    rule matched.  ``firstresult``: the first implementation that returns a
    string wins and the others are not called.  A result starting with ``pipe:``
    is refused unless the user set ``WDS_ALLOW_UNTRUSTED_PIPES=1``.

    :param url: the URL as the user (or the shard list) gave it.
    :param settings: the :class:`wds_cloud.config.Settings` in force.
    """


@hookspec(firstresult=True)
def wds_cloud_route_url(url: str, scheme: str, settings: Settings) -> Optional[str]:
    """Name the backend that should serve ``url`` instead of the one its scheme names, or ``None``.

    Called by ``gopen`` (through ``open_backend``) for every URL it opens, after rewriting.
    ``firstresult``: the first implementation returning a scheme wins.  The URL itself is
    not changed, so cache names, saved states and error messages keep the user's URL; the
    backend registered for the returned scheme receives it as it is.  The ``ais`` plugin
    uses this for ``USE_AIS_FOR`` (``s3://`` read through an AIStore gateway).

    :param url: the URL about to be opened (after ``WDS_REWRITE`` and ``wds_cloud_rewrite_url``).
    :param scheme: its scheme, lower-cased (``"file"`` for a bare path).
    :param settings: the :class:`wds_cloud.config.Settings` in force.
    """


# What a plugin is handed (``register``) and what each registration records.


@dataclasses.dataclass(frozen=True)
class Claim:
    """One plugin's registration of one scheme."""

    scheme: str
    factory: Callable[..., Backend]
    plugin: str
    distribution: Optional[str]
    override: bool = False
    requires: tuple[str, ...] = ()
    extra: Optional[str] = None
    description: str = ""
    hint: Optional[str] = None  # an install hint worded by someone else (fsspec's, for fallback claims)

    def missing(self) -> list[str]:
        """Modules the backend needs that are not importable."""
        return missing_modules(self.requires)

    def install_hint(self) -> str:
        if self.hint:
            return self.hint
        if self.extra:
            return f"pip install 'wds_cloud[{self.extra}]' (in a clone: pip install -e '.[{self.extra}]')"
        return "pip install " + " ".join(self.missing())


class Registrar:
    """The ``register`` callable handed to ``wds_cloud_register_backends``."""

    def __init__(self, plugin: str, distribution: Optional[str], claims: list[Claim]) -> None:
        self._plugin = plugin
        self._distribution = distribution
        self._claims = claims

    def __call__(
        self,
        scheme: str,
        factory: Callable[..., Backend],
        *,
        override: bool = False,
        requires: Iterable[str] = (),
        extra: Optional[str] = None,
        description: str = "",
    ) -> None:
        if not isinstance(scheme, str) or not scheme or ":" in scheme or "/" in scheme:
            raise PluginError(
                f"plugin {self._plugin!r} registered an invalid scheme {scheme!r}: "
                "give the scheme name alone, such as 's3' (no ':' or '/')"
            )
        if not callable(factory):
            raise PluginError(f"plugin {self._plugin!r} registered a factory for {scheme!r} that is not callable")
        self._claims.append(
            Claim(
                scheme.lower(),
                factory,
                self._plugin,
                self._distribution,
                bool(override),
                tuple(requires),
                extra,
                description,
            )
        )
