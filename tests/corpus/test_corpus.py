"""The real-model corpus: every model, in inference, training and training with a memory budget,
computes what eager computes (outputs, every gradient, every buffer; float64), and the caller's model
is left untouched. Opt-in: `pytest -m corpus tests/corpus` (a CI step of its own)."""
import pytest
import torch
from corpus_check import VARIANTS, run
from corpus_models import CORPUS
from device_under_test import DEVICE

pytestmark = pytest.mark.corpus

# Known bugs, each with its issue; strict, so the fix turns the entry into a failure to delete.
KNOWN: dict = {}


@pytest.mark.parametrize(("model_name", "variant"), [
    pytest.param(e.name, v, marks=KNOWN.get((e.name, v), ()), id=f"{e.name}-{v}") for e in CORPUS for v in VARIANTS])
def test_corpus_model_matches_eager(model_name, variant):
    """The optimized model's outputs, gradients and buffers equal eager's in float64."""
    result = run(model_name, variant)
    assert result.ok, f"{model_name} {variant}: {result.worst} differs by {result.max_diff:.3g}"


@pytest.mark.skipif(DEVICE.type != "cpu", reason="bit for bit on CPU: CUDA's backward kernels may sum in any order")
@pytest.mark.parametrize("model_name", [e.name for e in CORPUS])
def test_corpus_training_step_is_eager_bits_in_float32(model_name):
    """In float32, a training step with a budget gives eager's outputs, gradients and buffers bit for bit: capture
    computes each op as eager does, in eager's order (HF Llama's shared key/value heads, BEiT's attention bias)."""
    result = run(model_name, "training+budget", dtype=torch.float32, tolerance=0.0)
    assert result.ok, f"{model_name}: {result.worst} differs by {result.max_diff:.3g}"
