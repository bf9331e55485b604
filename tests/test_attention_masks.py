"""capture drops the all-True and causal attention masks tracing makes models build (fxopt/capture/attention_masks.py)."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxopt


class Attention(nn.Module):
    """SDPA with a mask built as `kind` says: all True, causal or a band from constants, or from an input."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.proj = nn.Linear(8, 24)

    def forward(self, x, keep=None):
        q, k, v = self.proj(x).unsqueeze(1).chunk(3, dim=-1)
        n = x.shape[1]
        if self.kind == "input":
            mask = keep[:, None, None, :].expand(x.shape[0], 1, n, n)
        else:
            positions = torch.arange(n)
            allowed = {"all_true": positions >= 0, "causal": positions[None, :] <= positions[:, None],
                       "causal_broadcast": (own := torch.arange(n)) <= own[:, None],  # arange read twice
                       "band": (positions[None, :] - positions[:, None]).abs() <= 1}[self.kind]
            mask = allowed.expand(x.shape[0], 1, n, n)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_ANY_SDPA = (_SDPA, F.scaled_dot_product_attention)  # ATen's, or torch's in a graph left as Dynamo captured it


def _mask(sdpa):
    return sdpa.args[3] if len(sdpa.args) > 3 else sdpa.kwargs.get("attn_mask")


def _optimize(kind: str, mode: str):
    model = Attention(kind).double().train(mode == "training")
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    args = (x, torch.tensor([[True] * 4 + [False]] * 2)) if kind == "input" else (x,)
    return model, args, fxopt.optimize(model, args, mode=mode)


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_all_true_constant_mask_is_dropped_and_the_result_is_unchanged(mode):
    """A mask built from constants alone that is all True masks nothing: the graph calls SDPA without it."""
    model, args, optimized = _optimize("all_true", mode)
    graph = optimized.graph_module.graph
    assert [_mask(n) for n in graph.nodes if n.target is _SDPA] == [None]
    assert not [n for n in graph.nodes if n.target in (torch.ops.aten.arange.default, torch.ops.aten.ge.Scalar)]
    torch.testing.assert_close(optimized(*args), model(*args), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_causal_constant_mask_becomes_is_causal_and_the_result_is_unchanged(mode):
    """A constant lower-triangular mask is what is_causal=True applies: the graph calls SDPA causal, without it, as eager would."""
    model, args, optimized = _optimize("causal", mode)
    (sdpa,) = [n for n in optimized.graph_module.graph.nodes if n.target is _SDPA]
    assert _mask(sdpa) is None and (sdpa.args[5] if len(sdpa.args) > 5 else sdpa.kwargs["is_causal"]) is True
    if mode == "training":
        reference = copy.deepcopy(model)
        x = args[0].clone().requires_grad_()
        ref_x = args[0].clone().requires_grad_()
        optimized(x).sum().backward()
        reference(ref_x).sum().backward()
        torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-12, atol=1e-12)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(optimized(*args), model(*args), rtol=1e-12, atol=1e-12)


def test_a_mask_reading_one_constant_twice_is_erased_once():
    """A causal mask that reads `arange` both directly and through a view is dropped without erasing a node twice
    (torch.fx warns at the second erase)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, args, optimized = _optimize("causal_broadcast", "inference")
    assert not [w for w in caught if "erase_node" in str(w.message)]
    assert [_mask(n) for n in optimized.graph_module.graph.nodes if n.target is _SDPA] == [None]
    torch.testing.assert_close(optimized(*args), model(*args), rtol=1e-12, atol=1e-12)


def test_a_mask_built_from_a_dynamic_length_is_kept():
    """Once a new length makes Dynamo's graph dynamic, the causal mask is built from a symbolic size, no constant:
    it stays, and every length computes eager's outputs."""
    model, args, optimized = _optimize("causal", "inference")
    for n in (7, 9):
        x = torch.randn(2, n, 8, dtype=torch.float64)
        torch.testing.assert_close(optimized(x), model(x), rtol=1e-12, atol=1e-12)
    dynamic = optimized.graph_modules[-1]
    assert optimized.fxopt_report.dynamic_sizes
    assert [_mask(n) is not None for n in dynamic.graph.nodes if n.target is _SDPA] == [True]


