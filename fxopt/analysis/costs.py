"""What a graph costs, estimated on fake tensors: FLOPs and the bytes autograd keeps for backward.

`estimate_costs(gm, example_inputs, training)` runs the graph once on FakeTensors (no real
compute, no real memory; parameters and buffers are swapped for fake copies, so the caller's
tensors, their `.grad` and BatchNorm running statistics are never touched) under
`torch.utils.flop_counter.FlopCounterMode`. In training it also runs backward, and counts
what autograd saves for backward through `saved_tensors_hooks`, each storage once,
parameters and buffers excluded: the fake-tensor counterpart of `fxopt.measure`.

Because it watches what autograd really records, it sees through any rewrite a pass makes:
a ReLU that saves a bool mask, a checkpointed region (whose tensors are not kept), a custom
autograd function that saves less. A graph that cannot run on fake tensors (an opaque leaf
that branches on tensor values) has no estimate: `None`.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode

from .. import _torch_private
from ..tree import flatten_tensors


@dataclasses.dataclass(frozen=True)
class Costs:
    flops: int  # forward, plus backward in training
    saved_bytes: int | None  # kept for backward at the end of forward; None in inference (nothing is kept)


def fake_call_arguments(gm: fx.GraphModule, example_inputs: tuple):
    """(fake mode, fake parameters and buffers by name, fake inputs) to run `gm` with `functional_call`.

    Inputs already fake (the placeholders' `node.meta["val"]`) keep their mode.
    """
    mode = _torch_private.detect_fake_mode(example_inputs) or _torch_private.fake_tensor_mode()
    state = {name: mode.from_tensor(t)
             for name, t in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]}
    inputs = tuple(mode.from_tensor(x) if isinstance(x, torch.Tensor) and not _torch_private.is_fake(x) else x
                   for x in example_inputs)
    return mode, state, inputs


def estimate_costs(gm: fx.GraphModule, example_inputs: tuple, training: bool) -> Costs | None:
    """FLOPs and saved-for-backward bytes of one call of `gm` (one step in training), or None.

    `example_inputs` may be real tensors or fake ones (e.g. the placeholders' `node.meta["val"]`).
    """
    return _fake_step(gm, example_inputs, training, count_flops=True)


def estimate_saved_bytes(gm: fx.GraphModule, example_inputs: tuple) -> int | None:
    """The bytes a training step of `gm` keeps for backward, or None: `estimate_costs` without its
    FLOP count, so without the backward run (autograd has saved everything by the end of forward)."""
    costs = _fake_step(gm, example_inputs, training=True, count_flops=False)
    return None if costs is None else costs.saved_bytes


def _fake_step(gm: fx.GraphModule, example_inputs: tuple, training: bool, count_flops: bool) -> Costs | None:
    mode, state, inputs = fake_call_arguments(gm, example_inputs)
    excluded = {_torch_private.untyped_storage_key(t) for t in state.values()}
    saved: dict[int, int] = {}
    keep_alive = []  # storage keys are only unique while the storage lives

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep_alive.append(t)
        key = _torch_private.untyped_storage_key(t)
        if key not in excluded:
            saved[key] = t.untyped_storage().nbytes()
        return t

    # A checkpointed region recomputes in backward, after functional_call has put the real
    # parameters back: its fake gradients would land on them. Their `.grad` is restored below.
    real_grads = [(p, p.grad) for p in gm.parameters()]
    try:
        counter = FlopCounterMode(display=False) if count_flops else contextlib.nullcontext()
        with torch.random.fork_rng(devices=[]), mode, counter, torch.set_grad_enabled(training):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                outputs = torch.func.functional_call(gm, state, inputs)
            differentiable = [o for o in flatten_tensors(outputs) if o.requires_grad]
            if training and differentiable and count_flops:
                torch.autograd.backward(differentiable, [torch.ones_like(o) for o in differentiable])
    except Exception:  # noqa: BLE001 - data-dependent code cannot run on fake tensors: no estimate
        return None
    finally:
        for p, grad in real_grads:
            p.grad = grad
    return Costs(counter.get_total_flops() if count_flops else 0, sum(saved.values()) if training else None)


def placeholder_values(gm: fx.GraphModule) -> tuple:
    """The example values shape propagation stored on `gm`'s placeholders (fake tensors or constants)."""
    return tuple(n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder"))
