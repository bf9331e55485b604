"""Property: on any network of conv/convT/linear/BN/ReLU/add/cat, fold_conv_bn preserves what it computes.

Hypothesis writes small programs over a pool of values: module and functional convolutions and
BatchNorms, modules shared between call sites, values read by several ops and returned as extra
outputs. Each program runs in inference and in training with frozen (and some train-mode) BNs;
the optimized model must match the original, every BN applied to a conv/linear output must be
reported (folded or refused), and a second run must change nothing.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from equivalence import assert_same_step
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import fxopt
from tests.program_net import ProgramNet
from fxopt.passes.base import PassContext
from fxopt.passes.fold_conv_bn import FoldConvBN

SIZE = 5  # spatial size; every conv keeps it (kernel 3, padding 1, stride 1)
BATCH = 8


@dataclasses.dataclass(frozen=True)
class Step:
    op: str  # conv, conv_t, linear, bn, relu, add, cat
    args: tuple[int, ...]  # indices of the values it reads
    module: str = ""  # key in Net.layers, for conv/conv_t/linear/bn
    functional: bool = False  # call F.conv*/F.batch_norm on the module's tensors instead of the module


class Net(ProgramNet):
    """The program's steps: convolutions, linear layers and BatchNorms as modules or functionals, relu, add, cat."""

    def apply(self, step: Step, a: list):
        return apply(step, self.layers[step.module] if step.module else None, a)


def apply(step: Step, layer: nn.Module | None, a: list):
    if step.op == "relu":
        return torch.relu(a[0])
    if step.op == "add":
        return a[0] + a[1]
    if step.op == "cat":
        return torch.cat(a, dim=1)
    if not step.functional:
        return layer(a[0])
    if step.op == "bn":
        return F.batch_norm(a[0], layer.running_mean, layer.running_var, layer.weight, layer.bias, False, 0.1,
                            layer.eps)
    if step.op == "conv":
        return F.conv2d(a[0], layer.weight, layer.bias, 1, 1, 1, layer.groups)
    return F.conv_transpose2d(a[0], layer.weight, layer.bias, 1, 1, 0, layer.groups)


LAYER_OPS = ("conv", "conv_t", "linear")
MODULE_TYPES = {"conv": nn.Conv2d, "conv_t": nn.ConvTranspose2d, "linear": nn.Linear, "bn": nn.BatchNorm2d}


@dataclasses.dataclass
class ProgramBuilder:
    """Grows a program step by step, keeping each value's channel count and producing op."""

    channels: list[int] = dataclasses.field(default_factory=lambda: [4])
    producers: list[str] = dataclasses.field(default_factory=lambda: [""])
    layers: dict[str, nn.Module] = dataclasses.field(default_factory=dict)
    steps: list[Step] = dataclasses.field(default_factory=list)
    bn_after_layer: int = 0  # BN sites whose input is a conv/linear output when written

    def add(self, draw, op: str, src: int) -> None:
        c, args, module, functional, out = self.channels[src], (src,), "", False, self.channels[src]
        if op in MODULE_TYPES:
            fits = [k for k, m in self.layers.items()
                    if type(m) is MODULE_TYPES[op] and input_size(m) == (SIZE if op == "linear" else c)]
            if fits and draw(st.booleans()):  # share a module with an earlier call site
                module = draw(st.sampled_from(fits))
            else:
                module = f"{op}{len(self.layers)}"
                self.layers[module] = new_layer(draw, op, c)
            out = getattr(self.layers[module], "out_channels", c)
            functional = op != "linear" and draw(st.booleans())
            self.bn_after_layer += op == "bn" and self.producers[src] in LAYER_OPS
        elif op in ("add", "cat"):
            partners = [i for i, ch in enumerate(self.channels) if op == "cat" or ch == c]
            args = (src, draw(st.sampled_from(partners)))
            out = c if op == "add" else c + self.channels[args[1]]
        self.steps.append(Step(op, args, module, functional))
        self.channels.append(out)
        self.producers.append(op)


@st.composite
def networks(draw):
    """(layers, program, outputs, BN-after-layer site count, names of train-mode BNs)."""
    torch.manual_seed(draw(st.integers(0, 2**16)))  # module initialisation replays with the example
    b = ProgramBuilder()
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["conv", "conv", "conv_t", "linear", "bn", "relu", "add", "cat"]))
        b.add(draw, op, draw(st.integers(0, len(b.channels) - 1)))
        if op in LAYER_OPS and draw(st.integers(0, 3)):  # mostly a BN right after the layer
            b.add(draw, "bn", len(b.channels) - 1)
    read = {i for step in b.steps for i in step.args}
    sinks = [i for i in range(1, len(b.channels)) if i not in read]  # every step feeds an output
    extra = draw(st.lists(st.integers(1, len(b.steps)), max_size=2, unique=True))  # multi-use outputs
    bns = [k for k, m in b.layers.items() if isinstance(m, nn.BatchNorm2d)]
    train_bns = draw(st.lists(st.sampled_from(bns), unique=True, max_size=1)) if bns else []
    return b.layers, b.steps, tuple(dict.fromkeys([*sinks, *extra])), b.bn_after_layer, train_bns


def input_size(layer: nn.Module) -> int:
    """The size of the axis a layer reads: features for Linear, channels otherwise."""
    for attr in ("in_features", "in_channels", "num_features"):
        if hasattr(layer, attr):
            return getattr(layer, attr)
    raise TypeError(type(layer).__name__)


def new_layer(draw, op: str, c: int) -> nn.Module:
    if op == "linear":  # acts on the last (width) axis: a BN after it must be refused, not folded
        return nn.Linear(SIZE, SIZE, bias=draw(st.booleans()))
    if op == "bn":
        bn = nn.BatchNorm2d(c, affine=draw(st.booleans()))
        with torch.no_grad():
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2.0)
            if bn.affine:
                bn.weight.normal_()
                bn.bias.normal_()
        return bn
    groups = draw(st.sampled_from([g for g in (1, 2, c) if c % g == 0 and 4 % g == 0]))
    out = draw(st.sampled_from([4, 8]))
    kind = nn.Conv2d if op == "conv" else nn.ConvTranspose2d
    return kind(c, out, 3, padding=1, groups=groups, bias=draw(st.booleans()))


def build(spec, training: bool) -> tuple[Net, tuple]:
    layers, program, outputs, _, train_bns = spec
    torch.manual_seed(0)
    net = Net(layers, program, outputs)
    net.train(training)
    for name, layer in net.layers.items():
        if isinstance(layer, nn.BatchNorm2d):
            layer.train(training and name in train_bns)
    return net, (torch.randn(BATCH, 4, SIZE, SIZE),)


@pytest.mark.parametrize("mode", ["inference", "training"])
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=networks())
def test_fold_conv_bn_preserves_random_networks(mode, spec):
    """Any generated network computes the same after the fold, with every BN-after-layer site reported."""
    training = mode == "training"
    net, inputs = build(spec, training)
    optimized = fxopt.optimize(net, inputs, mode=mode, passes=["fold_conv_bn"])
    assert_same_step(net, optimized, inputs, training=training)
    entry = optimized.fxopt_report["fold_conv_bn"]
    assert len(entry.sites) >= spec[3]  # more when a fold turns a BN -> BN chain into layer -> BN
    event(f"{mode}: {sorted(entry.stats.items())}")
    gm = optimized.graph_module
    before = gm.code
    again = FoldConvBN().run(gm, PassContext(mode))
    gm.recompile()
    assert not again.changed and gm.code == before
