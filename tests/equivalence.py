"""Shared test helper: the optimized model must compute what the original computes.

Uses fxopt's own verifier step (deep copies, same RNG seed, fixed output gradients), so a
test compares outputs, every parameter's gradient and every buffer in one call.
"""
from __future__ import annotations

import torch

from fxopt.pipeline.verify import max_difference, run_step


def assert_same_step(original: torch.nn.Module, optimized: torch.nn.Module, inputs: tuple, training: bool,
                     rtol: float = 1e-4, atol: float = 1e-4) -> None:
    ref = run_step(original, inputs, training).tensors
    got = run_step(optimized, inputs, training).tensors
    assert set(ref) <= set(got), f"missing in optimized: {sorted(set(ref) - set(got))}"
    worst, name, ok = max_difference(ref, got, rtol, atol)
    assert ok, f"{name} differs by {worst:.3g}"


def state_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_state_unchanged(model: torch.nn.Module, snapshot: dict[str, torch.Tensor]) -> None:
    now = model.state_dict()
    assert set(now) == set(snapshot)
    for k, v in snapshot.items():
        assert torch.equal(now[k], v), f"{k} was modified"
