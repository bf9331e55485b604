"""The memory model on F.scaled_dot_product_attention, whose kernel torch picks at run time: measured, not guessed."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import fxopt
from fxopt.analysis import opaque_memory
from fxopt.checkpointing.profile import estimate, step_profile
from fxopt.analysis.saved_tensors import measurement, saved_for_backward
from fxopt.measure import measure_allocator_peak

from named_regions import extract_regions, named_regions


class Attention(torch.nn.Module):
    """Self-attention through SDPA: q, k, v projections, an optional mask (none, bool or float, broadcast over heads
    and queries), dropout and causality as given, then an output projection."""

    def __init__(self, dropout: float = 0.0, mask: str = "none", causal: bool = False, width: int = 64,
                 heads: int = 4):
        super().__init__()
        self.dropout, self.mask, self.causal, self.heads = dropout, mask, causal, heads
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = (t.view(b, s, self.heads, w // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        mask = None
        if self.mask != "none":
            keep = torch.arange(s, device=x.device) < s - 3  # the last three keys are padding
            mask = keep.view(1, 1, 1, s).expand(b, 1, 1, s)
            if self.mask == "float":
                mask = torch.zeros(b, 1, 1, s, device=x.device).masked_fill(~mask, float("-inf"))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=self.causal)
        return self.out(y.transpose(1, 2).reshape(b, s, w)) + x


class MeanSquare(torch.nn.Module):
    """The loss inside the graph, so that the whole step is modelled."""

    def forward(self, x):
        return (x ** 2).mean()


def _model(device="cpu", **kind) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(Attention(**kind), Attention(**kind), MeanSquare()).to(device).train()


def _sdpa_node(gm):
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target)][:1]
    return node


KINDS = [dict(), dict(dropout=0.1), dict(mask="bool"), dict(mask="float"), dict(mask="bool", dropout=0.1),
         dict(causal=True), dict(causal=True, dropout=0.1)]
IDS = ["plain", "dropout", "bool_mask", "float_mask", "bool_mask_dropout", "causal", "causal_dropout"]


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_estimated_step_peak_is_the_allocators(kind):
    """Two SDPA layers, with and without dropout, a mask and causality: the estimated step peak is the allocator's
    within 1% (taken as the flash kernel, dropout's math path was 25% under it)."""
    model, x = _model(**kind), torch.randn(4, 96, 64)
    opt = fxopt.optimize(model, (x,), mode="training", passes=[])
    profile = step_profile(opt.graph_module)
    assert all(s.memory_known for s in profile.steps)
    assert estimate(profile).peak == pytest.approx(measure_allocator_peak(model, (x,)), rel=0.01)


def test_dropout_keeps_the_attention_weights():
    """With dropout torch runs the math path: the measurement keeps sequence-square tensors beside the output;
    without, the flash kernel keeps its inputs and output and only the per-row log-sum-exp beside them."""
    x = torch.randn(4, 96, 64)
    flash, math = (_sdpa_node(fxopt.optimize(_model(**k), (x,), mode="training", passes=[]).graph_module)
                   for k in (dict(), dict(dropout=0.1)))
    square = 4 * 4 * 96 * 96 * 4  # batch, heads, sequence², float32
    assert measurement(flash).private_bytes < square / 10 and saved_for_backward(flash).saves_output
    assert measurement(math).private_bytes >= 3 * square


def test_measuring_draws_nothing_from_the_callers_generators():
    """Measuring a dropout attention runs it, drawing its mask, yet torch's generator is where it was."""
    opaque_memory._measured.cache_clear()
    node = _sdpa_node(fxopt.optimize(_model(dropout=0.1), (torch.randn(4, 96, 64),), mode="training",
                                     passes=[]).graph_module)
    opaque_memory._measured.cache_clear()
    before = torch.get_rng_state()
    assert measurement(node) is not None
    assert torch.equal(torch.get_rng_state(), before)


def test_unmeasured_attention_is_reported(monkeypatch):
    """Where attention cannot be measured, the plan says its prediction rests on a guess: a site, a figure and a
    warning name the op."""
    monkeypatch.setattr(opaque_memory, "_measured", lambda *args: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = fxopt.optimize(_model(dropout=0.1), (torch.randn(4, 96, 64),), mode="training", memory_budget=0.5,
                             passes=["checkpoint_activations"])
    report = opt.fxopt_report["checkpoint_activations"]
    assert report.figures["unmeasured_ops"] == ["scaled_dot_product_attention", "scaled_dot_product_attention_1"]
    assert [s.node.rpartition(":")[2] for s in report.sites  # a site is named `<graph>:<node>`
            if s.reason == "memory_not_measured"] == report.figures["unmeasured_ops"]
    assert any("guessed, not measured: scaled_dot_product_attention" in str(w.message) for w in caught)


def test_unmet_budget_names_the_ops_at_the_peak():
    """Below the floor the warning names the ops whose kept tensors hold the peak, and says attention dropout is
    what keeps the sequence-square weights."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fxopt.optimize(_model(dropout=0.1), (torch.randn(4, 96, 64),), mode="training", memory_budget=0.05,
                       passes=["checkpoint_activations"])
    (missed,) = [str(w.message) for w in caught if "NOT met" in str(w.message)]
    assert "the peak holds tensors kept by scaled_dot_product_attention" in missed and "attention dropout 0" in missed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_cuda_measurement_is_the_allocators(kind):
    """On CUDA (flash, memory-efficient, cuDNN or math kernel, as torch picks): the estimated step peak is the
    allocator's within 3%."""
    model, x = _model("cuda", **kind), torch.randn(4, 96, 64, device="cuda")
    opt = fxopt.optimize(model, (x,), mode="training", passes=[])
    profile = step_profile(opt.graph_module)
    assert all(s.memory_known for s in profile.steps)
    assert estimate(profile).peak == pytest.approx(measure_allocator_peak(model, (x,)), rel=0.03)


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["flash", "math"])
def test_regions_recomputing_attention_predict_the_allocators_peak(dropout):
    """Whole regions over each SDPA layer recompute its attention from the same measurement: the predicted step peak
    is the allocator's within 1%."""
    model, x = _model(dropout=dropout), torch.randn(4, 96, 64)
    opt = fxopt.optimize(model, (x,), mode="training", passes=[])
    profile = step_profile(opt.graph_module)
    bounds = (("linear", "add"), ("linear_2", "add_1"))
    regions = named_regions(profile, bounds)
    predicted = estimate(profile, regions).peak
    extract_regions(opt.graph_module, profile, regions)
    assert predicted == pytest.approx(measure_allocator_peak(opt, (x,)), rel=0.01)


def test_no_selective_region_sees_inside_the_math_path():
    """A selective policy would keep the products inside dropout's math-path attention, which the model does not
    describe: such regions are not planned (the flash kernel, one op, may be kept whole)."""
    x = torch.randn(4, 96, 64)
    for dropout, sees_inside in ((0.0, False), (0.1, True)):
        profile = step_profile(fxopt.optimize(_model(dropout=dropout), (x,), mode="training",
                                              passes=[]).graph_module)
        (region,) = named_regions(profile, (("linear", "add"),), save_compute_intensive=True)
        assert profile.policy_sees_inside(region) is sees_inside


@pytest.mark.parametrize("budget", [1.0, 0.5])
def test_compiled_partition_peak_counts_the_flash_kernels_scratch(budget):
    """Under torch.compile (aot_eager) the partition's predicted step peak is the allocator's within 0.1%: the CPU
    flash kernel's forward and backward are measured as they run (call_peaks; unmeasured, 1.7% under)."""
    from test_backend_memory import _step_peak
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # whether the budget is reachable is not the point here
        peak, backend = _step_peak(_model(), torch.randn(4, 96, 64), budget)
    assert backend.reports[0]["checkpoint_activations"].figures["peak_bytes_after"] == pytest.approx(peak, rel=0.001)
