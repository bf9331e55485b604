"""torch.fx capture that does not give up on real models.

Plain `symbolic_trace` rejects a whole model when any line of it branches on a tensor,
calls `int()` on a shape or iterates a proxy (every Hugging Face model does one of these).
`trace_with_opaque_leaves` traces what it can: a submodule whose forward cannot be traced is
kept as an opaque `call_module` leaf, with the reason, and tracing is retried around it.
`fxopt.capture.capture` then recurses into those leaves so their children are optimized too.
"""
from __future__ import annotations

import dataclasses
import traceback

import torch
import torch.fx as fx

from ..errors import FxoptError


@dataclasses.dataclass
class OpaqueModule:
    """A submodule fxopt could not trace and runs unchanged (its children may still be captured)."""

    path: str  # qualified name in the caller's model ("" is the model itself)
    type: str
    reason: str


class _LocatingTracer(fx.Tracer):
    """A tracer that treats chosen modules as leaves and remembers which module a failure was in."""

    def __init__(self, opaque_paths: set[str]):
        super().__init__()
        self.opaque_paths = opaque_paths

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return qualname in self.opaque_paths or super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as e:
            if not hasattr(e, "_fxopt_module_path"):
                e._fxopt_module_path = self.path_of_module(m)
            raise


def _describe(e: Exception) -> str:
    """One line saying what stopped tracing and where, in the user's code if possible."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/torch/" not in f.filename]
    where = f" at {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno} `{frames[-1].line}`" if frames else ""
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    return f"{type(e).__name__}: {msg[:160]}{where}"


def trace_with_opaque_leaves(module: torch.nn.Module, concrete_args: dict | None = None):
    """Trace `module`; return (GraphModule, [OpaqueModule]), or (None, [OpaqueModule for root]).

    Each failing submodule becomes a leaf and tracing restarts: at most one retry per submodule.
    """
    opaque: dict[str, OpaqueModule] = {}
    for _ in range(len(list(module.modules())) + 1):
        tracer = _LocatingTracer(set(opaque))
        try:
            graph = tracer.trace(module, concrete_args=concrete_args)
        except Exception as e:  # noqa: BLE001 - any tracing failure is handled the same way
            path = getattr(e, "_fxopt_module_path", "")
            if path == "" or path in opaque:
                root = OpaqueModule("", type(module).__name__, _describe(e))
                return None, [root]
            opaque[path] = OpaqueModule(path, type(module.get_submodule(path)).__name__, _describe(e))
            continue
        name = module.__class__.__name__
        return fx.GraphModule(tracer.root, graph, name), list(opaque.values())
    raise FxoptError(f"tracing {type(module).__name__} did not converge")  # pragma: no cover
