"""Give a traced graph's result back the type the module returned.

torch.fx records a dict subclass returned by forward (Hugging Face's `ModelOutput`, an
`OrderedDict`) as a plain dict, so `out.last_hidden_state` and `out[0]` stop working on the
optimized model. Passes see the plain dict (its keys are what `differentiable_outputs` names);
after the last pass, `restore_output_type` wraps the graph's result in one `as_output_type`
call that rebuilds the original type, named by its import path. A type that cannot be
imported back by name (a class defined inside a function) leaves the result a dict.
"""
from __future__ import annotations

import torch.fx as fx

from ..analysis.side_effects import import_by_name, importable_name
from ..graph_functions import graph_function


@graph_function
def as_output_type(type_name: str, mapping: dict):
    """Rebuild a dict-like module output of the type at `type_name` from its items."""
    return import_by_name(type_name)(**mapping)


def output_type_name(output) -> str | None:
    """The import path of `output`'s type when tracing would lose it (a dict subclass), else None."""
    cls = type(output)
    if cls is dict or not isinstance(output, dict):
        return None
    return importable_name(cls)


def restore_output_type(gm: fx.GraphModule, type_name: str | None) -> None:
    """Wrap `gm`'s dict result in `as_output_type(type_name, ...)` (see module docstring)."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    if type_name is None or not isinstance(output.args[0], dict):
        return
    with gm.graph.inserting_before(output):
        rebuilt = gm.graph.call_function(as_output_type, (type_name, output.args[0]))
    output.args = (rebuilt,)
    gm.recompile()
