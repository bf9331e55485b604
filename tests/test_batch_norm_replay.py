"""A train-mode BatchNorm in a checkpointed region is recomputed from its kept batch statistics, bit for bit
(fxopt.checkpointing._batch_norm_replay), and computes them again wherever ATen's kernels would not agree."""
from __future__ import annotations

import copy
import dataclasses
import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fxopt
from fxopt.checkpointing._batch_norm_replay import KeptStatistics, replay, replayed_batch_norm, replays_statistics
from fxopt.checkpointing.profile import Region, step_profile
from fxopt.checkpointing.eager_region import extract_region
from graph_forms import exported_graph

SHAPES = [(4, 24, 28, 28), (2, 7, 5, 3), (3, 16), (3, 16, 9), (2, 8, 3, 4, 5), (2, 33, 1, 1), (16, 96, 7, 7)]


def _laid_out(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    if not channels_last:
        return x
    return x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no_affine"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_replay_gives_the_same_bits(dtype, channels_last, affine):
    """Replaying from the kept statistics gives ATen's train-mode output bit for bit, in its memory format."""
    torch.manual_seed(0)
    for shape, eps in itertools.product(SHAPES, (1e-5, 1e-3)):
        if channels_last and len(shape) not in (4, 5):
            continue
        x = _laid_out(torch.randn(shape, dtype=dtype) * 3 + 1, channels_last)
        weight, bias = (torch.randn(shape[1], dtype=dtype), torch.randn(shape[1], dtype=dtype)) if affine else (None, None)
        assert replays_statistics(x, weight, bias)
        out, mean, invstd = torch.ops.aten.native_batch_norm(x, weight, bias, None, None, True, 0.1, eps)
        replayed = replay(x, bias, KeptStatistics.of(weight, mean, invstd))
        assert torch.equal(replayed, out) and replayed.stride() == out.stride(), (shape, eps)


def test_what_is_not_replayed():
    """A strided input, a bfloat16 input and parameters of another dtype run other kernels: not replayed."""
    x, weight = torch.randn(4, 8, 10, 12), torch.randn(8)
    assert replays_statistics(x, weight, weight)
    assert not replays_statistics(x[:, :, ::2], weight, weight)
    assert not replays_statistics(x.bfloat16(), weight.bfloat16(), weight.bfloat16())
    assert not replays_statistics(x.double(), weight, weight)


class _BatchNormCalls(TorchDispatchMode):
    """Records the `training` flag of every native_batch_norm it sees."""

    def __init__(self):
        super().__init__()
        self.training_flags = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.native_batch_norm.default:
            self.training_flags.append(args[5])
        return func(*args, **(kwargs or {}))


class _Blocks(nn.Module):
    """Conv-BN-ReLU blocks; with `strided`, each BatchNorm reads a transposed (strided) view."""

    def __init__(self, strided: bool):
        super().__init__()
        self.strided = strided
        self.convs = nn.ModuleList(nn.Conv2d(8, 8, 3, padding=1) for _ in range(3))
        self.norms = nn.ModuleList(nn.BatchNorm2d(8) for _ in range(3))

    def forward(self, x):
        for conv, norm in zip(self.convs, self.norms):
            y = conv(x)
            x = F.relu(norm(y.transpose(2, 3) if self.strided else y))
        return x


class _FirstOutput(nn.Module):
    """A captured graph (which returns a tuple) called as the model: its one output."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__()
        self.gm = gm

    def forward(self, x):
        (out,) = self.gm(x)
        return out


def _optimized_with_one_region(model: nn.Module, x: torch.Tensor, save_compute_intensive: bool, replayed: bool = True):
    """`model` captured (on its own tensors), every node after its first convolution in one region of the given
    kind; its BatchNorms asserted `replayed` or not."""
    gm = exported_graph(model, (x,))
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert {replayed_batch_norm(n) for n in calls if "batch_norm" in n.name} == {replayed}
    extract_region(gm, calls[1:], "checkpointed_blocks", save_compute_intensive)
    gm.recompile()
    return _FirstOutput(gm)


def _two_steps(model: nn.Module, x: torch.Tensor, record: _BatchNormCalls | None = None) -> dict:
    """Outputs, input and parameter gradients and buffers after two steps on a copy (backward under `record`)."""
    model, x = copy.deepcopy(model), x.clone().requires_grad_()
    for _ in range(2):
        out = model(x)
        loss = (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum()
        if record is None:
            loss.backward()
        else:
            with record:
                loss.backward()
    name = lambda n: n.removeprefix("gm.")  # noqa: E731 - a _FirstOutput holds the graph's state as `gm.<model's name>`
    return {"output": out.detach(), "grad:input": x.grad,
            **{f"grad:{name(n)}": p.grad for n, p in model.named_parameters()},
            **{f"buffer:{name(n)}": b for n, b in model.named_buffers()}}


@pytest.mark.parametrize("save_compute_intensive", [False, True], ids=["whole", "selective"])
@pytest.mark.parametrize("strided", [False, True], ids=["replayed", "strided_recomputed"])
def test_region_step_is_bit_exact_in_float32(strided, save_compute_intensive):
    """In float32 a region's step gives eager's outputs, gradients and running statistics bit for bit; its
    recomputation replays each BatchNorm (an eval-mode kernel call) or, on a strided input, computes the statistics
    again."""
    torch.manual_seed(0)
    model, x = _Blocks(strided).train(), torch.randn(2, 8, 12, 12)
    opt = _optimized_with_one_region(model, x, save_compute_intensive, replayed=not strided)
    record = _BatchNormCalls()
    expected, got = _two_steps(model, x), _two_steps(opt, x, record)
    assert expected.keys() == got.keys()
    assert all(torch.equal(got[k], v) for k, v in expected.items()), [k for k, v in expected.items()
                                                                      if not torch.equal(got[k], v)]
    assert record.training_flags == [strided] * 6  # three recomputed BatchNorms per step


def test_double_backward_matches_eager():
    """Gradients of gradients through a replayed BatchNorm equal eager's in float64."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Tanh(), nn.Conv2d(4, 2, 1)).double().train()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    opt = _optimized_with_one_region(model, x, save_compute_intensive=False)

    def grad_of_grad(m):
        xx = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(m(xx).pow(2).sum(), xx, create_graph=True)
        return g, torch.autograd.grad(g.pow(2).sum(), xx)[0]

    for expected, got in zip(grad_of_grad(copy.deepcopy(model)), grad_of_grad(opt)):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_replay_priced_below_recomputing():
    """The timed profile measures a replayed BatchNorm's replay, and a region holding it costs what the replay saves
    less (how much that is: benchmarks/batch_norm_replay.py)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 8, 1)).train()
    opt = fxopt.optimize(model, (torch.randn(4, 3, 56, 56),), mode="training", passes=[])
    profile = step_profile(opt.graph_module, timed=True)
    position = next(p for p, s in enumerate(profile.steps) if s.node.name.startswith("batch_norm"))
    step = profile.steps[position]
    assert replayed_batch_norm(step.node) and step.replay_seconds > 0
    assert step.replay_saving == max(0, round((step.seconds - step.replay_seconds) * 1e9))
    region = Region(position, position + 2)
    without_replay = profile.repriced([dataclasses.replace(s, replay_seconds=None) if s is step else s
                                       for s in profile.steps])  # priced alike, without region overhead
    assert profile.region_cost(region) - profile.overhead_ns(region) == (without_replay.region_cost(region)
                                                                         - step.replay_saving)
