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


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values as integers of its width: equal bits, not merely equal values (-0.0 differs from 0.0)."""
    return t.detach().contiguous().view(torch.int64 if t.dtype == torch.float64 else torch.int32)


def assert_lm_training_bits(reference: torch.nn.Module, optimized: torch.nn.Module, vocab: int, low: int = 0,
                            lengths: tuple[int, ...] = (12, 19)) -> None:
    """A Hugging Face model trained as users train it, `model(ids, attention_mask=m, labels=ids)`, one step per length
    (a padded row each), from the same seeds: every loss and parameter gradient of `optimized` has `reference`'s
    bits."""
    for step, length in enumerate(lengths):
        ids = torch.randint(low, vocab, (2, length), generator=torch.Generator().manual_seed(step))
        mask = torch.ones_like(ids)
        mask[0, -3:] = 0
        grads = []
        for m in (reference, optimized):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            loss = m(ids, attention_mask=mask, labels=ids).loss
            loss.backward()
            grads.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
        (expected_loss, expected), (loss, got) = grads
        assert torch.equal(bits(loss), bits(expected_loss))
        assert expected.keys() == got.keys()
        assert all(torch.equal(bits(got[n]), bits(expected[n])) for n in expected)


def assert_step_priced_as_measured(optimized: torch.nn.Module, captured: torch.nn.Module, measured: int,
                                   eager: int) -> None:
    """checkpoint_activations' memory model prices the rewritten step (`optimized.graph_module`) and the step as
    captured (`captured.graph_module`, no pass) at the allocator's peaks, `measured` and `eager`, within 2%."""
    from fxopt.checkpointing.profile import estimate, step_profile

    for result, peak in ((optimized, measured), (captured, eager)):
        assert abs(estimate(step_profile(result.graph_module, caller_loss=True)).peak - peak) <= 0.02 * peak
