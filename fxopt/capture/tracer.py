"""torch.fx capture that does not give up on real models.

Plain `symbolic_trace` rejects a whole model when any line of it branches on a shape, calls
`int()` on a size, branches on a tensor's value or iterates a proxy (every Hugging Face model
does one of these). `trace_with_opaque_leaves` traces what it can, in two steps:

1. Plain tracing: the graph is general in the input shapes. If it succeeds, that graph is used.
2. Shape-specialized tracing: every proxy carries the tensor it stands for (each recorded op
   is also run on the example inputs as the trace goes, buffers and RNG restored after), so `x.shape`, `x.size(1)`,
   `x.dim()`, `len(x)` and `x.dtype` answer with the example's concrete values. The graph is
   then valid only for inputs of those shapes and dtypes: `capture` guards it
   (`SpecializedCall` runs the original module for any other input). Branching on a tensor's
   *value* (`if x.sum() > 0:`) still fails: specializing it would be wrong on the other branch.

In both steps a submodule whose forward cannot be traced is kept as an opaque `call_module`
leaf, with the reason, and tracing is retried around it; `fxopt.capture.capture` then recurses
into those leaves so their children are optimized too.
"""
from __future__ import annotations

import dataclasses
import inspect
import traceback
from typing import Any

import torch
import torch.fx as fx

from .. import _torch_private
from ..errors import FxoptError
from ..graph_functions import RetraceTracer, forget_wrapped_calls, graph_functions
from .constants import protect_traced_constants
from .state import preserved_state


@dataclasses.dataclass
class OpaqueModule:
    """A submodule fxopt could not trace and runs unchanged (its children may still be captured)."""

    path: str  # qualified name in the caller's model ("" is the model itself)
    type: str
    reason: str


@dataclasses.dataclass
class Traced:
    """What `trace_with_opaque_leaves` produced: the graph (None if the root failed) and its leaves."""

    gm: fx.GraphModule | None
    opaque: list[OpaqueModule]
    shape_specialized: bool = False


class _FixedVarKeywords(dict):
    """The fixed `**kwargs` of a traced call: a real dict, but a pytree leaf, so fx makes no placeholder."""


class _FixedVarPositionals(tuple):
    """The fixed `*args` of a traced call (see _FixedVarKeywords)."""


class _LocatingTracer(fx.Tracer):
    """A tracer that treats chosen modules as leaves and remembers which module a failure was in.

    `concrete_args` may fix varargs as "*args" / "**kwargs" (non-tensor values only): they are
    passed as they are, without a placeholder (fx's own concrete_args route generates invalid
    code for them next to specialized flags, and cannot fix named entries of **kwargs).
    """

    def __init__(self, opaque_paths: set[str]):
        super().__init__(autowrap_functions=graph_functions())
        # Buffers as get_attr proxies: otherwise `self.count.add_(1)` runs once at trace time
        # (on the caller's buffer) and never reaches the graph.
        self.proxy_buffer_attributes = True
        self.opaque_paths = opaque_paths
        self.fixed_varargs: dict[str, Any] = {}

    def trace(self, root, concrete_args=None):
        concrete_args = dict(concrete_args or {})
        self.fixed_varargs = {name: concrete_args.pop(name) for name in list(concrete_args) if name.startswith("*")}
        return forget_wrapped_calls(super().trace(root, concrete_args or None))

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        if kind == "placeholder" and target in self.fixed_varargs:
            value = self.fixed_varargs[target]
            return _FixedVarKeywords(value) if target.startswith("**") else _FixedVarPositionals(value)
        return super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return qualname in self.opaque_paths or super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as e:
            if not hasattr(e, "_fxopt_module_path"):
                e._fxopt_module_path = self.path_of_module(m)
            raise


_MISSING = object()


class _ShapeProxy(fx.Proxy):
    """A proxy that answers shape, rank and dtype questions with the example's concrete values."""

    def _value(self) -> torch.Tensor | None:
        value = self.tracer.values.get(self.node, _MISSING)
        if isinstance(value, torch.Tensor):
            self.tracer.specialized = True
            return value
        return None

    def _answer(self, attribute: str, call_args: tuple | None = None):
        """The example's answer for `attribute` (called with `call_args` if given), else what plain tracing records."""
        value = self._value()
        found = getattr(value, attribute) if value is not None else fx.Proxy.__getattr__(self, attribute)
        return found if call_args is None else found(*call_args)

    @property
    def shape(self):
        return self._answer("shape")

    @property
    def ndim(self):
        return self._answer("ndim")

    @property
    def dtype(self):
        return self._answer("dtype")

    def size(self, *dim):
        return self._answer("size", dim)

    def dim(self):
        return self._answer("dim", ())

    def __len__(self) -> int:
        value = self._value()
        if value is None:
            return super().__len__()
        return len(value)


