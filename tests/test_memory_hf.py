"""The training-step memory model on a Hugging Face transformer: export's values share storage as eager's
do, predicted peaks are within 10% of the allocator's, and the measured peak follows the budget down to
the floor the planner reports."""
from __future__ import annotations

import re
import warnings

import pytest
import torch
import transformers

import fxopt
from corpus_models import LastHiddenState
from fxopt.analysis.memory import estimate, step_profile
from fxopt.measure import measure_allocator_peak
from fxopt.pipeline.run import from_model



def small_vit() -> torch.nn.Module:
    """HF ViT (its dropouts have p=0: eager hands their input back) at a size that plans in seconds."""
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=64, patch_size=8, hidden_size=64, num_hidden_layers=3,
                                    num_attention_heads=4, intermediate_size=256, attn_implementation="eager")
    return LastHiddenState(transformers.ViTModel(config)).train()


IMAGES = (torch.randn(2, 3, 64, 64),)


def _peak(model) -> int:
    return measure_allocator_peak(model, IMAGES, forward=lambda x: (model(x) ** 2).mean())


def _optimize(model, budget):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = fxopt.optimize(model, IMAGES, mode="training", passes=["checkpoint_activations"], memory_budget=budget)
    return opt, [str(w.message) for w in caught if "NOT met" in str(w.message)]


def test_export_values_alias_what_eager_aliases():
    """Export's own values give the same step profile as a propagation from the example inputs."""
    model = small_vit()
    profiles = [step_profile(from_model(model, IMAGES, propagate=p).graphs[0].gm) for p in (False, True)]
    exported, propagated = profiles
    assert [(exported.bytes_of(a.creates), exported.bytes_of(a.saved)) for a in exported.steps] == \
           [(propagated.bytes_of(b.creates), propagated.bytes_of(b.saved)) for b in propagated.steps]
    assert estimate(exported).peak == estimate(propagated).peak


@pytest.mark.parametrize("budget", [0.5, 0.3])
def test_predicted_peak_within_ten_percent(budget):
    """Before and after checkpointing, the estimated step peak is within 10% of the allocator's."""
    model = small_vit()
    opt, _ = _optimize(model, budget)
    figures = opt.fxopt_report["checkpoint_activations"].figures
    assert figures["regions"]
    assert figures["peak_estimate_before"] == pytest.approx(_peak(model), rel=0.1)
    assert figures["peak_estimate_after"] == pytest.approx(_peak(opt), rel=0.1)


@pytest.mark.slow
def test_measured_peak_follows_the_budget_down_to_the_floor():
    """From 1.0 down to the lowest reachable peak the measured peak never rises; a met budget holds (10%
    slack for the estimate), and below the floor the warning names the floor the step then measures."""
    model = small_vit()
    eager = _peak(model)
    peaks, floors = [], []
    for budget in (1.0, 0.7, 0.5, 0.3, 0.1):
        opt, missed = _optimize(model, budget)
        peaks.append(_peak(opt) / eager)
        if missed:
            floors.append(float(re.search(r"lowest reachable (\d\.\d+)x", missed[0]).group(1)))
            assert peaks[-1] == pytest.approx(floors[-1], abs=0.03), (budget, peaks, floors)
        else:
            assert peaks[-1] <= 1.1 * budget, (budget, peaks)
    assert all(b <= a for a, b in zip(peaks, peaks[1:])), peaks
    assert floors and len(set(floors)) == 1 and floors[0] < 0.5, floors
