"""The storage registry: which backend opens which URL scheme.

Plugins are loaded from the ``wds_cloud`` entry-point group after the allow
and block lists of the settings are applied.  Every plugin's claims are
collected first and resolved afterwards, so the order in which entry points
happen to load never decides anything: two plain claims on one scheme are a
:class:`PluginConflictError` naming both plugins, and a single ``override=True``
claim wins over the plain ones.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import threading
from collections.abc import Iterable
from typing import Any, Optional

import pluggy

from ..config import Settings
from ..errors import PluginConflictError, PluginError, UnknownSchemeError, redact
from . import hookspecs
from .backend import Backend
from .fsbackend import FsspecFallbackBackend, fsspec_protocols
from .hookspecs import Claim, Registrar
from .urls import split_scheme

__all__ = ["Claim", "Registrar", "Registry", "get_registry", "reset", "split_scheme"]

log = logging.getLogger(__name__)


def _plugin_allowed(name: str, settings: Settings) -> bool:
    if name in settings.plugins_block:
        return False
    return settings.plugins_allow is None or name in settings.plugins_allow


class Registry:
    """Resolved scheme table built from a plugin manager."""

    def __init__(
        self,
        settings: Settings,
        pm: Optional[pluggy.PluginManager] = None,
        entry_points: Optional[Iterable[Any]] = None,
    ) -> None:
        self.settings = settings
        self.pm = pm or pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.distributions: dict[str, Optional[str]] = {}
        self.skipped: list[str] = []
        if entry_points is None:
            entry_points = importlib.metadata.entry_points(group=hookspecs.PROJECT)
        for ep in sorted(entry_points, key=lambda e: e.name):
            self._load_entry_point(ep)
        self.pm.check_pending()
        self.claims: dict[str, Claim] = {}
        self._backends: dict[tuple, Backend] = {}
        self._lock = threading.Lock()
        self._resolve()

    def after_fork(self) -> None:
        """In a forked child: forget the backends made in the parent (their clients are the parent's)."""
        self._lock = threading.Lock()
        self._backends = {}

    def _load_entry_point(self, ep: Any) -> None:
        if not _plugin_allowed(ep.name, self.settings):
            self.skipped.append(ep.name)
            log.debug("plugin %s skipped by WDS_PLUGINS/WDS_DISABLE_PLUGINS", ep.name)
            return
        if self.pm.has_plugin(ep.name):
            return
        try:
            plugin = ep.load()
        except Exception as exc:
            dist = getattr(getattr(ep, "dist", None), "name", None)
            raise PluginError(
                f"plugin {ep.name!r} ({ep.value}, from {dist or 'an unknown distribution'}) failed to import: "
                f"{exc}; fix or uninstall it, or add it to WDS_DISABLE_PLUGINS"
            ) from exc
        self.pm.register(plugin, name=ep.name)
        self.distributions[ep.name] = getattr(getattr(ep, "dist", None), "name", None)

    def register_plugin(self, plugin: object, name: str, distribution: Optional[str] = None) -> None:
        """Add a plugin object directly (tests, programs embedding a backend) and re-resolve."""
        if not _plugin_allowed(name, self.settings):
            self.skipped.append(name)
            return
        self.pm.register(plugin, name=name)
        self.distributions[name] = distribution
        self.pm.check_pending()
        self._resolve()

    def _resolve(self) -> None:
        collected: list[Claim] = []
        for impl in self.pm.hook.wds_cloud_register_backends.get_hookimpls():
            name = self.pm.get_name(impl.plugin) or repr(impl.plugin)
            impl.function(register=Registrar(name, self.distributions.get(name), collected))
        by_scheme: dict[str, list[Claim]] = {}
        for claim in collected:
            by_scheme.setdefault(claim.scheme, []).append(claim)
        resolved = {}
        for scheme, claims in sorted(by_scheme.items()):
            overrides = [c for c in claims if c.override]
            if len(overrides) > 1:
                raise PluginConflictError(
                    f"scheme {scheme!r} is overridden by several plugins: {_names(overrides)}; "
                    "uninstall one, or block it with WDS_DISABLE_PLUGINS"
                )
            if overrides:
                resolved[scheme] = overrides[0]
            elif len(claims) > 1:
                raise PluginConflictError(
                    f"scheme {scheme!r} is claimed by several plugins: {_names(claims)}; "
                    "uninstall one, block one with WDS_DISABLE_PLUGINS, "
                    "or have the one that should win register with override=True"
                )
            else:
                resolved[scheme] = claims[0]
        self.claims = resolved
        self._backends.clear()

    def schemes(self) -> list[str]:
        return sorted(self.claims)

    def fallback_claims(self) -> dict[str, Claim]:
        """Claims for the protocols fsspec knows that no plugin claims ("fsspec (fallback)")."""

        out = {}
        for scheme, (cls, hint) in sorted(fsspec_protocols().items()):
            if scheme in self.claims or scheme in self.skipped:
                continue
            module = cls.split(".", 1)[0]
            out[scheme] = Claim(
                scheme,
                functools.partial(FsspecFallbackBackend, protocol=scheme, hint=hint),
                "fsspec (fallback)",
                "fsspec",
                requires=(module,) if module else (),
                description=hint or f"through fsspec ({cls})",
                hint=hint,
            )
        return out

    def claim(self, scheme: str, url: str = "") -> Claim:
        """The claim for ``scheme`` (a plugin's, else fsspec's fallback), or an :class:`UnknownSchemeError`."""
        try:
            return self.claims[scheme]
        except KeyError:
            pass
        fallback = self.fallback_claims().get(scheme)
        if fallback is not None:
            return fallback
        known = ", ".join(self._describe(s) for s in self.schemes()) or "(none: no plugin is loaded)"
        known += " (and the protocols fsspec knows: see `wds-cloud backends --all`)"
        hint = ""
        if scheme in self.skipped:
            hint = f"; the plugin {scheme!r} is disabled by WDS_PLUGINS/WDS_DISABLE_PLUGINS"
        raise UnknownSchemeError(
            f"no backend for the scheme {scheme!r} in {redact(url)!r}: known schemes are {known}{hint}. "
            "For a local path containing ':', write it as ./path or file:path",
            url=url,
            scheme=scheme,
        )

    def _describe(self, scheme: str) -> str:
        claim = self.claims[scheme]
        return f"{scheme}: (needs {claim.install_hint()})" if claim.missing() else f"{scheme}:"

    def backend(
        self, scheme: str, url: str = "", settings: Optional[Settings] = None, **storage_options: Any
    ) -> Backend:
        """The (shared) backend object for ``scheme``, these settings and storage options."""
        claim = self.claim(scheme, url)
        settings = settings or self.settings
        key = (scheme, tuple(sorted((k, repr(v)) for k, v in storage_options.items())), settings)
        with self._lock:
            backend = self._backends.get(key)
            if backend is None:
                backend = claim.factory(settings, **storage_options)
                backend.scheme = backend.scheme or scheme
                self._backends[key] = backend
        return backend

    def route(self, url: str, scheme: str) -> Optional[str]:
        """Ask plugins (``wds_cloud_route_url``) whether another backend should serve ``url``."""
        return self.pm.hook.wds_cloud_route_url(url=url, scheme=scheme, settings=self.settings)

    def rewrite(self, url: str) -> Optional[str]:
        """Ask plugins (``wds_cloud_rewrite_url``) whether to rewrite ``url``."""
        return self.pm.hook.wds_cloud_rewrite_url(url=url, settings=self.settings)


def _names(claims: list[Claim]) -> str:
    return " and ".join(f"{c.plugin!r} (from {c.distribution or 'no distribution'})" for c in claims)


_lock = threading.Lock()
_registries: dict[tuple, Registry] = {}


def get_registry(settings: Settings) -> Registry:
    """The process-wide registry for these plugin settings, built on first use."""
    key = (settings.plugins_allow, settings.plugins_block)
    registry = _registries.get(key)
    if registry is None:
        with _lock:
            registry = _registries.get(key)
            if registry is None:
                registry = Registry(settings)
                _registries[key] = registry
    return registry


def reset() -> None:
    """Forget every registry; the next use loads plugins again."""
    _registries.clear()


def _after_fork_in_child() -> None:
    # Backends hold clients, sessions and event loops that must not cross a fork (DataLoader
    # workers): the child makes its own on first use.  The plugins and the scheme table are plain
    # objects and stay, so a worker's first shard does not wait for the entry points to be read again.
    global _lock
    _lock = threading.Lock()
    for registry in _registries.values():
        registry.after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
