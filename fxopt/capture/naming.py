"""Name a graph node by the module that computed it: `encoder.layer.3.attention.self.query`.

torch.export records, on every node, the stack of modules that were running when the op was
recorded (`node.meta["nn_module_stack"]`: key -> (module path, module type), outermost
first). Reports name sites by the innermost path, which is what a user reads in their model.
"""
from __future__ import annotations

import torch.fx as fx

_EXPORT_PLACEHOLDER_ENTRY = "_empty_nn_module_stack"  # export's entry for nodes it made outside any module


def module_path(node: fx.Node) -> str | None:
    """The path of the innermost module that computed `node` ("" = the model itself), or None without the meta."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    paths = [path for path, _ in stack.values() if not path.startswith(_EXPORT_PLACEHOLDER_ENTRY)]
    return paths[-1] if paths else ""
