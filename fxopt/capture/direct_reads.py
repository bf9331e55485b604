"""Read a graph's parameters and buffers through the module dicts instead of `nn.Module.__getattr__`.

torch.fx writes a `get_attr` of `encoder.layer.0.dense.weight` as `self.encoder.layer...weight`
(with `getattr(..., "0")` for numbered children): five or six Python-level `nn.Module.__getattr__`
calls per tensor, every call. On a small model that is a sixth of the forward (ConvNeXt with two
blocks: 177 of 1115 µs). The same read through the dicts that `__getattr__` itself searches,
`self._modules['encoder']._modules['layer']..._parameters['weight']`, costs a few dict lookups.

It reads the same objects at every call: a tensor replaced later (`.to()`, `load_state_dict`) is read
anew. Only paths where the dict entry is what `getattr` gives now are rewritten; if the module tree
changes so that one no longer exists, the call raises a KeyError instead of reading something else.
`gm.code` keeps torch.fx's readable text; only the compiled `forward` changes, line for line. The
faster code lasts until the GraphModule's next recompile (a deep copy and a load re-apply it).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import _torch_private


def _attribute_expression(gm: fx.GraphModule, target: str) -> str | None:
    """`self._modules[...]..._parameters[...]` for `target`, or None where a dict entry is not what getattr gives."""
    *path, leaf = target.split(".")
    if not path:  # `self.name`: one `__getattr__`, kept as torch.fx writes it
        return None
    owner, expression = gm, "self"
    for name in path:
        child = owner._modules.get(name) if isinstance(owner, torch.nn.Module) else None
        if child is None or getattr(owner, name) is not child:
            return None
        owner, expression = child, f"{expression}._modules[{name!r}]"
    for table in ("_parameters", "_buffers"):
        entries = getattr(owner, table, {})
        if leaf in entries and entries[leaf] is not None and getattr(owner, leaf) is entries[leaf]:
            return f"{expression}.{table}[{leaf!r}]"
    return None


def read_attributes_directly(gm: fx.GraphModule) -> int:
    """Regenerate `gm.forward` with dict reads for its parameters and buffers; returns how many reads changed."""
    code = gm.graph.python_code(root_module="self")
    lines = code.src.split("\n")
    index = {line.strip(): i for i, line in enumerate(lines)}
    changed = 0
    for node in gm.graph.find_nodes(op="get_attr"):
        as_written = _torch_private.fx_attribute_expression("self", node.target)
        position = index.get(f"{node.name} = {as_written}")
        expression = _attribute_expression(gm, node.target)
        if position is not None and expression is not None:
            indent = lines[position][:len(lines[position]) - len(lines[position].lstrip())]
            lines[position] = f"{indent}{node.name} = {expression}"
            changed += 1
    if changed:
        _torch_private.replace_forward_source(gm, "\n".join(lines), code.globals)
        _torch_private.add_deepcopy_hook(gm, read_attributes_directly)
    return changed
