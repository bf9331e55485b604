"""What `fxopt.optimize` returns: the model, optimized for its current state, guarded on every call.

An `OptimizedModule` stands for one model (`original`: the caller's model in training, a
private copy in inference). It shares that model's parameter, buffer and submodule dicts, so
`state_dict()` keys, `named_parameters()`, optimizers, `load_state_dict`, hooks registered on
`result.layer1`, `.train()` / `.eval()` / `requires_grad_()`, and setting one of the model's plain attributes
on the result (`result.sizes = [4]`) all act on the model it stands for.

It keeps optimized variants of that model, each with the guards (fxopt/guards.py) its capture
and passes relied on. Each call checks the current variant's guards (microseconds) and runs it;
when one no longer holds, the call does the right thing without the user doing anything:

  - another cached variant whose guards hold runs (alternating train()/eval() optimizes each
    state once);
  - a change of the model's state (train/eval flags, requires_grad, a replaced module or
    parameter, weights a variant baked in) optimizes the model again for the new state;
  - a call unlike the example only in its batch size (dimension 0 of its tensors) optimizes the
    model again, once, with the batch dimension dynamic (`torch.export.Dim.AUTO`): that variant
    then takes every batch size export allows (>= 2); a batch of 0 or 1, which export always fixes,
    gets a variant of its own;
  - a hook added to the model, a call unlike the example otherwise (another shape, dtype, flag), or
    a state fxopt cannot optimize runs the original model, as written;

and warns once per assumption and action, naming what changed and what fxopt did; the report
counts each (`fxopt_report.guard_events`). A variant whose baked values were overwritten can never
be valid again and is dropped. At most `MAX_VARIANTS` are kept; beyond that the original runs.

`.to()` / `.half()` / `.double()` / `.cuda()` convert the original and every variant (whatever
the call may run), then re-read the guards' tensors.
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .. import _torch_private
from ..passes.base import INFERENCE, TRAINING
from ..guards import CALL, HOOKS, SAME_VALUE, BoundGuards, Guard, GuardSet, model_state_guards

MAX_VARIANTS = 8
MAX_VALUE_REOPTIMIZATIONS = 3  # weights overwritten more often than this: stop baking them, run the original

RAN_ORIGINAL = "ran the original model"
REOPTIMIZED = "optimized the model again for its new state"
REUSED = "switched to the variant it had already optimized for this state"
MADE_BATCH_DYNAMIC = "optimized the model again with a dynamic batch dimension"
FOR_THIS_BATCH_SIZE = "optimized the model again for this batch size (export fixes batch sizes 0 and 1)"
DYNAMIC_BATCH_SETTING = "dynamic_batch"  # settings key: export the batch dimension dynamic (see build_variant)

# A failed guard of these kinds sends the call to the original model rather than to a new optimization
# (a failed CALL guard does too, unless only the batch size differs: `_settings_for_another_batch`).
_RUN_ORIGINAL_KINDS = (HOOKS,)


@dataclasses.dataclass
class Variant:
    """One optimized form of the model, and the facts it is valid under."""

    module: torch.nn.Module  # what runs: an optimized module (or the original, for a state fxopt cannot optimize)
    guards: GuardSet
    report: Any = None  # the pipeline's Report for this variant
    bound: BoundGuards | None = None  # guards resolved against the original (rebuilt after unpickling)


class OptimizedModule(torch.nn.Module):
    """See the module docstring. `graph_module` is the variant in use; `original` the fallback."""

    def __init__(self, original: torch.nn.Module, first: Variant, rebuild: Callable[..., Variant], settings: dict):
        super().__init__()
        d = self.__dict__
        d["original"] = original
        # The model's own dicts, shared (not copied): its state and submodules are the result's.
        d.update(_parameters=original._parameters, _buffers=original._buffers, _modules=original._modules,
                 _non_persistent_buffers_set=original._non_persistent_buffers_set)
        first.bound = first.guards.bind(original)  # now: the state the variant was built for
        d["_variants"] = [first]
        d["_rebuild"] = rebuild  # (original, args, kwargs, settings) -> Variant
        d["_settings"] = settings
        d["_warned"] = set()
        d["_value_reoptimizations"] = 0
        d["_unoptimizable_batch_sizes"] = set()  # batch sizes 0/1 whose own optimization failed: not tried again
        self.fxopt_report = first.report
        if first.report is not None:
            first.report.guards = list(first.guards)

    # ---- the per-call check ------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        variants = self._variants
        if variants and _bound(variants[0], self.original).first_failure(args, kwargs) is None:
            return _run(variants[0], args, kwargs)  # the current variant's guards hold: every call's path
        return self._call_after_guard_failure(args, kwargs)

    def _call_after_guard_failure(self, args: tuple, kwargs: dict):
        failed: Guard | None = None
        for i, variant in enumerate(list(self._variants)):
            failure = _bound(variant, self.original).first_failure(args, kwargs)
            if failure is None:
                self._variants.insert(0, self._variants.pop(self._variants.index(variant)))
                if failed is not None:
                    self._event(failed, REUSED)
                return _run(variant, args, kwargs)
            if failed is None:
                failed = failure
            if failure.kind == SAME_VALUE:  # its baked values were overwritten: never valid again
                self._variants.remove(variant)
        settings = self._settings
        if failed is not None and failed.kind == CALL:
            settings = self._settings_for_another_batch(failed, args, kwargs)
        if (settings is None or failed is None or failed.kind in _RUN_ORIGINAL_KINDS
                or len(self._variants) >= MAX_VARIANTS):
            self._event(failed, RAN_ORIGINAL)
            return self.original(*args, **kwargs)
        if failed.kind == SAME_VALUE:
            self.__dict__["_value_reoptimizations"] += 1
            if self._value_reoptimizations > MAX_VALUE_REOPTIMIZATIONS:
                self._event(failed, f"{RAN_ORIGINAL} (its weights keep changing between calls)")
                return self.original(*args, **kwargs)
        action = REOPTIMIZED
        if failed.kind == CALL:
            action = MADE_BATCH_DYNAMIC if settings is not self._settings else FOR_THIS_BATCH_SIZE
        self.__dict__["_settings"] = settings  # once a call brought another batch size, every later variant is dynamic
        variant, error = self._optimize_for_current_state(args, kwargs, remember_failure=failed.kind != CALL)
        if variant is None:
            if action == FOR_THIS_BATCH_SIZE:
                self._unoptimizable_batch_sizes.add(_batch_sizes(args, kwargs))
            self._event(failed, f"{RAN_ORIGINAL} (optimizing it again failed: {error})")
            return self.original(*args, **kwargs)
        self._variants.insert(0, variant)
        self._event(failed, action)
        return _run(variant, args, kwargs)

    def _settings_for_another_batch(self, failed: Guard, args: tuple, kwargs: dict) -> dict | None:
        """The settings to optimize again with for a call unlike the example only in its batch size, or None
        (run the original): a batch of at least 2 makes the batch dimension dynamic, once, and that variant then
        takes every such size; a batch of 0 or 1 (sizes export always specializes) gets a variant of its own."""
        if not failed.expected.differs_only_in_batch(args, kwargs):
            return None
        sizes = _batch_sizes(args, kwargs)
        if min(sizes, default=2) < 2:
            return None if sizes in self._unoptimizable_batch_sizes else self._settings
        if self._settings.get(DYNAMIC_BATCH_SETTING):
            return None
        return {**self._settings, DYNAMIC_BATCH_SETTING: True}

    def _optimize_for_current_state(self, args: tuple, kwargs: dict, *,
                                    remember_failure: bool = True) -> tuple[Variant | None, str]:
        """A new variant for the model as it is now, or (None, why not); with `remember_failure`, a variant
        running the original is then kept for this state, so later calls in it do not try again."""
        settings = self._settings
        if settings["mode"] == INFERENCE and any(m.training for m in self.original.modules()):
            # switched (even one layer) to train(): a training step may follow, so optimize for training
            settings = {**settings, "mode": TRAINING}
        try:
            with _clean_optimization_context():
                variant = self._rebuild(self.original, args, kwargs, settings)
            variant.bound = variant.guards.bind(self.original)
            return variant, ""
        except Exception as e:  # noqa: BLE001 - whatever fails, the original still computes the right thing
            reason = f"{type(e).__name__}: {e}".splitlines()[0]
        if not remember_failure:
            return None, reason
        guards = GuardSet(model_state_guards(self.original, "fxopt", graph_paths=()))  # runs as written: nothing baked
        self._variants.insert(0, Variant(self.original, guards, bound=guards.bind(self.original)))
        return None, reason

    def _event(self, guard: Guard | None, action: str) -> None:
        """Warn once per (assumption, action) and count it in the report."""
        what = guard.describe() if guard is not None else "no cached variant"
        who = f" ({guard.owner}: {guard.reason})" if guard is not None and guard.reason else ""
        key = (what, action)
        if self.fxopt_report is not None:
            self.fxopt_report.guard_events[f"{what}: {action}"] += 1
        if key in self._warned:
            return
        self._warned.add(key)
        warnings.warn(f"fxopt: the optimized model assumed {what}{who}; that no longer holds, so fxopt {action}",
                      stacklevel=6)  # the line that called the result

    # ---- behaving like the model ---------------------------------------------------------------

    @property
    def graph_module(self) -> torch.nn.Module:
        """The optimized module in use (the most recently run variant)."""
        return self._variants[0].module

    @property
    def variants(self) -> list[Variant]:
        return list(self._variants)

    def _get_training(self) -> bool:
        original = self.__dict__.get("original")
        return original.training if original is not None else self.__dict__.get("_training", True)

    def _set_training(self, mode: bool) -> None:
        original = self.__dict__.get("original")
        if original is not None:
            original.training = mode
        else:
            self.__dict__["_training"] = mode

    training = property(_get_training, _set_training)

    def train(self, mode: bool = True):
        self.original.train(mode)
        return self

    def _apply(self, fn, recurse=True):
        """Convert the original and every variant (`.to()`, `.half()`), then re-read the guards' tensors."""
        self.original._apply(fn, recurse)
        for variant in self._variants:
            if variant.module is not self.original:
                variant.module._apply(fn, recurse)
            variant.bound = variant.guards.bind(self.original)  # converted alike: valid for the new tensors
        return self

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("original")
            if original is None:
                raise
            return getattr(original, name)

    def __setattr__(self, name: str, value) -> None:
        """A plain attribute the model has (`result.drop_rate = 0.2`, `result.sizes = [4]`) is set on the model, which
        is what runs and what the guards read; a submodule, parameter or buffer lands in the shared dicts anyway."""
        original = self.__dict__.get("original")
        if (original is not None and name not in self.__dict__ and not hasattr(type(self), name)
                and name in vars(original)):
            setattr(original, name, value)
        else:
            super().__setattr__(name, value)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_variants"] = [dataclasses.replace(v, bound=None) for v in self._variants]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)

    def extra_repr(self) -> str:
        return f"{type(self.original).__name__}, {len(self._variants)} variant(s)"


def _bound(variant: Variant, original: torch.nn.Module) -> BoundGuards:
    """The variant's guards resolved against `original` (after unpickling: bound at the first call)."""
    if variant.bound is None:
        variant.bound = variant.guards.bind(original)
    return variant.bound


def _batch_sizes(args: tuple, kwargs: dict) -> tuple[int, ...]:
    """The sizes of dimension 0 of the call's tensors, each once, in order."""
    return tuple(sorted({t.shape[0] for t in _torch_private.tree_leaves((args, kwargs))
                         if isinstance(t, torch.Tensor) and t.dim() > 0}))


def _run(variant: Variant, args: tuple, kwargs: dict):
    out = variant.module(*args, **kwargs)
    variant.bound.note_own_writes()
    return out


@contextlib.contextmanager
def _clean_optimization_context():
    """Optimize as `fxopt.optimize` would be called: grad enabled, no autocast, the caller's RNG untouched."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), torch.enable_grad(), contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda") if devices else ("cpu",):
            stack.enter_context(torch.autocast(device, enabled=False))
        yield
