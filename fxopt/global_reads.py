"""Which module-level globals a model's own code reads: what torch.export bakes into a graph as constants.

A forward that reads `SCALE` (a global of its Python module) is exported with the value `SCALE` had
then; set `SCALE = 3` afterwards and eager computes with 3 while the graph still multiplies by 2.
`globals_read(model.modules())` finds such names without running anything, from the bytecode: every
`LOAD_GLOBAL` in each module's `forward` (and the lambdas, comprehensions and inner functions
inside it), in functions stored on a module instance, and, followed through, in the methods of the
module's class whose names they load as attributes (`self.helper(x)`) and the plain Python
functions they load by global name (a module-level helper such as Hugging Face's
`eager_attention_forward`). Functions defined in torch
(`nn.Linear.forward`) are not read: their globals are torch's own. It returns {Python module name:
names read there}; the caller decides which values are worth guarding (fxopt.guards: plain values).

It over-approximates (a name in a branch the call never takes is read too; reassigning it then only
costs a new optimization) and misses what is not a global load: `import config; config.SCALE`
(an attribute of another module) and reads from functions reached other than by a global name.
"""
from __future__ import annotations

import dis
import functools
import inspect
import sys
import types
from collections.abc import Iterable

import torch

from .user_code import is_users_module

_STANDARD_PACKAGES_SKIPPED = ("builtins", "typing", "abc")  # besides torch's and fxopt's (fxopt.user_code)


def globals_read(modules: Iterable[torch.nn.Module]) -> dict[str, frozenset[str]]:
    """{module name: global names the code of these (torch) modules loads there} (see module docstring)."""
    found: dict[str, set[str]] = {}
    seen: set[types.CodeType] = set()
    modules = list(modules)
    pending = [(type(m).forward, type(m)) for m in modules]
    pending += [(f, None) for m in modules for f in vars(m).values() if isinstance(f, types.FunctionType)]
    while pending:
        function, cls = pending.pop()
        function = inspect.unwrap(function)
        module_name = _module_of(function)
        if module_name is None or not _is_users(module_name):
            continue
        module_globals = function.__globals__
        names = found.setdefault(module_name, set())
        for code in _code_objects(function.__code__):
            if code in seen:
                continue
            seen.add(code)
            loaded, attributes = _loads(code)
            for name in loaded:
                value = module_globals.get(name)
                if isinstance(value, types.FunctionType):
                    pending.append((value, None))
                elif name in module_globals:
                    names.add(name)
            pending += [(method, cls) for method in map(functools.partial(_method, cls), attributes) if method]
    return {module: frozenset(names) for module, names in found.items() if names}


def _module_of(function) -> str | None:
    """The name of the imported module whose globals `function` reads; None for code that has none (code torch.fx
    generated, code run by `exec`), whose globals nothing could later look up."""
    if not isinstance(function, types.FunctionType):
        return None
    name = function.__globals__.get("__name__")
    module = sys.modules.get(name) if isinstance(name, str) else None
    return name if module is not None and vars(module) is function.__globals__ else None


def _is_users(module_name: str) -> bool:
    return is_users_module(module_name) and module_name.partition(".")[0] not in _STANDARD_PACKAGES_SKIPPED


def _method(cls: type | None, name: str):
    """The plain function behind `cls`'s method, static or class method, or property `name`; None if it has none."""
    attribute = inspect.getattr_static(cls, name, None) if cls is not None else None
    if isinstance(attribute, (staticmethod, classmethod)):
        return attribute.__func__
    if isinstance(attribute, property):
        return attribute.fget
    return attribute if isinstance(attribute, types.FunctionType) else None


def _code_objects(code: types.CodeType) -> list[types.CodeType]:
    """`code` and the code objects nested in it (lambdas, comprehensions, inner functions), recursively."""
    nested = [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return [code] + [inner for c in nested for inner in _code_objects(c)]


@functools.lru_cache(maxsize=4096)
def _loads(code: types.CodeType) -> tuple[frozenset[str], frozenset[str]]:
    """(the global names `code` loads, the attribute names it loads: `self.helper` may be a method to follow)."""
    instructions = list(dis.get_instructions(code))
    return (frozenset(i.argval for i in instructions if i.opname == "LOAD_GLOBAL"),
            frozenset(i.argval for i in instructions if i.opname in ("LOAD_ATTR", "LOAD_METHOD")))
