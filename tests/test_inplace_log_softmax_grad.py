"""inplace_log_softmax_grad: a cross-entropy's log-softmax writes the logits' gradient over the loss's gradient.

Each rewrite is checked bit for bit against eager (loss, every gradient; reductions, class weights, ignored targets,
1-D and 2-D inputs, float32 and float64, one and two threads; double backward), for the memory it saves, measured
and as checkpoint_activations' memory model prices it, on Hugging Face GPT-2 trained with labels=, and each refusal
on a network written for it.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxopt
from equivalence import assert_lm_training_bits, assert_step_priced_as_measured, bits
from fxopt.measure import measure_allocator_peak

CLASSES, WIDTH = 500, 16


class Classifier(nn.Module):
    """A linear layer over CLASSES classes and a cross-entropy, written as the options ask."""

    def __init__(self, classes=CLASSES, loss="cross_entropy", **loss_options):
        super().__init__()
        self.head = nn.Linear(WIDTH, classes)
        self.loss, self.loss_options = loss, loss_options

    def forward(self, x, target):
        logits = self.head(x)
        if self.loss == "cross_entropy":
            return F.cross_entropy(logits, target, **self.loss_options)
        if self.loss == "log_softmax_nll":
            return F.nll_loss(F.log_softmax(logits, dim=-1), target, **self.loss_options)
        if self.loss == "returns_log_probs":
            log_probs = F.log_softmax(logits, dim=-1)
            return F.nll_loss(log_probs, target), log_probs
        raise ValueError(self.loss)


class PerPosition(nn.Module):
    """A cross-entropy over (N, C, L) logits: the classes in dimension 1 of 3."""

    def forward(self, x, target):
        return F.cross_entropy(x.view(4, 16, 16).transpose(1, 2), target)


def _inputs(rows=64, classes=CLASSES, dtype=torch.float32, seed=0, ignored=True, ignore_index=-100):
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, classes, (rows,), generator=g)
    if ignored:
        target[::7] = ignore_index  # padding, as a collator marks it
    return torch.randn(rows, WIDTH, generator=g, dtype=dtype).requires_grad_(), target


def _optimize(model, inputs, passes=("inplace_log_softmax_grad",), **options):
    return fxopt.optimize(model, inputs, mode="training", passes=list(passes), **options)


def _sites(optimized):
    return [(s.action, s.reason) for s in optimized.fxopt_report["inplace_log_softmax_grad"].sites]



def _step(model, x, target):
    """Loss, the input's gradient and every parameter gradient of one step (`.grad` reset first)."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    loss = model(x, target)
    loss = loss[0] if isinstance(loss, tuple) else loss
    (loss.sum() * 1.3).backward()
    return [loss, x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("options", [{}, {"reduction": "sum"}, {"reduction": "none"}, {"weight": "classes"},
                                     {"ignore_index": 3}], ids=["mean", "sum", "none", "class_weights", "ignore_3"])
@pytest.mark.parametrize("threads", [1, 2])
def test_cross_entropy_step_is_eagers_bit_for_bit(dtype, options, threads):
    """Loss, the logits' input gradient and every parameter gradient keep eager's bits, for each reduction, class
    weights and ignored targets, in float32 and float64, on one and two threads."""
    torch.manual_seed(0)
    if options.get("weight") == "classes":
        options = {"weight": torch.rand(CLASSES, dtype=dtype) + 0.5}
    model = Classifier(**options).to(dtype).train()
    inputs = _inputs(dtype=dtype, ignore_index=options.get("ignore_index", -100))
    optimized = _optimize(copy.deepcopy(model), inputs)
    assert _sites(optimized) == [("in_place", "")]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        expected, got = _step(model, *inputs), _step(optimized, *inputs)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(expected, got))


def test_log_softmax_then_nll_loss_and_a_one_row_input_are_eagers():
    """`F.nll_loss(F.log_softmax(x, -1), t)` is rewritten as the cross-entropy is; a 1-D input (one row of classes)
    too: both keep eager's bits."""
    torch.manual_seed(0)
    model = Classifier(loss="log_softmax_nll").train()
    inputs = _inputs()
    optimized = _optimize(copy.deepcopy(model), inputs)
    assert _sites(optimized) == [("in_place", "")]
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(_step(model, *inputs), _step(optimized, *inputs)))
    x, target = torch.randn(WIDTH, requires_grad=True), torch.tensor(5)
    one_row = _optimize(copy.deepcopy(model), (x, target))
    assert _sites(one_row) == [("in_place", "")]
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(_step(model, x, target), _step(one_row, x, target)))


def test_a_new_size_and_accumulating_gradients_stay_eagers():
    """Another number of rows (the graph turns dynamic) and `.grad` accumulating over three steps: eager's bits."""
    torch.manual_seed(0)
    model = Classifier().train()
    optimized = _optimize(copy.deepcopy(model), _inputs())
    for rows in (64, 40, 90):
        x, target = _inputs(rows, seed=rows)
        for m in (model, optimized):
            m(x, target).backward()
    assert all(torch.equal(bits(p.grad), bits(q.grad)) for p, q in zip(model.parameters(), optimized.parameters()))


