"""What an opaque op keeps for its backward and allocates in it, measured by running it once.

fxopt.analysis.saved_tensors' table and fxopt.analysis.backward_temporaries' rules follow ATen's formulas. An op
declared opaque (fxopt.graph_functions) runs code
fxopt does not read. Taken to keep its inputs and output and to allocate nothing in its backward, HF BLOOM's GELU
(which keeps its input alone and makes four input-sized temporaries in its backward) left BLOOM's measured step
peak 14-21% above the estimate at budgets 0.8 and 0.5 (6 layers, 384 wide, batch 8 x 128); measured, 3-5% below.
`measured(node)` runs such a node once on real tensors shaped like its inputs (ones), under saved-tensor
hooks: which of its inputs and outputs it keeps, and the bytes of the other tensors it keeps; then its backward
from gradients of ones under the allocator's profiler: the most it holds beyond the gradients it returns. Every
floating input requires a gradient, as for the saved-tensors table (fxopt.analysis.saved_tensors: with some
frozen, an op may keep less). Cached per call (target, arguments, shapes, strides, dtypes, thread count). What
the op draws from torch's, Python's and NumPy's generators is put back. None where it cannot be run so (not on
CPU, a fake-only argument, an error, a torch profiler already recording).
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.fx as fx

from .. import _torch_private
from ..graph_functions import declared
from ..host_rng import forked_host_rng
from ..tree import tensors_in
from .replayed_calls import NotReplayable, argument_spec, real_argument


@dataclasses.dataclass(frozen=True)
class OpaqueMemory:
    saved_inputs: tuple[int, ...]  # positions, among the node's tensor inputs in argument order, of those it keeps
    saves_output: bool  # keeps one of its outputs
    private_bytes: int  # bytes of the other tensors it keeps
    backward_scratch: int  # the most its backward holds beyond the gradients it returns


@functools.lru_cache(maxsize=256)
def _measured(target, args: tuple, threads: int) -> OpaqueMemory | None:
    """`measured` for one call (module docstring); `threads`: the intra-op thread count it ran at."""
    with _torch_private.unset_fake_mode(), torch.enable_grad(), torch.random.fork_rng(devices=[]), forked_host_rng():
        real_args = real_argument(args)
        inputs = tensors_in(real_args)  # in argument order
        for t in inputs:
            t.requires_grad_(t.is_floating_point() or t.is_complex())
        saved: list[torch.Tensor] = []
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                outputs = tensors_in(target(*real_args))
            differentiable = [o for o in outputs if o.requires_grad]
            seeds = [torch.ones_like(o) for o in differentiable]
            with _torch_private.allocation_profile() as prof:
                if differentiable:
                    torch.autograd.backward(differentiable, seeds)
        except Exception:  # noqa: BLE001 - the call cannot be replayed on such tensors: not measured
            return None
    peak, returned = _torch_private.allocation_peak(prof)
    storage = _torch_private.untyped_storage_key
    inputs_at = {storage(t): i for i, t in enumerate(inputs)}
    outputs_at = {storage(o) for o in outputs}
    kept = {storage(t): t for t in saved}
    return OpaqueMemory(
        saved_inputs=tuple(sorted(inputs_at[k] for k in kept if k in inputs_at)),
        saves_output=any(k in outputs_at for k in kept),
        private_bytes=sum(t.untyped_storage().nbytes() for k, t in kept.items()
                          if k not in inputs_at and k not in outputs_at),
        backward_scratch=max(0, peak - returned))


def measured(node: fx.Node) -> OpaqueMemory | None:
    """What opaque `node` keeps and its backward allocates (module docstring), None for any other node or where
    it is not measured."""
    helper = declared(node.target) if node.op == "call_function" else None
    if helper is None or not helper.opaque or node.kwargs or _torch_private.profiler_running():
        return None
    try:
        args = argument_spec(tuple(node.args))
    except NotReplayable:
        return None
    return _measured(node.target, args, torch.get_num_threads())
