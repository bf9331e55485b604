"""tied_embedding_grads: a lookup of a weight read elsewhere too hands back its gradient as the rows it read.

Each rewrite is checked bit for bit against eager (outputs, every gradient, buffers; `.grad` None before the step and
accumulating across steps; double backward), for the memory it saves, measured and as checkpoint_activations' memory
model prices it, and each refusal on a network written for it.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxopt
from equivalence import assert_lm_training_bits, assert_step_priced_as_measured, bits
from fxopt.measure import measure_allocator_peak
from fxopt.passes._row_grads import embedding_row_grads

VOCAB, WIDTH = 3000, 32


class TiedEncoderDecoder(nn.Module):
    """An encoder and a decoder sharing one embedding table (BART's layout, small), padding row 1."""

    def __init__(self, return_each_side: bool = False, sparse: bool = False):
        super().__init__()
        self.shared = nn.Embedding(VOCAB, WIDTH, padding_idx=1, sparse=sparse)
        self.encoder = nn.Linear(WIDTH, WIDTH)
        self.decoder = nn.Linear(WIDTH, WIDTH)
        self.return_each_side = return_each_side

    def forward(self, encoder_ids, decoder_ids):
        memory = torch.tanh(self.encoder(self.shared(encoder_ids))).mean(1, keepdim=True)
        embedded = self.shared(decoder_ids)
        out = torch.sin(self.decoder(embedded) * memory)
        return (out, embedded, memory) if self.return_each_side else out


def _ids(batch=4, length=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    encoder_ids = torch.randint(0, 200, (batch, length), generator=g)  # few rows, many repeats
    decoder_ids = torch.randint(0, 200, (batch, length), generator=g)
    decoder_ids[:, :8] = encoder_ids[:, :8]  # rows both lookups read
    decoder_ids[0, :3] = 1  # the padding row
    return encoder_ids, decoder_ids


def _optimize(model, inputs, passes=("tied_embedding_grads",), **options):
    return fxopt.optimize(model, inputs, mode="training", passes=list(passes), **options)


def _sites(optimized):
    return [(s.action, s.node, s.reason) for s in optimized.fxopt_report["tied_embedding_grads"].sites]



def _steps(model, inputs, accumulate: bool):
    """Two backward steps: `.grad` reset to None before each, or accumulating from the first."""
    results = []
    for _ in range(2):
        if not accumulate:
            model.zero_grad(set_to_none=True)
        out = model(*inputs)
        (out[0] if isinstance(out, tuple) else out).pow(2).mean().backward()
        results.append({"out": out[0] if isinstance(out, tuple) else out,
                        **{n: p.grad.clone() for n, p in model.named_parameters()}})
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("accumulate", [False, True], ids=["grad_none", "grad_accumulating"])
def test_tied_lookup_step_is_eagers_bit_for_bit(dtype, accumulate):
    """The decoder lookup is rewritten, and every output and gradient, `.grad` None or accumulating, keeps its bits."""
    torch.manual_seed(0)
    model = TiedEncoderDecoder().to(dtype).train()
    inputs = _ids()
    optimized = _optimize(copy.deepcopy(model), inputs)
    assert [s[0] for s in _sites(optimized)] == ["rows"]
    for expected, got in zip(_steps(model, inputs, accumulate), _steps(optimized, inputs, accumulate)):
        assert expected.keys() == got.keys()
        for name in expected:
            assert got[name].layout == torch.strided, name
            assert torch.equal(bits(got[name]), bits(expected[name])), name


def test_a_new_length_and_eval_mode_keep_eagers_values():
    """At a length the capture never saw, and then in eval mode without grad, the results are eager's."""
    torch.manual_seed(0)
    model = TiedEncoderDecoder().train()
    optimized = _optimize(copy.deepcopy(model), _ids())
    longer = _ids(length=57, seed=3)
    for expected, got in zip(_steps(model, longer, False), _steps(optimized, longer, False)):
        assert all(torch.equal(got[n], expected[n]) for n in expected)
    model.eval(), optimized.eval()
    with torch.no_grad():
        assert torch.equal(optimized(*longer), model(*longer))


def test_row_gradient_matches_atens_dense_gradient_bit_for_bit():
    """The sparse rows equal ATen's dense embedding gradient, with and without padding and frequency scaling, on
    both of ATen's CPU paths (under and over 1,000 indices)."""
    torch.manual_seed(0)
    weight = torch.randn(5000, 24, requires_grad=True)
    for numel in (300, 4096):
        for padding_idx in (-1, 7, 4999):
            for by_frequency in (False, True):
                indices = torch.randint(0, 60, (numel,))
                indices[::5] = 7
                grad = torch.randn(numel, 24)
                expected = torch.ops.aten.embedding_dense_backward(grad, indices, 5000, padding_idx, by_frequency)
                (got,) = torch.autograd.grad(embedding_row_grads(weight, indices, padding_idx, by_frequency),
                                             weight, grad)
                assert got.is_sparse
                assert torch.equal(bits(got.to_dense()), bits(expected)), (numel, padding_idx, by_frequency)


def test_double_backward_through_a_rewritten_lookup_is_eagers():
    """With create_graph=True the lookup hands back ATen's dense, differentiable gradient: second derivatives agree."""
    torch.manual_seed(0)
    model = TiedEncoderDecoder().double().train()
    inputs = _ids()
    optimized = _optimize(copy.deepcopy(model), inputs)
    results = []
    for m in (model, optimized):
        (grad,) = torch.autograd.grad(m(*inputs).pow(2).mean(), m.shared.weight, create_graph=True)
        (second,) = torch.autograd.grad(grad.pow(2).sum(), m.decoder.weight)
        results.append((grad.detach(), second))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_one_dense_gradient_in_flight_measured_and_priced():
    """The rewrite lowers the measured backward peak by one table-sized gradient, and the memory model's estimate of
    the rewritten step equals the measurement."""
    torch.manual_seed(0)
    model = TiedEncoderDecoder().train()
    model.shared = nn.Embedding(50_000, WIDTH, padding_idx=1)  # the table outweighs the activations
    inputs = _ids()
    loss = lambda m: (lambda *x: m(*x).pow(2).mean())  # noqa: E731
    eager = measure_allocator_peak(model, inputs, forward=loss(model))
    optimized = _optimize(copy.deepcopy(model), inputs)
    measured = measure_allocator_peak(optimized, inputs, forward=loss(optimized))
    table = 50_000 * WIDTH * 4
    assert eager - measured >= 0.95 * table
    assert_step_priced_as_measured(optimized, _optimize(copy.deepcopy(model), inputs, passes=()), measured, eager)


def test_a_lookup_each_of_whose_sides_is_returned_is_refused():
    """When each lookup's side is an output of its own, a loss over one side alone would leave `.grad` sparse
    whichever lookup hands back rows: refused, and a loss over either side gives eager's dense gradient."""
    torch.manual_seed(0)
    model = TiedEncoderDecoder(return_each_side=True).train()
    inputs = _ids()
    optimized = _optimize(copy.deepcopy(model), inputs)
    assert [s[2] for s in _sites(optimized)] == ["gradient_may_come_alone"]
    for side in (1, 2):
        for m in (model, optimized):
            m.zero_grad(set_to_none=True)
            m(*inputs)[side].sum().backward()
        assert optimized.shared.weight.grad.layout == torch.strided
        assert torch.equal(optimized.shared.weight.grad, model.shared.weight.grad)


def test_a_lookup_whose_value_is_returned_too_keeps_the_other_dense():
    """The decoder's embedding returned as well reaches more outputs, so it keeps the dense gradient and the
    encoder's lookup hands back rows: a loss over the embedding alone still gives a dense `.grad`."""
    torch.manual_seed(0)

    class ReturnsEmbedding(TiedEncoderDecoder):
        def forward(self, encoder_ids, decoder_ids):
            return super().forward(encoder_ids, decoder_ids)[:2]

    model = ReturnsEmbedding(return_each_side=True).train()
    inputs = _ids()
    optimized = _optimize(copy.deepcopy(model), inputs)
    assert [s[0] for s in _sites(optimized)] == ["rows"]
    for m in (model, optimized):
        m.zero_grad(set_to_none=True)
        m(*inputs)[1].sum().backward()
    assert optimized.shared.weight.grad.layout == torch.strided
    assert torch.equal(optimized.shared.weight.grad, model.shared.weight.grad)


def test_an_embedding_with_sparse_gradients_is_refused():
    """`nn.Embedding(sparse=True)` already makes sparse gradients: refused, left as it is."""
    model = TiedEncoderDecoder(sparse=True).train()
    optimized = _optimize(model, _ids())
    assert [s[2] for s in _sites(optimized)] == ["sparse_embedding"]


def test_an_untied_embedding_is_left_alone():
    """A weight read once has one gradient: nothing waits for a sum, no site."""
    model = nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 8)).train()
    optimized = _optimize(model, (torch.randint(0, 100, (2, 5)),))
    assert _sites(optimized) == []