@pytest.mark.parametrize("kind", ["band", "input"])
def test_a_mask_that_masks_something_or_reads_an_input_is_kept(kind):
    """A constant mask that is neither all True nor causal, or one read from an argument, changes SDPA's result: it stays."""
    model, args, optimized = _optimize(kind, "inference")
    masks = [_mask(n) for n in optimized.graph_module.graph.nodes if n.target in _ANY_SDPA]
    assert len(masks) == 1 and masks[0] is not None
    torch.testing.assert_close(optimized(*args), model(*args), rtol=1e-12, atol=1e-12)


class GroupedQueryAttention(nn.Module):
    """Causal grouped-query attention as transformers writes it: eager passes no mask and `enable_gqa=True`; under
    Dynamo it builds the causal mask, and with a mask it copies each key and value head per query head (`repeat_kv`)."""

    def __init__(self, heads: int = 4, kv_heads: int = 2, dim: int = 8):
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.q, self.kv = nn.Linear(16, heads * dim), nn.Linear(16, 2 * kv_heads * dim)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.dim).transpose(1, 2)
        k, v = (t.view(b, n, self.kv_heads, self.dim).transpose(1, 2) for t in self.kv(x).chunk(2, dim=-1))
        if not torch.compiler.is_compiling():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        positions = torch.arange(n)
        mask = (positions[None, :] <= positions[:, None]).expand(b, 1, n, n)
        groups = self.heads // self.kv_heads
        k, v = (t[:, :, None, :, :].expand(b, self.kv_heads, groups, n, self.dim).reshape(b, self.heads, n, self.dim)
                for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_dropped_causal_mask_shares_key_value_heads_as_eager():
    """Once its causal mask is dropped, a grouped-query call gets its key and value heads as they are, with
    enable_gqa=True, as eager's: float32 gradients equal eager's bit for bit (the per-head copies' backward summed the
    shared heads' gradients in another order: HF Llama's differed by 1e-10)."""
    torch.manual_seed(0)
    model, x = GroupedQueryAttention().train(), torch.randn(2, 6, 16)
    optimized = fxopt.optimize(model, (x,), mode="training", passes=[])
    (sdpa,) = [n for n in optimized.graph_module.graph.nodes if n.target is _SDPA]
    assert sdpa.kwargs.get("enable_gqa") is True and _mask(sdpa) is None
    assert not [n for n in optimized.graph_module.graph.nodes if n.target is torch.ops.aten.expand.default]
    reference = copy.deepcopy(model)
    optimized(x).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


class BiasedAttention(nn.Module):
    """Attention with a learned bias as transformers' BEiT writes it: eager passes the bias alone; under Dynamo it
    builds an all-True boolean mask and adds it to the bias (True as 1)."""

    def __init__(self):
        super().__init__()
        self.proj, self.bias = nn.Linear(8, 24), nn.Parameter(torch.randn(1, 1, 5, 5))

    def forward(self, x):
        q, k, v = self.proj(x).unsqueeze(1).chunk(3, dim=-1)
        mask = self.bias
        if torch.compiler.is_compiling():  # as transformers builds masks only when traced
            n = x.shape[1]
            mask = mask + (torch.arange(n) >= 0).expand(x.shape[0], 1, n, n)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_all_true_mask_added_to_a_bias_is_dropped_as_eager_has_the_bias_alone():
    """A constant all-True mask added to a float bias shifts every logit by 1: the call gets the bias alone, as eager's,
    and float32 outputs and gradients equal eager's bit for bit (HF BEiT's output differed by 6.1e-4)."""
    torch.manual_seed(0)
    model, x = BiasedAttention().train(), torch.randn(2, 5, 8)
    optimized = fxopt.optimize(model, (x,), mode="training", passes=[])
    (sdpa,) = [n for n in optimized.graph_module.graph.nodes if n.target is _SDPA]
    assert _mask(sdpa).op == "placeholder" and _mask(sdpa).meta["state_name"] == "bias"
    reference = copy.deepcopy(model)
    out, expected = optimized(x), reference(x)
    assert torch.equal(out, expected)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
