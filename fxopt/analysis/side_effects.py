"""Which graph nodes do something besides computing their result, and what.

Dead-code elimination may drop a node nobody reads only if running it changes nothing else.
torch.fx's own `eliminate_dead_code` trusts `Node.is_impure`, which calls every module pure and
misses `F.dropout`, `print`, `x.add_(y)` written as a method, and a train-mode BatchNorm that
updates its running statistics. `effects(node, gm)` names every effect a node may have:

  MUTATION  writes into a tensor it was given: in-place ops, methods and augmented assignment on
            tensors, `inplace=True` (the one in-place rule, `fxopt.op_names.is_inplace_call`, which
            aliasing reads too), `out=`, `operator.setitem`
  RNG       draws from the random generator (dropout in training, `torch.rand*`, `bernoulli`, ...):
            dropping it shifts every later draw
  STATS     updates buffers: BatchNorm / InstanceNorm in training with running statistics (in every
            form: `aten.batch_norm`'s schema does not say it writes them)
  IO        is seen from outside: `print`, asserts and checks (`torch._assert`, fx's `_assert_is_none`
            guarding a traced-away argument, `torch._check*`), hooks on the module, ops torch
            marks effectful
  OPAQUE    runs code we cannot see: module calls (an opaque module, a region fxopt made), user
            functions

An ATen op's effects come from its schema (mutable arguments, `nondeterministic_seeded`), except
where the schema is wrong about it (batch_norm's statistics; dropout with `train=False` draws
nothing).
Anything not recognised is OPAQUE, so a caller that keeps effectful nodes is sound by default.
"""
from __future__ import annotations

import builtins
import math
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import _torch_private
from ..graph_functions import declared, import_by_name, qualified_name
from ..op_names import bound_argument, is_inplace_call, is_inplace_op

MUTATION, RNG, STATS, IO, OPAQUE = "mutation", "rng", "stats", "io", "opaque"
NO_EFFECTS: frozenset[str] = frozenset()

_RANDOM_FUNCTIONS = {
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.rand_like, torch.randn_like, torch.randint_like,
    torch.bernoulli, torch.multinomial, torch.normal, torch.poisson, F.gumbel_softmax,
}
# Functions that draw random numbers only when their `training` argument is true (default in brackets).
_RANDOM_WHEN_TRAINING = {
    F.dropout: True, F.dropout1d: True, F.dropout2d: True, F.dropout3d: True, F.alpha_dropout: False,
    F.feature_alpha_dropout: False, F.rrelu: False, torch.dropout: None, torch.feature_dropout: None,
    torch.alpha_dropout: None, torch.feature_alpha_dropout: None,
}
_RANDOM_METHODS = {"bernoulli", "multinomial", "random_", "uniform_", "normal_", "exponential_", "geometric_",
                   "cauchy_", "log_normal_", "bernoulli_"}
_IO_FUNCTIONS = {builtins.print, torch.manual_seed, torch.set_grad_enabled}  # asserts: fx_is_impure
# Writes that are not in-place ops (those follow fxopt.op_names.is_inplace_call: `x += y`, `relu_`, inplace=True).
_WRITING_OPERATORS = {operator.setitem, operator.delitem}
_IO_METHODS = {"register_hook", "retain_grad", "backward", "record_stream", "__setitem__", "__delitem__"}
_PURE_NAMESPACES = (operator, math)
# ATen ops that draw random numbers only when their `train` argument (index) is true.
_ATEN_DROPOUTS = {"dropout": 2, "feature_dropout": 2, "alpha_dropout": 2, "feature_alpha_dropout": 2,
                  "native_dropout": 2}


def _is_torch_callable(fn) -> bool:
    return qualified_name(fn).startswith(("torch.", "builtins."))


def _function_effects(fn, args: tuple, kwargs: dict, gm: fx.GraphModule) -> frozenset[str]:
    name = getattr(fn, "__name__", "")
    helper = declared(fn)  # fxopt's own graph helpers declare their effects
    if helper is not None and helper.opaque:
        return frozenset({OPAQUE})
    if helper is not None and helper.runs_without_grad:
        return _wrapped_effects(helper.runs_without_grad, args[0], args[1:], kwargs, gm)
    if helper is not None:
        return frozenset(kind for kind, flag in ((MUTATION, helper.mutates), (STATS, helper.updates_stats)) if flag)
    if isinstance(fn, _torch_private.op_overload_types()):
        return _aten_effects(fn, args, kwargs)
    if fn in _RANDOM_FUNCTIONS:
        return frozenset({RNG})
    if fn in _IO_FUNCTIONS or name.lstrip("_").startswith(("assert", "check")) \
            or _torch_private.fx_is_impure(fn, args, kwargs):
        return frozenset({IO})
    if fn in _WRITING_OPERATORS or "out" in kwargs:
        return frozenset({MUTATION})
    inplace = is_inplace_call(fn, args, kwargs)
    if any(getattr(ns, name, None) is fn for ns in _PURE_NAMESPACES):
        return frozenset({MUTATION}) if inplace else NO_EFFECTS
    if not _is_torch_callable(fn):
        return frozenset({OPAQUE})
    kinds = {MUTATION} if inplace else set()
    if fn in _RANDOM_WHEN_TRAINING:
        default = _RANDOM_WHEN_TRAINING[fn]
        if default is None or bound_argument(fn, args, kwargs, "training", default) is not False:
            kinds.add(RNG)
    if _updates_running_stats(fn, args, kwargs):
        kinds.add(STATS)
    return frozenset(kinds)


