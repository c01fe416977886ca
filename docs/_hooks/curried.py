"""griffe extension: the curried filters (``to_tuple = pipelinefilter(_to_tuple)``) are shown as the functions users
call.

webdataset's filters are written once, as a generator ``_name(data, ...)`` over the samples, and made public as
its curried stage, ``name = pipelinefilter(_name)``: at run time ``name(...)`` takes the generator's parameters
after ``data`` and has its docstring (``functools.update_wrapper``), but to a static reader such as griffe
``name`` is an attribute without a docstring, which the reference leaves out. Before rendering, each such
attribute becomes a function named ``name``, with ``_name``'s parameters after the first and ``_name``'s
docstring, so ``wds.to_tuple``, ``wds.batched``, ``wds.select``, ... get an entry with their real signature,
and the docstring stays in one place, the generator's.
"""

from __future__ import annotations

from typing import Any

import griffe

#: the callables that curry a filter: ``stages.pipelinefilter``, ``filters._Splitting`` and ``filters._Normalised`` (its arguments
#: normalised when the stage is built); each takes the generator as its first argument
CURRIERS = {"pipelinefilter", "RestCurried", "_Normalised", "_Splitting"}


def _curried(attribute: Any) -> Any:
    """The generator function ``attribute`` curries, or None when it is not ``CURRIER(_name, ...)``."""
    value = attribute.value
    if not isinstance(value, griffe.ExprCall) or not value.arguments:
        return None
    if str(value.function).rsplit(".", 1)[-1] not in CURRIERS:
        return None
    target = attribute.parent.members.get(str(value.arguments[0]))
    if target is None or target.is_alias or not target.is_function or not target.parameters:
        return None
    return target


class CurriedFilters(griffe.Extension):
    """Turn every module-level ``name = pipelinefilter(_name)`` of the loaded package into a function."""

    def on_package(self, *, pkg: Any, **kwargs: Any) -> None:
        for module in [pkg, *_modules(pkg)]:
            for name, member in list(module.members.items()):
                if member.is_alias or not member.is_attribute or member.docstring is not None:
                    continue
                generator = _curried(member)
                if generator is None:
                    continue
                function = griffe.Function(
                    name,
                    parameters=griffe.Parameters(*list(generator.parameters)[1:]),
                    lineno=member.lineno,
                    endlineno=member.endlineno,
                )
                if generator.docstring is not None:
                    function.docstring = griffe.Docstring(
                        generator.docstring.value,
                        lineno=generator.docstring.lineno,
                        endlineno=generator.docstring.endlineno,
                        parser=generator.docstring.parser,
                        parser_options=generator.docstring.parser_options,
                        parent=function,
                    )
                module.set_member(name, function)


def _modules(obj: Any):
    for member in list(obj.members.values()):
        if not member.is_alias and member.is_module:
            yield member
            yield from _modules(member)