class _ShapeTracer(_LocatingTracer):
    """A `_LocatingTracer` that also runs every recorded op on the example values, to know each node's value.

    Real values rather than FakeTensors: tracing already runs under `preserved_state`, the
    example inputs are small, and fake kernels (batch_norm's decomposition above all) are
    tens of times slower than running these ops for real on CPU.
    """

    def __init__(self, opaque_paths: set[str], example_values: dict[str, Any]):
        super().__init__(opaque_paths)
        self.example_values = example_values
        self.values: dict[fx.Node, Any] = {}
        self.specialized = False
        self.evaluating = False

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _ShapeProxy(node, self)

    # While a leaf module runs on example values, the tracer's patches of Module.__call__ and
    # Module.__getattr__ must step aside, or the leaf's insides would be recorded in the graph.
    def call_module(self, m, forward, args, kwargs):
        return forward(*args, **kwargs) if self.evaluating else super().call_module(m, forward, args, kwargs)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        return attr_val if self.evaluating else super().getattr(attr, attr_val, parameter_proxy_cache)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        if not isinstance(proxy, fx.Proxy):  # fixed *args / **kwargs
            return proxy
        value = self._evaluate(proxy.node)
        if value is not _MISSING:
            self.values[proxy.node] = value
        return proxy

    def _evaluate(self, node: fx.Node):
        """The value `node` produces on the example inputs, or _MISSING if that cannot be computed."""
        self.evaluating = True
        try:
            return self._run(node)
        except Exception:  # noqa: BLE001 - the value stays unknown; plain tracing behaviour applies
            return _MISSING
        finally:
            self.evaluating = False

    def _run(self, node: fx.Node):
        if node.op == "placeholder":
            value = self.example_values.get(node.target, _MISSING)
            return value.clone() if isinstance(value, torch.Tensor) else value  # ops may write in place
        if node.op == "get_attr":
            value = _get_qualified(self.root, node.target)
            return value.detach().clone() if isinstance(value, torch.Tensor) else _MISSING
        missing = []
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: self._lookup(n, missing))
        if missing:
            return _MISSING
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        if node.op == "call_module":
            return self.root.get_submodule(node.target)(*args, **kwargs)
        return _MISSING

    def _lookup(self, node: fx.Node, missing: list):
        value = self.values.get(node, _MISSING)
        if value is _MISSING:
            missing.append(node)
        return value


def _get_qualified(root: torch.nn.Module, target: str):
    owner, _, name = target.rpartition(".")
    return getattr(root.get_submodule(owner) if owner else root, name, None)


def _describe(e: Exception) -> str:
    """One line saying what stopped tracing and where, in the user's code if possible."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/torch/" not in f.filename]
    where = f" at {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno} `{frames[-1].line}`" if frames else ""
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    return f"{type(e).__name__}: {msg[:160]}{where}"


def _trace(module: torch.nn.Module, concrete_args: dict | None, example_values: dict | None,
           retries: bool = True) -> Traced:
    """Trace `module`, making each failing submodule an opaque leaf and retrying (once per submodule)."""
    opaque: dict[str, OpaqueModule] = {}
    for _ in range(len(list(module.modules())) + 1 if retries else 1):
        if example_values is None:
            tracer = _LocatingTracer(set(opaque))
        else:
            tracer = _ShapeTracer(set(opaque), example_values)
        attributes_before = set(vars(module))
        try:
            with preserved_state(module):
                graph = tracer.trace(module, concrete_args=concrete_args)
            gm = fx.GraphModule(tracer.root, graph, module.__class__.__name__)
        except Exception as e:  # noqa: BLE001 - any tracing failure is handled the same way
            path = getattr(e, "_fxopt_module_path", "")
            if path == "" or path in opaque or not retries:
                return Traced(None, [OpaqueModule("", type(module).__name__, _describe(e))])
            opaque[path] = OpaqueModule(path, type(module.get_submodule(path)).__name__, _describe(e))
            continue
        finally:
            # fx stores trace-time constants (`_tensor_constant0`) on the traced module itself: the
            # GraphModule has its own reference now, and the caller's module must stay as it was.
            for name in set(vars(module)) - attributes_before:
                delattr(module, name)
        _torch_private.set_reload_tracer(gm, RetraceTracer)
        protect_traced_constants(gm)
        return Traced(gm, list(opaque.values()), getattr(tracer, "specialized", False))
    raise FxoptError(f"tracing {type(module).__name__} did not converge")  # pragma: no cover


def _example_values(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Placeholder name -> example value, for a call of `module` with (args, kwargs)."""
    bound = inspect.signature(module.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def trace_with_opaque_leaves(module: torch.nn.Module, concrete_args: dict | None = None,
                             example_call: tuple[tuple, dict] | None = None) -> Traced:
    """Trace `module` as generally as possible (see module docstring).

    One plain attempt first: if the whole module traces, its graph is general in the shapes.
    Otherwise, given `example_call` (the (args, kwargs) of a real call), a shape-specialized
    trace with opaque-leaf retries; without it, plain tracing with retries.
    """
    plain = _trace(module, concrete_args, None, retries=example_call is None)
    if plain.gm is not None and not plain.opaque or example_call is None:
        return plain
    return _trace(module, concrete_args, _example_values(module, *example_call))
