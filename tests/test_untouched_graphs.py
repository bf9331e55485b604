"""Inference graphs with nothing for fxopt's passes run as Dynamo captured them, untraced
(fxopt/pipeline/untouched_graphs.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers

import fxopt
from fxopt import _torch_private
from fxopt.frontends import backend as backend_module
from fxopt.pipeline.untouched_graphs import left_as_captured

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

# What the traced passes may do to a graph left as captured: nothing that costs run time there
FREE_CHANGES = {("drop_eval_dropout", "dropped"), ("prune_dead_grads", "removed")}


def _verdicts(model: nn.Module, *calls) -> list[bool]:
    """`left_as_captured` of each graph Dynamo makes of `model` over `calls` (args tuples), under no_grad."""
    verdicts = []

    def judge(gm, example_inputs):
        verdicts.append(left_as_captured(gm, _torch_private.dynamo_parameter_placeholders(gm, example_inputs)))
        return gm

    compiled = torch.compile(model, backend=judge)
    with torch.no_grad():
        for args in calls:
            compiled(*args)
    return verdicts


def _hf(name: str) -> nn.Module:
    if name == "bert":
        config = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                         intermediate_size=128)
        return transformers.BertModel(config).double().eval()
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4)).double().eval()


def _batch(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 1000, (2, length), generator=torch.Generator().manual_seed(length))
    mask = torch.ones(2, length, dtype=torch.long)
    mask[0, length - 3:] = 0
    return ids, mask


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_a_new_length_runs_dynamos_graph_as_captured_with_eagers_outputs(name):
    """HF BERT and GPT-2 (default configs) with attention_mask=, at the example's length and then new padded lengths:
    neither the static graph nor the dynamic one is traced, their reports say so for every pass, and every length
    computes exactly eager's outputs."""
    model = _hf(name)
    ids, mask = _batch(9)
    fast = fxopt.optimize(model, (ids,), example_kwargs={"attention_mask": mask})
    with torch.no_grad():
        for length in (12, 15, 9):
            ids, mask = _batch(length)
            expected, got = model(ids, attention_mask=mask), fast(ids, attention_mask=mask)
            key = "last_hidden_state" if name == "bert" else "logits"
            torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0)
    static, dynamic = fast.fxopt_reports
    assert dynamic.dynamic_sizes and not static.dynamic_sizes
    assert all("runs as captured, untraced" in p.skipped for report in (static, dynamic) for p in report.passes)
    assert "Dynamic sizes (the graph runs as captured, at every size)" in str(dynamic)
    assert "planned at" not in str(dynamic)


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_a_graph_left_as_captured_is_one_the_passes_change_at_no_cost(name, monkeypatch):
    """Traced anyway, each graph the check leaves as captured gets only changes that cost nothing in Dynamo's graph:
    eval dropouts dropped (they return their input) and nodes the ATen trace itself left dead."""
    verdicts = []

    def traced_anyway(gm, parameters):
        verdicts.append(left_as_captured(gm, parameters))
        return False

    monkeypatch.setattr(backend_module, "left_as_captured", traced_anyway)
    model = _hf(name)
    ids, mask = _batch(9)
    fast = fxopt.optimize(model, (ids,), example_kwargs={"attention_mask": mask})
    with torch.no_grad():
        fast(*_batch(12)[:1], attention_mask=_batch(12)[1])
    assert verdicts == [True, True]
    changes = {(p.name, s.action) for r in fast.fxopt_reports for p in r.passes for s in p.sites if not s.refused}
    assert changes <= FREE_CHANGES


class Block(nn.Module):
    """A linear layer, then what `kind` names."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(8, 8)
        self.conv = nn.Conv1d(8, 8, 1)
        self.bn = nn.BatchNorm1d(8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        y = self.fc(x)
        if self.kind == "gelu and eval dropout":
            return F.dropout(F.gelu(y), 0.1, training=False)
        if self.kind == "a parameter's view":
            return y * self.scale.view(1, 1, 8)
        if self.kind == "a parameter's rows":
            return y + F.embedding(torch.arange(5), self.fc.weight) + self.scale.to(torch.float32)
        if self.kind == "a parameter cast":
            return y * self.scale.to(torch.float64).sum().to(torch.float32)
        if self.kind == "relu":
            return F.relu(y)
        if self.kind == "convolution":
            return self.conv(y.transpose(1, 2))
        if self.kind == "batch norm":
            return self.bn(y.transpose(1, 2))
        if self.kind == "pad":
            return F.pad(y, (0, 0))
        if self.kind == "train dropout":
            return F.dropout(y, 0.1, training=True)
        if self.kind == "a parameter's own computation":
            return y * (self.scale / self.scale.norm())
        if self.kind == "a constant mask":
            q = y.unsqueeze(1)
            mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
            return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        if self.kind == "an input's mask":
            q = y.unsqueeze(1)
            return F.scaled_dot_product_attention(q, q, q, attn_mask=x[..., :1].unsqueeze(1) > 0)
        raise AssertionError(self.kind)


@pytest.mark.parametrize("kind", ["gelu and eval dropout", "a parameter's view", "a parameter's rows",
                                  "an input's mask"])
def test_ops_no_inference_pass_rewrites_leave_the_graph_as_captured(kind):
    """A graph of linear layers, GELU, eval dropouts, views of parameters, rows looked up in one, a `.to()` that changes
    nothing and attention with an input's mask runs as captured."""
    assert _verdicts(Block(kind).eval(), (torch.randn(2, 5, 8),)) == [True]


@pytest.mark.parametrize("kind", ["relu", "convolution", "batch norm", "pad", "train dropout",
                                  "a parameter's own computation", "a parameter cast", "a constant mask"])
def test_anything_a_pass_rewrites_or_freezing_folds_sends_the_graph_to_the_passes(kind):
    """A ReLU, a convolution, a BatchNorm, a pad, a dropout that draws, a value computed from the parameters alone (a
    norm, a cast) and a constant attention mask each make the graph traced."""
    assert _verdicts(Block(kind).eval(), (torch.randn(2, 5, 8),)) == [False]


def test_named_passes_are_run_on_a_graph_with_nothing_for_them():
    """A caller naming its passes gets them run and reported, even where the default would leave the graph alone."""
    model = Block("gelu and eval dropout").eval()
    x = torch.randn(2, 5, 8)
    default = fxopt.optimize(model, (x,))
    named = fxopt.optimize(model, (x,), passes=["drop_eval_dropout"])
    assert all("untraced" in p.skipped for p in default.fxopt_report.passes)
    assert named.fxopt_report["drop_eval_dropout"].stats["dropped"] == 1
    with torch.no_grad():
        torch.testing.assert_close(default(x), model(x), rtol=0, atol=0)
        torch.testing.assert_close(named(x), model(x), rtol=0, atol=0)


def test_training_graphs_are_always_traced():
    """A graph autograd differentiates goes through the training passes, whatever its ops."""
    model = Block("gelu and eval dropout").eval()
    fast = fxopt.optimize(model, (torch.randn(2, 5, 8),), mode="training")
    assert not any("untraced" in p.skipped for p in fast.fxopt_report.passes)