def test_not_run_in_inference_or_on_the_compile_path():
    """Inference mode has no gradients (the pass is a training one); torch.compile's AOTAutograd plans its own
    backward, so the pass skips the graph there."""
    assert "tied_embedding_grads" not in fxopt.pipeline.pipelines.DEFAULT_PIPELINES["inference"]
    torch.manual_seed(0)
    model = TiedEncoderDecoder().train()
    inputs = _ids()
    reports = []
    compiled = torch.compile(copy.deepcopy(model), backend="fxopt",
                             options={"inner": "aot_eager", "passes": ["tied_embedding_grads"], "report": reports.append})
    compiled(*inputs).pow(2).mean().backward()
    assert "AOTAutograd" in reports[0]["tied_embedding_grads"].skipped


@pytest.mark.parametrize("budget", [None, 0.5], ids=["no_budget", "budget_0.5"])
@pytest.mark.usefixtures("budget_may_be_unmet")
def test_hugging_face_bart_trained_with_labels_is_eagers_bit_for_bit(budget):
    """HF BART (library defaults, tiny sizes) called as users train it, `model(ids, attention_mask=m, labels=y)`, with
    and without checkpointed regions: the decoder lookup of the weight the encoder and the LM head share hands back
    rows, and losses and every gradient over two steps at two lengths are eager's bits in float32."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BartConfig(vocab_size=300, d_model=32, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(config).train()
    reference = copy.deepcopy(model)
    optimized = fxopt.optimize(model, mode="training", **({} if budget is None else {"memory_budget": budget}))
    assert_lm_training_bits(reference, optimized, vocab=300, low=3)
    actions = [s.action for r in optimized.fxopt_reports for s in r["tied_embedding_grads"].sites]
    assert "rows" in actions
    if budget is not None:
        assert any(r["checkpoint_activations"].figures.get("regions") for r in optimized.fxopt_reports)
