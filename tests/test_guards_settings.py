"""SETTINGS guards: a module's plain attributes (and its config's), which export bakes in, are checked per call.

Each test changes, after `fxopt.optimize`, a value the forward reads from a Python attribute --
`Dropout.p`, `LeakyReLU.negative_slope`, a held config's field, an HF attention flag -- and compares
the result with an eager copy that went through the same change: outputs, gradients, buffers.
"""
from __future__ import annotations

import copy
import re
import sys
import types
from operator import attrgetter

import pytest
import torch
import torch.nn as nn
import transformers

from fxopt.guards import GLOBALS, SETTINGS, model_state_guards
from test_guards import X, assert_same, conv_bn_net, messages_over_changes, optimize_quietly, step


def test_dropout_probability_changed_after_optimize():
    """Setting `drop.p` after optimize (a dropout schedule) optimizes again for it, saying which setting changed."""
    model = conv_bn_net().train()
    reference = copy.deepcopy(model)
    result = optimize_quietly(model, X, mode="training")
    assert_same(step(reference), step(result))
    model.drop.p = reference.drop.p = 0.6
    with pytest.warns(UserWarning, match=r"drop\.p == 0\.3"):
        got = step(result)
    assert_same(step(reference), got)


def test_a_setting_changed_back_reuses_its_variant():
    """Alternating a dropout probability optimizes each value once, then switches between the variants."""
    messages, _ = messages_over_changes(lambda i, m: setattr(m.drop, "p", (0.3, 0.1)[i % 2]), calls=5)
    assert sum("optimized the model again" in m for m in messages) == 1, messages


