"""Export one module as called: `torch.export.export(module, args, kwargs, strict=False)`.

The graph is `ep.module()` — ATen training-IR ops, parameters and buffers as `get_attr` nodes
that are the module's own tensors, grad-mode and autocast regions as
`wrap_with_set_grad_enabled` / `wrap_with_autocast` calls, buffer writes as in-place ops — made
into a plain `torch.fx.GraphModule`: without export's input-guard call (`_guards_fn`, which fails
with an `AssertionError`; its facts are kept in a `CallSpec`), and without export's forward hooks
(closures that neither pickle nor let a call differ), and without the constant all-True or causal
attention masks export made Hugging Face models build where eager passes none (`attention_masks.py`).
A custom autograd Function's call becomes one op that runs the Function, its backward included
(`autograd_functions.py`); a forward calling one that op cannot stand for, registering a tensor hook or
entering saved-tensor hooks is refused (`autograd_extensions.py`): the graph would keep the Function's
forward without its backward, and none of the hooks.

Sizes are those of the example call (a static export: the cheapest, and its fake values,
`node.meta["val"]`, are the concrete example shapes the analyses need). With `dynamic_batch` the
first dimension of every tensor argument is exported as `Dim.AUTO` instead: symbolic where the
model's code allows it, silently static where it does not (and always static for an example
batch of 0 or 1); that export costs 1.5-3x a static one.
"""
from __future__ import annotations

import dataclasses
import inspect
import os
import textwrap
import traceback

import torch
import torch.fx as fx

from .. import _torch_private
from .ambient_state import recording_reads
from .attention_masks import drop_constant_masks
from .attribute_writes import recording_writes
from .autograd_extensions import refusing_autograd_extensions
from .autograd_functions import ops_in, recorded_calls
from .call_spec import CallSpec
from ..host_rng import HostRandomState
from ..state_preservation import preserved_state
from .cumulative_batchnorm import traceable_cumulative_batchnorm

_REASON_WIDTH = 300
_TORCH_DIR = os.path.dirname(torch.__file__)
_FXOPT_DIR = os.path.dirname(os.path.dirname(__file__))


@dataclasses.dataclass
class Exported:
    gm: fx.GraphModule
    call: CallSpec
    training_flags: dict[str, bool]  # module path -> the train/eval flag export baked into the graph


def _dynamic_batch(args: tuple, kwargs: dict, signature: inspect.Signature) -> dict:
    """`dynamic_shapes` for export: dimension 0 of every tensor argument is Dim.AUTO, by argument name."""
    def spec(value):
        return {0: torch.export.Dim.AUTO} if isinstance(value, torch.Tensor) and value.dim() > 0 else None

    bound = signature.bind(*args, **kwargs)
    return {name: _torch_private.tree_map(spec, value) for name, value in bound.arguments.items()}


def export_module(module: torch.nn.Module, args: tuple, kwargs: dict, *, dynamic_batch: bool) -> Exported | str:
    """Export `module` for the call (args, kwargs), or return why export refused (see module docstring).

    The module, its tensors and the arguments are left as they were (export runs writes to
    plain tensor attributes on the real tensors).
    """
    try:
        dynamic = _dynamic_batch(args, kwargs, inspect.signature(module.forward)) if dynamic_batch else None
    except TypeError as e:  # the call does not bind to forward's signature
        return f"{type(e).__name__}: {e}"
    try:
        with preserved_state(module, (args, kwargs), parameters=False), _torch_private.quiet_export_logs(), \
                _torch_private.refuse_user_checkpoint(), refusing_autograd_extensions(), \
                traceable_cumulative_batchnorm(module), recording_reads() as reads, recording_writes(module) as writes, \
                recorded_calls() as recorded:
            host_rng = HostRandomState()
            ep = torch.export.export(module, tuple(args), dict(kwargs), strict=False, dynamic_shapes=dynamic)
            drawn = host_rng.drawn()  # before preserved_state puts the generators back
    except Exception as e:  # noqa: BLE001 - any refusal keeps this module opaque, with export's reason
        return describe_failure(e, module)
    if drawn:
        return (f"its forward draws from {' and '.join(drawn)} (not torch's generator): a graph would repeat the "
                f"one draw made while tracing ({user_code_location(None, module)})")
    if writes:
        kind = "a plain attribute, not a buffer" if len(writes) == 1 else "plain attributes, not buffers"
        return (f"its forward assigns {', '.join(writes)} ({kind}): eager sets it on every call, a graph would not "
                f"({user_code_location(None, module)})")
    exported = _torch_private.exported_module(ep)
    if ops_in(exported) != len(recorded):
        return (f"torch.export did not keep fxopt's op for each call of {', '.join(dict.fromkeys(recorded))} (a custom "
                f"autograd.Function): a graph would differentiate its forward instead of running its own backward "
                f"({user_code_location(None, module)})")
    gm = _plain_graph_module(exported, type(module).__name__)
    drop_constant_masks(gm)
    call = CallSpec.from_export(gm, ep.range_constraints, kwargs, tuple(reads))
    return Exported(gm, call, {path: m.training for path, m in module.named_modules()})


def _plain_graph_module(exported: fx.GraphModule, class_name: str) -> fx.GraphModule:
    """`exported` as a plain GraphModule, without export's forward hooks (see module docstring)."""
    gm = fx.GraphModule(exported, exported.graph, class_name)
    gm.meta.update(exported.meta)
    return gm


def describe_failure(e: BaseException, module: torch.nn.Module) -> str:
    """Export's own reason, where it happened in the user's code, shortened at a word boundary."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    message = " ".join(lines[0].split()) if lines else type(e).__name__
    reason = textwrap.shorten(f"{type(e).__name__}: {message}", _REASON_WIDTH, placeholder=" ...")
    return f"{reason} ({user_code_location(e, module)})"


def user_code_location(e: BaseException | None, module: torch.nn.Module) -> str:
    """`at file.py:123: <code>` of the innermost frame of the user's code in `e`'s traceback, else where `module.forward` is."""
    frames = [f for f in traceback.extract_tb(e.__traceback__ if e is not None else None)
              if not f.filename.startswith((_TORCH_DIR, _FXOPT_DIR)) and "<" not in f.filename]
    if frames:
        frame = frames[-1]
        return f"at {frame.filename}:{frame.lineno}: {frame.line}" if frame.line else f"at {frame.filename}:{frame.lineno}"
    forward = inspect.unwrap(type(module).forward)
    try:
        return f"in {inspect.getsourcefile(forward)}:{inspect.getsourcelines(forward)[1]}"
    except (OSError, TypeError):
        return f"in {type(module).__qualname__}.forward"
