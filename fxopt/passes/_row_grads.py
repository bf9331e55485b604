"""`embedding_row_grads(weight, indices, padding_idx, scale_grad_by_freq)`: a lookup whose weight gradient is the
rows it read.

ATen's embedding backward makes a dense gradient the size of the whole weight, zero outside the rows the lookup read.
Where autograd adds that gradient to another one of the same weight (a tied weight: BART's encoder and decoder
embeddings, GPT-2's lookup and its LM head), the two dense gradients are alive at once. This lookup hands back a
sparse COO gradient instead: one row per distinct index read. Autograd's input buffer adds it in place into the dense
gradient it meets (`dense.add_(sparse)`), so the weight's summed gradient is the only dense one.

The values are bit for bit ATen's: each row is `embedding_dense_backward` of the same incoming gradient, with the
indices renumbered onto the distinct rows in the same order, so each row adds the same terms in the same order from
zero; adding a sparse row into a dense one is the same one addition per element as adding the dense rows, and rows
a dense zero-filled gradient would have added `+0.0` to are left as they are (a sum that starts at `+0.0` is never
`-0.0`, so no bit differs; `tests/test_tied_embedding_grads.py`). Under `create_graph=True` (grad mode on in
backward) it returns ATen's dense gradient. Alone (no dense gradient of the weight to meet) it would leave `.grad`
sparse: fxopt.passes.tied_embedding_grads puts it only where a dense gradient of the weight comes in the same
backward.
"""
from __future__ import annotations

import torch

from ..graph_functions import graph_function


class _EmbeddingRowGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: torch.Tensor, indices: torch.Tensor, padding_idx: int, by_frequency: bool) -> torch.Tensor:
        ctx.save_for_backward(indices)
        ctx.padding_idx, ctx.by_frequency, ctx.weight_shape = padding_idx, by_frequency, weight.shape
        return torch.ops.aten.embedding(weight, indices, padding_idx, by_frequency)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (indices,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # double backward: ATen's own, differentiable
            return torch.ops.aten.embedding_dense_backward(grad, indices, ctx.weight_shape[0], ctx.padding_idx,
                                                           ctx.by_frequency), None, None, None
        rows, renumbered = torch.unique(indices, sorted=True, return_inverse=True)
        padding = -1
        if ctx.padding_idx >= 0:
            hit = torch.searchsorted(rows, ctx.padding_idx)
            padding = int(hit) if int(hit) < rows.numel() and int(rows[hit]) == ctx.padding_idx else -1
        values = torch.ops.aten.embedding_dense_backward(grad, renumbered, rows.numel(), padding, ctx.by_frequency)
        return torch.sparse_coo_tensor(rows.unsqueeze(0), values, ctx.weight_shape, is_coalesced=True,
                                       check_invariants=False), None, None, None


def row_gradient_bytes(node) -> int:
    """Bytes of the sparse gradient a lookup node makes, at most: one row and one index per index read."""
    weight, indices = (a.meta["val"] for a in node.args[:2])
    rows = min(indices.numel(), weight.shape[0])
    return rows * (weight.numel() // max(weight.shape[0], 1) * weight.element_size() + 8)


@graph_function(name="embedding", weight_gradient=row_gradient_bytes)
def embedding_row_grads(weight: torch.Tensor, indices: torch.Tensor, padding_idx: int = -1,
                        scale_grad_by_freq: bool = False) -> torch.Tensor:
    return _EmbeddingRowGrads.apply(weight, indices, padding_idx, scale_grad_by_freq)