class ScaledLeaky(nn.Module):
    """Reads a held config object's field and a LeakyReLU's slope in its forward."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(scale=2.0, name="scaled", sizes=[4])
        self.fc = nn.Linear(4, 4)
        self.act = nn.LeakyReLU(0.1)

    def forward(self, x):
        return self.act(self.fc(x)) * self.config.scale


@pytest.mark.parametrize("change", ["config.scale", "act.negative_slope"])
def test_inference_result_follows_a_changed_setting(change):
    """On an inference result (a private copy), a changed config field or activation slope is what it computes."""
    torch.manual_seed(0)
    model, x = ScaledLeaky().eval(), torch.randn(3, 4)
    reference = copy.deepcopy(model)
    result = optimize_quietly(model, x)
    owner, _, name = change.rpartition(".")
    for target in (result, reference):
        setattr(attrgetter(owner)(target), name, 0.5)
    with pytest.warns(UserWarning, match=re.escape(change)):
        got = result(x)
    torch.testing.assert_close(got, reference(x), rtol=0, atol=0)


def test_only_plain_values_are_guarded():
    """Numbers, strings and containers of them are recorded (lists as copies), and a list holding tensors (by the
    tensors' identity); a tensor attribute (a guard of its own) or a function is not, and a config shared by several
    modules is recorded once."""
    model = nn.Sequential(ScaledLeaky(), ScaledLeaky())
    model[1].config = model[0].config
    model[0].cache = torch.zeros(2)
    model[0].hook = print
    model[0].tensors = [torch.zeros(1)]
    settings = {g.target: dict(g.expected) for g in model_state_guards(model, "test") if g.kind == SETTINGS}
    assert settings["0"].keys() == {"config.scale", "config.name", "config.sizes", "tensors"}
    assert settings["0"]["config.sizes"] == [4] and settings["0"]["config.sizes"] is not model[0].config.sizes
    assert model[0].tensors == settings["0"]["tensors"] and [torch.zeros(1)] != settings["0"]["tensors"]
    assert "1" not in settings  # nothing of its own but the config, already recorded at "0"
    assert settings["0.act"] == {"negative_slope": 0.1, "inplace": False}


class ReadsContainers(nn.Module):
    """Reads a list, a dict and a tuple holding a list in its forward: export bakes their current values in."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scales = [1.0, 2.0]
        self.shift = {"value": 0.5}
        self.clamp = (-1.0, [3.0])

    def forward(self, x):
        return (self.fc(x) * self.scales[1] + self.shift["value"]).clamp(self.clamp[0], self.clamp[1][0])


CONTAINER_CHANGES = {
    "list item": lambda m: m.scales.__setitem__(1, 3.0),
    "list appended": lambda m: m.scales.append(9.0) or m.scales.pop(1),
    "dict item": lambda m: m.shift.update(value=-0.25),
    "list in a tuple": lambda m: m.clamp[1].__setitem__(0, 0.75),
    "list replaced": lambda m: setattr(m, "scales", [1.0, -2.0]),
}


@pytest.mark.parametrize("mode", ["inference", "training"])
@pytest.mark.parametrize("change", sorted(CONTAINER_CHANGES))
def test_a_list_or_dict_changed_in_place_is_honoured(change, mode):
    """A list or dict the forward reads, changed in place after optimize (on the result), computes the new values:
    outputs, gradients and buffers as eager's after the same change, with a warning naming the setting."""
    torch.manual_seed(0)
    model, x = ReadsContainers().train(mode == "training"), torch.randn(3, 4)
    reference = copy.deepcopy(model)
    result = optimize_quietly(model, x, mode=mode)
    backward = mode == "training"
    assert_same(step(reference, x, backward=backward), step(result, x, backward=backward), tol=0)
    for target in (result, reference):
        CONTAINER_CHANGES[change](target)
    with pytest.warns(UserWarning, match="scales|shift|clamp"):
        got = step(result, x, backward=backward)
    assert_same(step(reference, x, backward=backward), got, tol=0)


def test_setting_a_plain_attribute_on_the_result_sets_it_on_the_model():
    """`result.scales = [...]` changes what the model reads (the result stands for it), not a shadow attribute."""
    model = ReadsContainers().eval()
    result = optimize_quietly(model, torch.randn(3, 4))
    result.scales = [1.0, 4.0]
    assert result.original.scales == [1.0, 4.0] and "scales" not in vars(result)
    result.fxopt_note = "mine"  # a name the model does not have stays on the result
    assert result.fxopt_note == "mine" and not hasattr(result.original, "fxopt_note")


def test_hugging_face_attention_flag_changed_after_optimize():
    """GPT-2's attention `scaling` (read in its SDPA attention's forward; `scale_attn_weights` only sets it at
    construction) changed after optimize is honoured."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=100, n_layer=2, n_embd=32, n_head=2)
    model = transformers.GPT2Model(config).train()
    tokens = torch.randint(0, 100, (2, 8))
    reference = copy.deepcopy(model)
    result = optimize_quietly(model, (tokens,), mode="training")
    for target in (model, reference):
        target.h[0].attn.scaling = 1.0

    def hidden(m):
        torch.manual_seed(3)
        out = m(tokens).last_hidden_state
        out.pow(2).mean().backward()
        return out.detach(), {n: p.grad for n, p in m.named_parameters()}

    got, got_grads = hidden(result)
    expected, expected_grads = hidden(reference)
    torch.testing.assert_close(got, expected)
    assert_same({f"grad:{n}": g for n, g in expected_grads.items() if g is not None},
                {f"grad:{n}": g for n, g in got_grads.items() if g is not None})


SCALE = 2.0  # module globals the forward below reads: export bakes their values in
OFFSETS = (0.5, -0.5)
CACHE: dict = {}  # a global dict the forward reads: not guarded (test_only_constant_globals_are_guarded)


def _scaled(h):
    return h * SCALE


class ReadsGlobals(nn.Module):
    """Reads module globals through a module-level helper and through a method of its own."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def _offset(self):
        return OFFSETS[0] + len(CACHE)

    def forward(self, x):
        return self.bn(_scaled(self.fc(x))) + self._offset()


@pytest.mark.parametrize("mode", ["inference", "training"])
@pytest.mark.parametrize("name, value", [("SCALE", 3.0), ("OFFSETS", (2.0, 0.0))])
def test_a_module_global_reassigned_after_optimize_is_honoured(name, value, mode, monkeypatch):
    """A global the forward reads (through a helper function or a method) reassigned after optimize optimizes again:
    outputs, gradients and BatchNorm statistics as eager's, with a warning naming the global."""
    torch.manual_seed(0)
    model, x = ReadsGlobals().double().train(mode == "training"), torch.randn(6, 4, dtype=torch.float64)
    reference = copy.deepcopy(model)
    result = optimize_quietly(model, x, mode=mode)
    training = mode == "training"
    assert_same(step(reference, x, backward=training), step(result, x, backward=training), tol=1e-12)
    monkeypatch.setattr(sys.modules[__name__], name, value)
    with pytest.warns(UserWarning, match=f"{__name__}.{name} =="):
        got = step(result, x, backward=training)
    assert_same(step(reference, x, backward=training), got, tol=1e-12)


def test_only_constant_globals_are_guarded():
    """The constants a model's code reads are guarded (not a global dict, nor torch's own globals); Hugging Face's
    BERT, whose code reads none, gets no such guard."""
    guarded = {name for g in model_state_guards(ReadsGlobals(), "test") if g.kind == GLOBALS for name, _ in g.expected}
    assert guarded == {"SCALE", "OFFSETS"}
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64)
    assert not [g for g in model_state_guards(transformers.BertModel(config), "test") if g.kind == GLOBALS]


