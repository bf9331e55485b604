"""Name a graph node by the module that computed it: `encoder.layer.3.attention.self.query`.

TorchDynamo (and torch.export) record, on every node, the stack of modules that were running when the
op was recorded (`node.meta["nn_module_stack"]`: key -> (module path, module type), outermost first);
the ATen trace of a Dynamo graph keeps it. Dynamo writes a path as the Python source it read the module
from (`L['self'].encoder.layer[3]`, `L['fn']._modules['conv']`); reports name sites by the innermost
module's path in the user's model (`encoder.layer.3`), which is what a user reads in their code.
"""
from __future__ import annotations

import re

import torch.fx as fx

_DYNAMO_ROOT = re.compile(r"^L\['[^']+'\]")  # the frame's local the model came from: `L['self']`, `L['fn']`
_DYNAMO_STEP = re.compile(
    r"\.__dict__\['_(?:modules|parameters|buffers)'\]\['([^']+)'\]"  # a module read past its __getattr__ (Swin)
    r"|\._(?:modules|parameters|buffers)\['([^']+)'\]|\[(\d+)\]|\['([^']+)'\]"
)

_EXPORT_PLACEHOLDER_ENTRY = "_empty_nn_module_stack"  # export's entry for nodes it made outside any module


def module_path(node: fx.Node) -> str | None:
    """The path of the innermost module that computed `node` ("" = the model itself), or None without the meta."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    paths = [path for path, _ in stack.values() if not path.startswith(_EXPORT_PLACEHOLDER_ENTRY)]
    return model_path(paths[-1]) if paths else ""


def model_path(path: str) -> str:
    """A module's, parameter's or buffer's path in the model from Dynamo's source for it
    (`L['self']._modules['head']._parameters['bias']` is `head.bias`); an export path is returned as it is."""
    if not _DYNAMO_ROOT.match(path):
        return path
    steps = _DYNAMO_STEP.sub(lambda m: "." + next(g for g in m.groups() if g is not None), _DYNAMO_ROOT.sub("", path))
    return steps.lstrip(".")
