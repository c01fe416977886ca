"""griffe extension: the docstrings' Sphinx roles become links of the reference, never raw markup.

The docstrings cross-reference with Sphinx roles (``:class:`~wds_cloud.dataset.options.ReadOptions```,
``:meth:`state_dict```, ``:mod:`wds_cloud.resume```), which mkdocstrings would show as text. Before rendering,
each role is resolved in the scope of the object whose docstring holds it (its module's imports, its class's
members, then its parents') and rewritten as an autorefs link, ``[`ReadOptions`][wds_cloud.dataset.options.ReadOptions]``,
when its target is rendered on a page of the reference (strict builds then prove every link resolves);
otherwise (the standard library, a private helper, a name the reference leaves out) as inline code. A
leading ``~`` shows the last part of the name only, as in Sphinx; ``!`` never links.
"""

from __future__ import annotations

import functools
import pathlib
import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(class|func|meth|mod|attr|data|exc|obj|const|ref):`([^`]+)`")
REFERENCE = pathlib.Path(__file__).resolve().parents[1] / "reference"
DIRECTIVE = re.compile(r"^::: *([\w.]+)((?:\n[ \t]+.*)*)", re.M)


def _rendered_modules() -> dict[str, Any]:
    """The modules the reference pages render (``::: module``), each with its ``members:`` list or None."""
    found: dict[str, Any] = {}
    for page in REFERENCE.glob("*.md"):
        for match in DIRECTIVE.finditer(page.read_text()):
            options = match.group(2)
            members = re.search(r"members:\s*\[([^\]]*)\]", options)
            if members:
                found[match.group(1)] = [m.strip() for m in members.group(1).split(",")]
            else:
                found[match.group(1)] = [] if re.search(r"members:\s*false", options) else None
    return found


def _objects(obj: Any):
    yield obj
    for member in list(obj.members.values()):
        if member.is_alias:
            continue
        yield from _objects(member)


class SphinxRoles(griffe.Extension):
    """Rewrite every docstring of the loaded package once it is loaded whole (names resolve across modules)."""

    def on_package(self, *, pkg: Any, **kwargs: Any) -> None:
        modules = _rendered_modules()
        objects = list(_objects(pkg))
        rendered = {o.path for o in objects if self._is_rendered(o, modules)}
        for obj in objects:
            if obj.docstring is not None and ":" in obj.docstring.value:
                obj.docstring.value = ROLE.sub(
                    functools.partial(self._link, obj=obj, rendered=rendered), obj.docstring.value
                )

    @staticmethod
    def _is_rendered(obj: Any, modules: dict) -> bool:
        parts = obj.path.split(".")
        if any(p.startswith("_") for p in parts[1:]):
            return False
        module = obj
        while not module.is_module:  # submodules are never shown with their package (show_submodules: false)
            module = module.parent
        if module.path not in modules:
            return False
        rest = parts[len(module.path.split(".")) :]
        if not rest:
            return True
        members = modules[module.path]
        if members is not None and rest[0] not in members:
            return False
        return obj.docstring is not None  # the reference shows no member without a docstring

    @staticmethod
    def _resolve(target: str, obj: Any) -> str | None:
        root = obj
        while root.parent is not None:
            root = root.parent
        if target.startswith(root.path + ".") or target == root.path:
            try:
                found = root.modules_collection.get_member(target) if hasattr(root, "modules_collection") else None
            except Exception:
                found = None
            if found is None:
                try:
                    found = root[target[len(root.path) + 1 :]] if target != root.path else root
                except Exception:
                    return None
            return found.final_target.path if found.is_alias else found.path
        scope = obj
        while scope is not None:
            head, _, tail = target.partition(".")
            try:
                path = scope.resolve(head)
            except Exception:
                scope = scope.parent
                continue
            full = f"{path}.{tail}" if tail else path
            if full.startswith(root.path):
                return SphinxRoles._resolve(full, obj) if full != target else None
            return None
        return None

    def _link(self, match: re.Match, obj: Any, rendered: set) -> str:
        target = match.group(2).strip()
        if "<" in target and target.endswith(">"):  # :class:`title <target>`
            title, _, target = target[:-1].partition("<")
            title, target = title.strip(), target.strip()
        else:
            title = None
        never = target.startswith("!")
        short = target.startswith("~")
        target = target.lstrip("!~")
        if title is None:
            title = target.rsplit(".", 1)[-1] if short else target
            if match.group(1) in ("func", "meth") and not title.endswith(")"):
                title += "()"
        shown = f"`{title}`"
        if never:
            return shown
        path = self._resolve(target.removesuffix("()"), obj)
        if path is not None and path in rendered:
            return f"[{shown}][{path}]"
        return shown