class NestedConfigAndPlainTensor(nn.Module):
    """Reads a field two objects deep (`cfg.model.shift`), a tensor held as a plain attribute (not a buffer) and
    tensors held in a list and a dict."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.cfg = types.SimpleNamespace(model=types.SimpleNamespace(shift=0.5))
        self.scale = torch.full((4,), 2.0)
        self.offsets = [torch.zeros(4), torch.ones(4)]  # tensors in a list and a dict, not buffers
        self.lookup = {"gain": torch.full((4,), 1.5), "name": "gain"}

    def forward(self, x):
        return (self.fc(x) * self.scale + self.cfg.model.shift + self.offsets[1]) * self.lookup[self.lookup["name"]]


NESTED_CHANGES = {
    "cfg.model.shift": lambda m: setattr(m.cfg.model, "shift", -1.5),
    "scale": lambda m: setattr(m, "scale", torch.full((4,), -3.0)),
    "offsets": lambda m: m.offsets.__setitem__(1, torch.full((4,), 0.25)),
    "lookup": lambda m: m.lookup.update(gain=torch.full((4,), 4.0)),
}


@pytest.mark.parametrize("mode", ["inference", "training"])
@pytest.mark.parametrize("change", sorted(NESTED_CHANGES))
def test_a_nested_setting_or_a_replaced_plain_tensor_is_honoured(change, mode):
    """A config field two objects deep changed, or a plain tensor attribute or a tensor in a list or dict replaced, after
    optimize: outputs and gradients as eager's after the same change, with a warning naming it."""
    torch.manual_seed(0)
    model, x = NestedConfigAndPlainTensor().train(mode == "training"), torch.randn(3, 4)
    reference = copy.deepcopy(model)
    result = optimize_quietly(model, x, mode=mode)
    backward = mode == "training"
    for target in (result, reference):
        NESTED_CHANGES[change](target)
    with pytest.warns(UserWarning, match=re.escape(change)):
        got = step(result, x, backward=backward)
    assert_same(step(reference, x, backward=backward), got, tol=0)


def test_a_write_into_a_tensor_held_in_a_list_is_read_live():
    """Writing into a tensor a list attribute holds (not replacing it) is what the graph reads next: no new optimization."""
    torch.manual_seed(0)
    model, x = NestedConfigAndPlainTensor().train(), torch.randn(3, 4)
    reference = copy.deepcopy(model)
    result = optimize_quietly(model, x, mode="training")
    with torch.no_grad():
        for target in (model, reference):
            target.offsets[1].mul_(-2)
    assert_same(step(reference, x), step(result, x), tol=0)
    assert not result.fxopt_report.guard_events
