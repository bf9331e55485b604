"""Make a traced GraphModule stand in for the module it was traced from.

A GraphModule holds only what its graph reads, registers submodules in the order the graph
first uses them and every tensor it reads as a persistent buffer. The caller's code, optimizer
and checkpoints expect the module they wrote: the same parameters and buffers under the same
`state_dict()` keys, in the same order, and the plain attributes (`config`, `stride`) that code
around the module may read.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import _torch_private


def stand_in_for(original: torch.nn.Module, gm: fx.GraphModule) -> None:
    """Give `gm` the state, order, persistence and plain attributes of `original` (see module docstring)."""
    _carry_unused_state(original, gm)
    _match_order(original, gm)
    _match_persistence(original, gm)
    _keep_plain_attributes(original, gm)
    _match_training_flags(original, gm)


def _carry_unused_state(root: torch.nn.Module, gm: fx.GraphModule) -> None:
    """Give `gm` every parameter and buffer of `root` it does not reference, so state_dict keys match."""
    have = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    have |= {n for n, _ in gm.named_buffers(remove_duplicate=False)}
    for name, tensor in [*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)]:
        if name in have:
            continue
        *parents, attr = name.split(".")
        src_owner, dst_owner = root, gm
        for part in parents:
            src_owner = getattr(src_owner, part)
            if not hasattr(dst_owner, part):
                dst_owner.add_module(part, torch.nn.Module())
            dst_owner = getattr(dst_owner, part)
        if isinstance(tensor, torch.nn.Parameter):
            dst_owner.register_parameter(attr, tensor)
        else:
            dst_owner.register_buffer(attr, tensor, persistent=attr not in src_owner._non_persistent_buffers_set)


def _match_order(original: torch.nn.Module, stand_in: torch.nn.Module) -> None:
    """Order `stand_in`'s children, parameters and buffers as in `original`, recursively.

    A GraphModule registers submodules in the order the graph first uses them; parameters()
    and state_dict() order must match the caller's model so optimizer state (kept by index)
    moves between the two.
    """
    for slot in ("_modules", "_parameters", "_buffers"):
        mine, theirs = getattr(stand_in, slot), getattr(original, slot)
        ordered = [k for k in theirs if k in mine] + [k for k in mine if k not in theirs]
        reordered = {k: mine[k] for k in ordered}
        mine.clear()
        mine.update(reordered)
    for name, child in stand_in._modules.items():
        if name in original._modules and child is not original._modules[name] and child is not None:
            _match_order(original._modules[name], child)


def _match_persistence(original: torch.nn.Module, gm: fx.GraphModule) -> None:
    """Keep out of state_dict() every buffer the caller's module keeps out, and tracing's constants (`_tensor_constant0`).

    A GraphModule registers every tensor its graph reads as a persistent buffer.
    """
    saved = _persistent_names(original)
    hidden = [name for name, _ in gm.named_buffers(remove_duplicate=False) if name not in saved]
    if hidden:
        _torch_private.make_buffers_non_persistent(gm, hidden)


def _persistent_names(module: torch.nn.Module) -> set[str]:
    """The parameter and buffer names `module.state_dict()` would hold, without calling it: state_dict hooks
    run (FSDP2's frees the unsharded parameters the graph is about to read)."""
    names = set()
    for path, m in module.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        names.update(prefix + k for k, v in m._parameters.items() if v is not None)
        names.update(prefix + k for k, v in m._buffers.items() if v is not None and k not in m._non_persistent_buffers_set)
    return names


def _keep_plain_attributes(original: torch.nn.Module, gm: fx.GraphModule) -> None:
    """Give `gm` the plain attributes of `original` (`config`, `stride`, ...) that code around it may read."""
    attributes = {name: value for name, value in vars(original).items()
                  if not name.startswith("_") and name != "training" and not hasattr(gm, name)}
    _torch_private.preserve_graph_module_attributes(gm, attributes)


def _match_training_flags(original: torch.nn.Module, gm: fx.GraphModule) -> None:
    """Give each module of `gm` the train/eval flag of the module at the same path in `original`.

    Export rebuilds the module tree out of plain `nn.Module` containers, all in training mode.
    """
    modules = dict(original.named_modules())
    for path, module in gm.named_modules():
        if path in modules:
            module.training = modules[path].training
