"""`verify=True`: after every pass, the optimized model must still compute what the original did.

The reference runs once on a copy of the original model; each check runs a copy of the
candidate, so neither run touches the caller's model, its buffers or its inputs. The first
check is of capture alone (`stage="capture"`), so a difference capture introduced is never
blamed on a pass. Any exception of the candidate's step (forward or backward) becomes an
FxoptError naming the stage after which it appeared. Both runs
start from the same RNG seed, torch's and Python's and NumPy's (dropout draws the same masks, and so
does a SpecAugment mask drawn from NumPy, as HF Wav2Vec2's in training). In training mode the check also
runs backward with fixed random output gradients and compares every parameter's gradient and
every buffer (BatchNorm running statistics) after the step.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.fx as fx

from .. import _torch_private
from ..errors import FxoptError
from ..host_rng import forked_host_rng
from ..model_copy import independent_copy
from ..output_selection import chosen_outputs, entries_of, parse_differentiable_outputs
from ..tree import flatten_tensors

SEED = 20261129


@dataclasses.dataclass
class StepResult:
    tensors: dict[str, torch.Tensor]  # "output[i]", "grad:<param>", "buffer:<name>"
    inputs_after: list[torch.Tensor]


def differentiated_outputs(output, declared) -> list[torch.Tensor]:
    """The output tensors a loss differentiates: all, or the entries `declared` names (indices or dict keys)."""
    selection = parse_differentiable_outputs(declared)
    if selection is None:
        return flatten_tensors(output)
    entries = entries_of(dict(output) if isinstance(output, Mapping) else output)
    chosen = chosen_outputs(entries, selection)
    return [t for key, entry in entries.items() if key in chosen for t in flatten_tensors(entry)]


def run_step(model: torch.nn.Module, example_inputs: tuple, training: bool, differentiable=None,
             input_names: dict[int, str] | None = None) -> StepResult:
    """One forward (and in training, backward) on copies; the caller's objects and random streams are untouched.
    torch's, Python's and NumPy's generators are seeded with SEED, so two runs draw the same numbers.

    `differentiable`: which outputs the loss reads (prune_dead_grads' `differentiable_outputs`).
    `input_names`: names for inputs by position (a Dynamo graph's parameter inputs: `conv1.weight`).
    """
    model = independent_copy(model)
    inputs = [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
              for x in example_inputs]
    tensors: dict[str, torch.Tensor] = {}
    with torch.random.fork_rng(devices=[]), forked_host_rng(SEED):
        torch.manual_seed(SEED)
        with torch.set_grad_enabled(training):
            result = model(*inputs)
            outputs = flatten_tensors(result)
        for i, out in enumerate(outputs):
            tensors[f"output[{i}]"] = out.detach()
        if training:
            gen = torch.Generator().manual_seed(SEED)
            loss = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device)).sum()
                       for o in differentiated_outputs(result, differentiable)
                       if o.requires_grad and o.is_floating_point())
            if isinstance(loss, torch.Tensor):
                loss.backward()
            for name, p in model.named_parameters():
                if p.grad is not None:
                    tensors[f"grad:{name}"] = p.grad
            for i, x in enumerate(inputs):
                if isinstance(x, torch.Tensor) and x.is_leaf and x.grad is not None:
                    tensors[f"grad:{(input_names or {}).get(i, f'input[{i}]')}"] = x.grad
            for name, b in model.named_buffers():
                tensors[f"buffer:{name}"] = b
    return StepResult(tensors, [x for x in inputs if isinstance(x, torch.Tensor)])


def max_difference(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], rtol: float, atol: float):
    """(largest |diff|, name of the worst tensor, whether all are within tolerance); missing keys fail.

    Tolerance is `atol * scale + rtol * |expected|`. The scale of an output or buffer is its own
    largest magnitude; for gradients it is the largest gradient of the model, because a gradient
    that is zero in exact arithmetic (a bias before a train-mode BatchNorm) is pure rounding noise
    in float32 and has no scale of its own.
    """
    grad_scale = max([float(t.abs().max()) for n, t in ref.items()
                      if n.startswith("grad:") and t.is_floating_point() and t.numel()] or [1.0])
    worst, worst_name, ok = 0.0, "", True
    for name, expected in ref.items():
        actual = got.get(name)
        if actual is None or actual.shape != expected.shape:
            return float("inf"), name, False
        if not expected.is_floating_point():
            diff = float((actual != expected).sum())
            close = diff == 0
        else:
            delta = (actual.double() - expected.double()).abs()
            diff = float(delta.max()) if delta.numel() else 0.0
            own_scale = float(expected.abs().max()) if expected.numel() else 0.0
            scale = max(1.0, grad_scale if name.startswith("grad:") else own_scale)
            close = bool((delta <= atol * scale + rtol * expected.double().abs()).all())
        if not close and ok:
            worst_name = name
        elif ok and diff > worst:
            worst_name = name
        worst = max(worst, diff)
        ok = ok and close
    return worst, worst_name, ok


def _stage(name: str) -> str:
    return "capture" if name == "capture" else f"pass {name!r}"


class Verifier:
    """The original's step, computed once, and the check of a candidate against it.

    `inputs_are_state`: the graph's inputs include state it may update in place (a Dynamo graph,
    whose parameters and buffers are inputs: BatchNorm running statistics), so each input after the
    step is compared with the original's, where a model's inputs must be left as they were.
    """

    def __init__(self, original: torch.nn.Module, example_inputs: tuple, training: bool,
                 rtol: float = 1e-4, atol: float = 1e-4, differentiable=None, inputs_are_state: bool = False):
        self.example_inputs = tuple(example_inputs)
        self.training = training
        self.rtol, self.atol = rtol, atol
        self.differentiable = differentiable
        self.inputs_are_state = inputs_are_state
        placeholders = original.graph.find_nodes(op="placeholder") if isinstance(original, fx.GraphModule) else []
        self.input_names = {i: n.meta["state_name"] for i, n in enumerate(placeholders) if "state_name" in n.meta}
        try:
            self.reference = self._step(original)
        except FxoptError:
            raise
        except Exception as e:  # noqa: BLE001 - the model itself fails: nothing to verify against
            step = "training step (forward + backward)" if training else "forward"
            raise FxoptError(f"verify=True: the original model fails a {step} on the example inputs: "
                             f"{type(e).__name__}: {e}") from e

    def check(self, candidate: torch.nn.Module, pass_name: str) -> float:
        """Return the largest difference; raise FxoptError naming `pass_name` ("capture" for capture
        alone) on a mismatch or on any exception of the candidate's step."""
        stage = _stage(pass_name)
        try:
            got = self._step(candidate)
        except FxoptError as e:
            raise FxoptError(f"verification failed after {stage}: {e}") from e
        except Exception as e:  # noqa: BLE001 - forward or backward of the optimized model raised
            step = "training step (forward + backward)" if self.training else "forward"
            raise FxoptError(f"verification failed after {stage}: the optimized model's {step} raised "
                             f"{type(e).__name__}: {e}") from e
        if not self.inputs_are_state:
            for i, (before, after) in enumerate(zip(self.example_inputs, got.inputs_after)):
                if isinstance(before, torch.Tensor) and not torch.equal(before, after.detach()):
                    raise FxoptError(f"verification failed after {stage}: it mutated input {i}")
        worst, name, ok = max_difference(self.reference.tensors, got.tensors, self.rtol, self.atol)
        if not ok:
            raise FxoptError(f"verification failed after {stage}: {name} differs from the original "
                             f"model by up to {worst:.3g}")
        return worst

    def _step(self, model: torch.nn.Module) -> StepResult:
        """One step on copies, outside any fake mode (Dynamo compiles backends inside one)."""
        with _torch_private.unset_fake_mode():
            step = run_step(model, self.example_inputs, self.training, self.differentiable, self.input_names)
        if self.inputs_are_state:
            step.tensors.update({f"after:{self.input_names.get(i, f'input[{i}]')}": x.detach()
                                 for i, x in enumerate(step.inputs_after)})
        return step

