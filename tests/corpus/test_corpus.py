"""The real-model corpus: every model, in inference, training and training with a memory budget,
computes what eager computes (outputs, every gradient, every buffer; float64), and the caller's model
is left untouched. Opt-in: `pytest -m corpus tests/corpus` (a CI step of its own)."""
import pytest
from corpus_check import VARIANTS, run
from corpus_models import CORPUS

pytestmark = pytest.mark.corpus

# Known bugs, each with its issue; strict, so the fix turns the entry into a failure to delete.
KNOWN: dict = {}


@pytest.mark.parametrize(("model_name", "variant"), [
    pytest.param(e.name, v, marks=KNOWN.get((e.name, v), ()), id=f"{e.name}-{v}") for e in CORPUS for v in VARIANTS])
def test_corpus_model_matches_eager(model_name, variant):
    """The optimized model's outputs, gradients and buffers equal eager's in float64."""
    result = run(model_name, variant)
    assert result.ok, f"{model_name} {variant}: {result.worst} differs by {result.max_diff:.3g}"
