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


def _training_steps(model: torch.nn.Module, inputs: tuple, steps: int) -> list[dict[str, torch.Tensor]]:
    """Outputs, gradients and buffers after each of `steps` forward/backward steps (gradients reset between)."""
    results = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        out = model(*inputs)
        out.pow(2).sum().backward()
        results.append({"output": out.detach().clone(),
                        **{f"grad:{n}": p.grad.clone() for n, p in model.named_parameters()},
                        **{f"buffer:{n}": b.clone() for n, b in model.named_buffers()}})
    return results


def assert_same_training_steps(reference: torch.nn.Module, optimized: torch.nn.Module, inputs: tuple, steps: int = 2,
                               rtol: float = 1e-9, atol: float = 1e-9) -> None:
    """`steps` training steps of each (in place, on their own parameters) give the same outputs, gradients, buffers."""
    expected, got = _training_steps(reference, inputs, steps), _training_steps(optimized, inputs, steps)
    for step_expected, step_got in zip(expected, got):
        assert set(step_expected) <= set(step_got), sorted(set(step_expected) - set(step_got))
        for name, value in step_expected.items():
            torch.testing.assert_close(step_got[name], value, rtol=rtol, atol=atol, msg=name)


def state_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_state_unchanged(model: torch.nn.Module, snapshot: dict[str, torch.Tensor]) -> None:
    now = model.state_dict()
    assert set(now) == set(snapshot)
    for k, v in snapshot.items():
        assert torch.equal(now[k], v), f"{k} was modified"