def test_double_backward_through_the_rewrite_is_eagers():
    """With create_graph=True the helper hands back ATen's differentiable gradient over its own saved output: the
    gradient and the second derivative of its norm equal eager's (float64)."""
    torch.manual_seed(0)
    model = Classifier().double().train()
    inputs = _inputs(dtype=torch.float64)
    optimized = _optimize(copy.deepcopy(model), inputs)
    results = []
    for m in (model, optimized):
        x = inputs[0].detach().requires_grad_()
        (grad,) = torch.autograd.grad(m(x, inputs[1]), x, create_graph=True)
        (second,) = torch.autograd.grad(grad.pow(2).sum(), m.head.weight)
        results.append((grad.detach(), second))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_one_logits_sized_tensor_less_measured_and_priced():
    """The rewrite lowers the measured backward peak by one logits-sized tensor, and the memory model's estimates of
    the step before and after it equal the measurements within 2%."""
    torch.manual_seed(0)
    model = Classifier(classes=20_000).train()
    inputs = _inputs(rows=256, classes=20_000)
    loss = lambda m: (lambda x, t: m(x, t))  # noqa: E731
    eager = measure_allocator_peak(model, inputs, forward=loss(model))
    optimized = _optimize(copy.deepcopy(model), inputs)
    measured = measure_allocator_peak(optimized, inputs, forward=loss(optimized))
    logits = 256 * 20_000 * 4
    assert eager - measured >= 0.95 * logits
    assert_step_priced_as_measured(optimized, _optimize(copy.deepcopy(model), inputs, passes=()), measured, eager)


def test_log_probabilities_read_elsewhere_are_refused():
    """Log-probabilities also returned (their gradient may come from the caller's loss too) are left to ATen."""
    model = Classifier(loss="returns_log_probs").train()
    optimized = _optimize(model, _inputs())
    assert _sites(optimized) == [("refused", "log_probs_read_elsewhere")]


@pytest.mark.parametrize("case, reason", [
    ("label_smoothing", "label_smoothing"), ("probabilities", "probability_targets"),
    ("classes_in_dim_1_of_3", "class_dim_not_last"), ("bfloat16", "other_dtype")])
def test_cross_entropies_of_other_kernels_are_refused(case, reason):
    """Label smoothing, probability targets, (N, C, L) inputs and reduced precision run other ATen code: refused,
    and the step is still eager's."""
    torch.manual_seed(0)
    model, (x, target) = Classifier(), _inputs(ignored=False)
    if case == "label_smoothing":
        model.loss_options = {"label_smoothing": 0.1}
    elif case == "probabilities":
        target = torch.softmax(torch.randn(64, CLASSES), -1)
    elif case == "classes_in_dim_1_of_3":
        model, target = PerPosition(), torch.randint(0, 16, (4, 16))
    else:
        model, x = model.to(torch.bfloat16), x.detach().to(torch.bfloat16).requires_grad_()
    optimized = _optimize(copy.deepcopy(model.train()), (x, target))
    assert _sites(optimized) == [("refused", reason)]
    for a, b in zip(_step(model, x, target), _step(optimized, x, target)):
        assert torch.equal(a, b)


def test_not_run_in_inference_without_gradients_or_on_the_compile_path():
    """Inference mode and logits needing no gradient leave nothing to do; torch.compile's AOTAutograd plans its own
    backward, so the pass skips the graph there."""
    assert "inplace_log_softmax_grad" not in fxopt.pipeline.pipelines.DEFAULT_PIPELINES["inference"]
    model = Classifier().train().requires_grad_(False)
    x, target = _inputs()
    optimized = _optimize(copy.deepcopy(model), (x.detach(), target))
    assert _sites(optimized) == []
    reports = []
    compiled = torch.compile(Classifier().train(), backend="fxopt", options={
        "inner": "aot_eager", "passes": ["inplace_log_softmax_grad"], "report": reports.append})
    compiled(x, target).backward()
    assert "AOTAutograd" in reports[0]["inplace_log_softmax_grad"].skipped


@pytest.mark.parametrize("budget", [None, 0.5], ids=["no_budget", "budget_0.5"])
@pytest.mark.usefixtures("budget_may_be_unmet")
def test_hugging_face_gpt2_trained_with_labels_is_eagers_bit_for_bit(budget):
    """HF GPT-2 (library defaults: SDPA, `use_cache=True`; tiny sizes) trained as users train it, with and without
    checkpointed regions: its loss's log-softmax is rewritten, and losses and every gradient over two steps at two
    lengths are eager's bits."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=400, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    reference = copy.deepcopy(model)
    optimized = fxopt.optimize(model, mode="training", **({} if budget is None else {"memory_budget": budget}))
    assert_lm_training_bits(reference, optimized, vocab=400)
    actions = [s.action for r in optimized.fxopt_reports for s in r["inplace_log_softmax_grad"].sites]
    assert "in_place" in actions
