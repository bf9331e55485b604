"""What an op keeps for its backward and allocates in it, measured by running it once, where no rule can say.

fxopt.analysis.saved_tensors' table and fxopt.analysis.backward_temporaries' rules follow ATen's formulas. Some calls
have no formula: an op declared opaque (fxopt.graph_functions) runs code fxopt does not read; `scaled_dot_product_attention` keeps what the kernel
torch picks at run time keeps (on CPU the flash kernel its inputs, output and log-sum-exp; the math path, taken with
dropout or a mask that needs a gradient, the sequence-square attention weights and the dropout mask too; on CUDA the
flash, memory-efficient and cuDNN kernels each something else); an op the table does not know may keep anything.
A guess (its inputs and output kept, nothing allocated in its backward) misses both ways: a Function keeping its
input alone and making temporaries in its backward (HF BLOOM's GELU), attention keeping sequence-square weights.

`measured_call(node, requires_grad)` runs such a node once on real tensors shaped, strided and placed like its
inputs (ones; fxopt.analysis.replayed_calls), the inputs it is told need a gradient requiring one, under
saved-tensor hooks: which of its inputs and outputs it keeps, and the bytes of the other tensors it keeps; then its
backward from gradients of ones under the allocator's profiler: the most it holds beyond the gradients it returns.
The cache key is everything that picks the kernel: the target, each argument (a tensor by shape, strides, dtype and
device, so an attention mask's kind and broadcast shape; dropout_p, is_causal, scale, enable_gqa as given), which
inputs need a gradient, and the intra-op thread count. What the op draws from torch's, Python's and NumPy's
generators is put back. None where it cannot be run so (a device this process cannot use, a fake-only or symbolic
argument, an error, a torch profiler already recording).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection

import torch
import torch.fx as fx

from .. import _torch_private
from ..graph_functions import declared
from ..tree import tensors_in
from .replayed_calls import NotReplayable, call_input_nodes, call_spec, real_call, replaying


@dataclasses.dataclass(frozen=True)
class OpaqueMemory:
    saved_inputs: tuple[int, ...]  # positions, among the node's tensor inputs (call_input_nodes), of those it keeps
    saves_output: bool  # keeps one of its outputs
    private_bytes: int  # bytes of the other tensors it keeps
    backward_scratch: int  # the most its backward holds beyond the gradients it returns
    autograd_nodes: int = 1  # the backward nodes autograd records for it: more than one where it runs as several ops
    # (attention's math path: its products, softmax and dropout), each of which a selective checkpoint policy sees


@functools.lru_cache(maxsize=512)
def _measured(target, spec: tuple, grads: tuple[bool, ...], threads: int) -> OpaqueMemory | None:
    """`measured_call` for one call (module docstring); `grads`: per tensor input, whether it needs a gradient;
    `threads`: the intra-op thread count it ran at. The backward runs as in a step, freeing what the op kept as it
    goes (a math-path attention's dropout mask before its score gradients exist), so its scratch is its peak over
    what the op kept, less the gradients it returns."""
    storage = _torch_private.untyped_storage_key
    with replaying(spec), torch.enable_grad():
        args, kwargs = real_call(spec)
        inputs = tensors_in((args, list(kwargs.values())))  # in call_input_nodes' order
        for t, grad in zip(inputs, grads):
            t.requires_grad_(grad and (t.is_floating_point() or t.is_complex()))
        saved: list[torch.Tensor] = []
        try:  # one profile: the allocator warns on stderr when it frees a block made before the profile began
            with _torch_private.allocation_profile() as prof:
                with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                    outputs = tensors_in(target(*args, **kwargs))
                inputs_at = {storage(t): i for i, t in enumerate(inputs)}
                outputs_at = {storage(o) for o in outputs}
                kept = {storage(t): t.untyped_storage().nbytes() for t in saved}
                del saved  # autograd alone holds them now, and frees each once its backward has run
                differentiable = [o for o in outputs if o.requires_grad]
                recorded = _recorded_nodes(differentiable)
                seeds = [torch.ones_like(o) for o in differentiable]
                marker = torch.empty(_MARKER_BYTES, dtype=torch.uint8)  # where the backward begins, in the events
                wanted = [t for t in inputs if t.requires_grad]
                if differentiable and wanted:  # the gradients as autograd hands them on, not as `.grad` keeps them
                    grads = torch.autograd.grad(differentiable, wanted, seeds, allow_unused=True)
                else:
                    grads = ()
        except Exception:  # noqa: BLE001 - the call cannot be replayed on such tensors: not measured
            return None
        returned = sum(g.untyped_storage().nbytes() for g in {storage(g): g for g in grads if g is not None}.values())
    return OpaqueMemory(
        saved_inputs=tuple(sorted(inputs_at[k] for k in kept if k in inputs_at)),
        saves_output=any(k in outputs_at for k in kept),
        private_bytes=sum(n for k, n in kept.items() if k not in inputs_at and k not in outputs_at),
        backward_scratch=max(0, _peak_after(prof, marker.data_ptr()) - returned), autograd_nodes=recorded)


def _recorded_nodes(outputs: list[torch.Tensor]) -> int:
    """How many backward nodes autograd recorded from `outputs` back to the leaves (gradient accumulators aside)."""
    seen, pending = set(), [o.grad_fn for o in outputs if o.grad_fn is not None]
    while pending:
        fn = pending.pop()
        if fn is None or fn in seen or type(fn).__name__ == "AccumulateGrad":
            continue
        seen.add(fn)
        pending.extend(next_fn for next_fn, _ in fn.next_functions)
    return len(seen)


_MARKER_BYTES = 4099  # a size no tensor of the measured op has


def _peak_after(prof, address: int) -> int:
    """The most bytes allocated at once, beyond what was, after the marker allocation at `address`."""
    events = _torch_private.profiler_allocations(prof)
    begin = next(i for i, (_, ptr, n) in enumerate(events) if ptr == address and n == _MARKER_BYTES)
    live = peak = 0
    for _, _, nbytes in events[begin + 1:]:
        live += nbytes
        peak = max(peak, live)
    return peak


def measured_call(node: fx.Node, requires_grad: Collection[fx.Node] | None = None) -> OpaqueMemory | None:
    """What call_function `node` keeps and its backward allocates, measured (module docstring); None where it is not
    measured. `requires_grad`: the inputs that need a gradient (fxopt.analysis.grad_needs); None: every floating one.
    """
    if node.op != "call_function" or _torch_private.profiler_running():
        return None
    try:
        spec = call_spec(node, any_device=True)
    except NotReplayable:
        return None
    grads = tuple(requires_grad is None or n in requires_grad for n in call_input_nodes(node))
    return _measured(node.target, spec, grads, torch.get_num_threads())


def measured(node: fx.Node, requires_grad: Collection[fx.Node] | None = None) -> OpaqueMemory | None:
    """What opaque `node` (a graph helper declared opaque) keeps and its backward allocates, None for any other node
    or where it is not measured."""
    helper = declared(node.target) if node.op == "call_function" else None
    if helper is None or not helper.opaque:
        return None
    return measured_call(node, requires_grad)