def _aten_effects(op, args: tuple, kwargs: dict) -> frozenset[str]:
    name = _torch_private.aten_op_name(op)
    kinds = {MUTATION} if _torch_private.op_is_mutable(op) else set()
    if _torch_private.op_is_random(op):
        train = _ATEN_DROPOUTS.get(name)
        if train is None or not (len(args) > train and args[train] is False):
            kinds.add(RNG)
    if _updates_running_stats(op, args, kwargs):
        kinds.add(STATS)
    # torch.fx calls every random op impure; a dropout with train=False was decided above
    if not kinds and not _torch_private.op_is_random(op) and _torch_private.fx_is_impure(op, args, kwargs):
        kinds.add(IO)
    return frozenset(kinds)


# Functional norms that update running statistics when they normalise with batch statistics:
# (position, name, default) of that flag, and (position, name) of running_mean.
_BATCH_NORM_ARGS = ((5, "training", True), (3, "running_mean"))  # torch / aten: (input, weight, bias, mean, ...)
_INSTANCE_NORM_ARGS = ((5, "use_input_stats", True), (3, "running_mean"))
_NORM_ARGS = {
    F.batch_norm: ((5, "training", False), (1, "running_mean")),  # (input, running_mean, running_var, ...)
    F.instance_norm: ((5, "use_input_stats", True), (1, "running_mean")),
    torch.batch_norm: _BATCH_NORM_ARGS, torch.instance_norm: _INSTANCE_NORM_ARGS,
}
_ATEN_NORM_ARGS = {"batch_norm": _BATCH_NORM_ARGS, "instance_norm": _INSTANCE_NORM_ARGS}


def _updates_running_stats(fn, args: tuple, kwargs: dict) -> bool:
    """A functional norm that normalises with batch statistics and is given running statistics
    (a tensor, or a graph node computing one: a `get_attr` buffer)."""
    spec = _NORM_ARGS.get(fn) or _ATEN_NORM_ARGS.get(_torch_private.aten_op_name(fn))
    if spec is None:
        return False
    (flag_at, flag, default), (mean_at, mean) = spec
    batch_stats = args[flag_at] if len(args) > flag_at else kwargs.get(flag, default)
    running_mean = args[mean_at] if len(args) > mean_at else kwargs.get(mean)
    return batch_stats is not False and running_mean is not None


def _method_effects(name: str, kwargs: dict) -> frozenset[str]:
    kinds = set()
    if name in _IO_METHODS:
        kinds.add(IO)
    if is_inplace_op(name):
        kinds.add(MUTATION)
    if name in _RANDOM_METHODS:
        kinds.add(RNG)
    if "out" in kwargs:
        kinds.add(MUTATION)
    return frozenset(kinds)


def _module_effects(module: torch.nn.Module) -> frozenset[str]:
    """A module call (an opaque module, a region fxopt made) runs code we do not read: OPAQUE, and IO with hooks."""
    return frozenset({OPAQUE, IO}) if _torch_private.module_hooks(module) else frozenset({OPAQUE})


def _wrapped_effects(kind: str, target, args: tuple, kwargs: dict, gm: fx.GraphModule) -> frozenset[str]:
    """Effects of the callable an fxopt wrapper runs without grad (`Declared.runs_without_grad`)."""
    if kind == "method":
        return _method_effects(target, kwargs)
    if isinstance(target, fx.Node) and target.op == "get_attr":
        return _module_effects(gm.get_submodule(target.target))
    return _function_effects(import_by_name(target) if isinstance(target, str) else target, args, kwargs, gm)


def effects(node: fx.Node, gm: fx.GraphModule) -> frozenset[str]:
    """Every effect `node` may have besides producing its value (see module docstring)."""
    if node.op == "call_function":
        if isinstance(node.target, _torch_private.higher_order_op_type()):
            return frozenset({OPAQUE})  # another higher-order op (cond, checkpoint, ...): its body is unseen
        return _function_effects(node.target, node.args, node.kwargs, gm)
    if node.op == "call_method":
        return _method_effects(node.target, node.kwargs)
    if node.op == "call_module":
        return _module_effects(gm.get_submodule(node.target))
    return NO_EFFECTS  # placeholder, get_attr, output: kept or dropped by their own rules


def removable_if_unused(node: fx.Node, gm: fx.GraphModule) -> bool:
    """A node that may be erased when nothing reads it: a call or attribute fetch with no effect."""
    return node.op in ("call_function", "call_method", "call_module", "get_attr") and not effects(node, gm)
