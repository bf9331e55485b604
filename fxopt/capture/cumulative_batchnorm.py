"""Export a train-mode BatchNorm with `momentum=None` (cumulative moving average).

Such a BatchNorm computes its averaging factor as `1.0 / float(num_batches_tracked)`: a Python
float read from a buffer's value, on which `torch.export` fails with a data-dependent guard
(`GuardOnDataDependentSymNode`), so the whole model could not be exported. While exporting,
`traceable_cumulative_batchnorm` gives each such module (the instance, for the duration of the
export) a forward that computes the same thing with tensor ops: the batch normalized with
`F.batch_norm` without running statistics (which autograd would save and the update below
overwrite), then
`running = f * batch_stat + (1 - f) * running` with `f = 1 / num_batches_tracked` as a tensor —
the formula of ATen's batch-norm update, in float64 like ATen's `double` momentum, with the
unbiased batch variance as ATen uses. The graph so reads the counter at every call, as eager does.

The new statistics are written the way eager writes them: by ATen's batch norm (momentum 1 on a
two-row batch whose mean and unbiased variance are the new values), not by `copy_`. ATen's update
leaves the buffers' version counters alone, a `copy_` bumps them, and another batch norm that saved
the same buffers for backward (a functional `F.batch_norm` on this module's statistics) would then
fail in backward with "modified by an inplace operation" where eager runs (fuzz seeds 60060570,
62081370).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def _uses_cumulative_average(module: torch.nn.Module) -> bool:
    return (isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
            and not isinstance(module, torch.nn.SyncBatchNorm)
            and type(module).forward is torch.nn.modules.batchnorm._BatchNorm.forward
            and module.momentum is None and module.training and module.track_running_stats
            and module.num_batches_tracked is not None)


def _cumulative_average_forward(bn: torch.nn.modules.batchnorm._BatchNorm):
    def forward(input: torch.Tensor) -> torch.Tensor:
        bn._check_input_dim(input)
        bn.num_batches_tracked.add_(1)
        output = F.batch_norm(input, None, None, bn.weight, bn.bias, True, 0.0, bn.eps)
        factor = 1.0 / bn.num_batches_tracked.double()
        batch_dims = [d for d in range(input.dim()) if d != 1]
        var, mean = torch.var_mean(input.detach().double(), dim=batch_dims, correction=1)
        new_mean = factor * mean + (1 - factor) * bn.running_mean.double()
        new_var = factor * var + (1 - factor) * bn.running_var.double()
        _write_statistics(bn.running_mean, bn.running_var, new_mean, new_var)
        return output
    return forward


def _write_statistics(running_mean: torch.Tensor, running_var: torch.Tensor, mean: torch.Tensor,
                      var: torch.Tensor) -> None:
    """running_mean, running_var <- mean, var, through ATen's batch-norm update (no version bump; see above)."""
    half_spread = (var / 2).sqrt()  # rows mean +- half_spread: mean `mean`, unbiased variance 2 * half_spread**2
    rows = torch.stack([mean + half_spread, mean - half_spread]).to(running_mean.dtype)
    F.batch_norm(rows, running_mean, running_var, None, None, True, 1.0, 1e-5)


@contextlib.contextmanager
def traceable_cumulative_batchnorm(model: torch.nn.Module):
    """Within: each train-mode `momentum=None` BatchNorm of `model` runs the traceable forward above."""
    patched = [m for m in model.modules() if _uses_cumulative_average(m)]
    for m in patched:
        m.forward = _cumulative_average_forward(m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward
