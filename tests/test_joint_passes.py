"""The joint graph's rewrites (fxopt.passes.JOINT_PASSES) keep every value bitwise, and leave what they must not touch."""
from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fxopt.passes.base import TRAINING, PassContext
from fxopt.passes.dropout_from_mask import DropoutFromMask
from fxopt.passes.pointwise_before_expand import PointwiseBeforeExpand

aten = torch.ops.aten
CONTEXT = PassContext(TRAINING, aot_autograd_next=True)


def _rewritten(fn, pass_, *inputs):
    """`fn` traced to ATen ops (fake values in meta), then rewritten by `pass_`: (graph module, pass result)."""
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    result = pass_.run(gm, CONTEXT)
    gm.graph.lint()
    gm.recompile()
    return gm, result


def _dropout_then_scale(x):
    out, mask = aten.native_dropout.default(x, 0.3, True)
    return out * 2.0, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_dropout_read_from_its_mask_is_bitwise_eagers(dtype):
    """A train-mode dropout's output, read as x * mask / (1 - p), has eager's bits (same seed, same mask)."""
    x = torch.randn(64, 33, dtype=dtype)
    gm, result = _rewritten(_dropout_then_scale, DropoutFromMask(), x)
    assert [s.action for s in result.sites] == ["read_from_mask"]
    torch.manual_seed(0)
    expected = _dropout_then_scale(x)
    torch.manual_seed(0)
    got = gm(x)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_an_eval_mode_dropout_is_left_alone():
    """A dropout with train=False returns its input: nothing to read from a mask, the graph is unchanged."""
    gm, result = _rewritten(lambda x: aten.native_dropout.default(x, 0.3, False)[0] * 2.0, DropoutFromMask(),
                            torch.randn(8, 8))
    assert not result.sites


def _mean_gradient_times(g, x):
    return aten.div.Scalar(aten.expand.default(g, [16, 32]), 512) * x


def test_a_mean_gradient_divided_before_its_expand_is_bitwise_the_same():
    """expand(g) / n becomes expand(g / n): the same value in every element, and no full-size temporary."""
    g, x = torch.randn(1, 1), torch.randn(16, 32)
    gm, result = _rewritten(_mean_gradient_times, PointwiseBeforeExpand(), g, x)
    assert [s.action for s in result.sites] == ["computed_before_expand"]
    divide = next(n for n in gm.graph.nodes if n.target is aten.div.Scalar)
    assert divide.args[0].op == "placeholder"  # it divides the small tensor now
    assert torch.equal(gm(g, x), _mean_gradient_times(g, x))


def test_an_expanded_value_a_reduction_reads_is_left_alone():
    """Where a reader is not a pointwise op of a full-size tensor (a sum), what it returns could change: no rewrite."""
    gm, result = _rewritten(lambda g: aten.div.Scalar(aten.expand.default(g, [16, 32]), 512).sum(),
                            PointwiseBeforeExpand(), torch.randn(1, 1))
    assert not result.sites
