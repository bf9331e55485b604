"""The per-call guard check's fast paths (fxopt/guards.py BoundGuards, fxopt/capture/call_spec.py CallSpec):
each kind of change is still caught, and a call is accepted from the remembered keys only when the full
check would accept it."""
from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn as nn

from fxopt import _torch_private
from fxopt.capture.call_spec import MAX_ACCEPTED_CALLS, CallSpec, TensorSpec
from fxopt.guards import (CALL, HOOKS, MODULE, REQUIRES_GRAD, SAME_OBJECT, SAME_STORAGE, SAME_VALUE, TRAIN_MODE,
                          Guard, GuardSet, model_state_guards)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)).eval()


def spec(*leaves, names=None, ranges=None, keywords=()) -> CallSpec:
    """A CallSpec for a flat call of `leaves` (the last len(keywords) of them by keyword)."""
    positional = len(leaves) - len(keywords)
    example = (tuple(range(positional)), {k: 0 for k in keywords})
    in_spec = _torch_private.tree_flatten(example)[1]
    return CallSpec(in_spec, tuple(keywords), list(leaves), names or [f"a{i}" for i in range(len(leaves))],
                    ranges or {})


X = torch.randn(2, 3, 8, 8)
X_SPEC = TensorSpec(torch.float32, "cpu", (2, 3, 8, 8))


def bound(model: nn.Module, storage: bool = True, values: tuple = ("0.weight",)):
    guards = model_state_guards(model, "test", storage=storage)
    guards += [Guard(SAME_VALUE, name, None, "test") for name in values]
    guards.append(Guard(CALL, "", spec(X_SPEC), "test"))
    return GuardSet(guards).bind(model)


CHANGES = {
    "eval_to_train": (lambda m: m[1].train(), TRAIN_MODE),
    "train_flag_on_one_leaf": (lambda m: setattr(m[3], "training", True), TRAIN_MODE),
    "freeze": (lambda m: m[3].weight.requires_grad_(False), REQUIRES_GRAD),
    "forward_hook": (lambda m: m[3].register_forward_hook(lambda *a: None), HOOKS),
    "backward_hook": (lambda m: m[0].register_full_backward_hook(lambda *a: None), HOOKS),
    "global_hook": (lambda m: nn.modules.module.register_module_forward_hook(lambda *a: None), HOOKS),
    "replaced_module": (lambda m: m.__setitem__(3, nn.Linear(4 * 6 * 6, 2)), MODULE),
    "class_changed": (lambda m: setattr(m[2], "__class__", type("Flat", (nn.Flatten,), {})), MODULE),
    "replaced_parameter": (lambda m: setattr(m[3], "weight", nn.Parameter(torch.ones(2, 144))), SAME_STORAGE),
    "replaced_buffer": (lambda m: setattr(m[1], "running_mean", torch.zeros(4)), SAME_STORAGE),
    "data_assigned": (lambda m: setattr(m[3].weight, "data", torch.ones(2, 144)), SAME_STORAGE),
    "baked_written_in_place": (lambda m: m[0].weight.detach().add_(1), SAME_VALUE),
    "baked_data_assigned": (lambda m: setattr(m[0].weight, "data", torch.ones(4, 3, 3, 3)), SAME_VALUE),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_each_kind_of_change_is_caught(change):
    """Every kind of change a guard stands for makes the fast check fail, and the slow path names that kind."""
    model = net()
    checked = bound(model)
    assert checked.first_failure((X,), {}) is None
    apply, kind = CHANGES[change]
    handle = apply(model)
    try:
        failed = checked.first_failure((X,), {})
        assert failed is not None and failed.kind == kind, failed
    finally:
        if hasattr(handle, "remove"):
            handle.remove()


def test_a_removed_hook_that_existed_when_bound_is_caught():
    """A hook present at bind time and removed later is a change (the graph may have inlined it)."""
    model = net()
    handle = model[3].register_forward_hook(lambda *a: None)
    checked = bound(model)
    assert checked.first_failure((X,), {}) is None
    handle.remove()
    assert checked.first_failure((X,), {}).kind == HOOKS


def test_writes_into_a_tensor_the_graph_reads_need_no_new_graph():
    """An in-place write into a parameter no pass baked in passes the check: the graph reads the tensor itself."""
    model = net()
    checked = bound(model)
    with torch.no_grad():
        model[3].weight.add_(1)
        model[1].running_var.mul_(2)
    assert checked.first_failure((X,), {}) is None


def test_own_writes_are_absorbed_after_a_call():
    """note_own_writes takes the versions the graph itself moved as the new expected ones."""
    model = net()
    checked = bound(model)
    with torch.no_grad():
        model[0].weight.add_(1)  # as if the graph had written it
    checked.note_own_writes()
    assert checked.first_failure((X,), {}) is None


@pytest.mark.parametrize("expected", [True, False])
def test_a_module_the_model_no_longer_has_fails_every_call(expected):
    """A TRAIN_MODE or REQUIRES_GRAD target that cannot be resolved fails whatever flag was expected."""
    model = net()
    for guard in (Guard(TRAIN_MODE, "9", expected, "test"), Guard(REQUIRES_GRAD, "9.weight", expected, "test")):
        failed = GuardSet([guard]).bind(model).first_failure((), {})
        assert failed is guard


def test_training_guards_check_object_not_storage():
    """Without storage (a training result) a replaced parameter or buffer is caught, `p.data = t` is allowed."""
    model = net()
    checked = bound(model, storage=False, values=())
    model[3].weight.data = torch.ones(2, 144)
    assert checked.first_failure((X,), {}) is None
    model[1].running_mean = torch.zeros(4)
    assert checked.first_failure((X,), {}).kind == SAME_OBJECT
    model[1].running_mean = checked._tensors[checked._tensor_targets.index("1.running_mean")]
    model[3].weight = nn.Parameter(torch.ones(2, 144))
    assert checked.first_failure((X,), {}).kind == SAME_OBJECT


# ---- CallSpec: the remembered keys ---------------------------------------------------------------------


def test_a_remembered_call_does_not_hide_a_different_shape():
    """After a call was accepted, one of another shape, dtype or device still goes to the full check and fails."""
    s = spec(X_SPEC)
    assert s.mismatch((X,), {}) is None and len(s._accepted) == 1
    assert "shape" in s.mismatch((torch.randn(1, 3, 8, 8),), {})
    assert s.mismatch((X.double(),), {}) is not None
    assert s.mismatch((X, X), {}) is not None
    assert len(s._accepted) == 1


def test_scalars_are_remembered_by_type_and_value():
    """return_dict=True accepted does not accept False, nor 1 for True (a different type)."""
    s = spec(X_SPEC, True, keywords=("return_dict",))
    assert s.mismatch((X,), {"return_dict": True}) is None
    assert s.mismatch((X,), {"return_dict": True}) is None
    assert s.mismatch((X,), {"return_dict": False}) is not None
    assert s.mismatch((X,), {"return_dict": 1}) is not None


def test_keyword_order_and_missing_keywords():
    """Keywords in another order are accepted (their own key); a missing or extra keyword is not."""
    y = torch.randn(2, 5)
    s = spec(X_SPEC, TensorSpec(torch.float32, "cpu", (2, 5)), keywords=("x", "y"))
    assert s.mismatch((), {"x": X, "y": y}) is None
    assert s.mismatch((), {"y": y, "x": X}) is None
    assert s.mismatch((), {"x": X}) is not None
    assert s.mismatch((), {"x": X, "y": y, "z": y}) is not None


def test_a_symbolic_size_is_checked_per_call_and_between_inputs():
    """With a dynamic batch, each accepted batch size is remembered; sizes that break an equality or range are not."""
    s = spec(TensorSpec(torch.float32, "cpu", ("s0", 3)), TensorSpec(torch.float32, "cpu", ("s0",)),
             ranges={"s0": (2, 8)})
    for batch in (2, 5, 2):
        assert s.mismatch((torch.randn(batch, 3), torch.randn(batch)), {}) is None
    assert len(s._accepted) == 2
    assert "s0" in s.mismatch((torch.randn(4, 3), torch.randn(5)), {})
    assert s.mismatch((torch.randn(9, 3), torch.randn(9)), {}) is not None


def test_calls_that_are_not_flat_take_the_full_check():
    """A nested list, a tensor subclass or a parameter as an argument is never remembered."""
    s = spec(X_SPEC)
    assert s.mismatch(([X],), {}) is not None
    assert s.mismatch((nn.Parameter(X.clone()),), {}) is None
    assert len(s._accepted) == 0


def test_remembered_calls_are_bounded_and_not_pickled():
    """At most MAX_ACCEPTED_CALLS keys are kept; a pickled CallSpec starts with none and still checks calls."""
    s = spec(TensorSpec(torch.float32, "cpu", ("s0",)), ranges={"s0": (2, 1000)})
    for n in range(2, MAX_ACCEPTED_CALLS + 12):
        assert s.mismatch((torch.randn(n),), {}) is None
    assert len(s._accepted) == MAX_ACCEPTED_CALLS
    again = pickle.loads(pickle.dumps(s))
    assert again._accepted == set() and again == s
    assert again.mismatch((torch.randn(3),), {}) is None and again.mismatch((torch.randn(1),), {}) is not None


class FlagProperty(nn.Linear):
    """A module whose `training` is a class-level property: Python never reads the instance __dict__ for it."""

    @property
    def training(self):
        return self.__dict__["_flag"]

    @training.setter
    def training(self, mode):
        self.__dict__["_flag"] = mode


def test_a_training_property_is_read_through_the_property():
    """A module whose `training` is a property (even with a stale `training` key in its __dict__) is still checked."""
    model = nn.Sequential(FlagProperty(3, 3)).eval()
    vars(model[0])["training"] = False  # what Python does not read: the property takes precedence
    checked = GuardSet(model_state_guards(model, "test")).bind(model)
    assert checked.first_failure((), {}) is None
    model[0].train()
    assert checked.first_failure((), {}).kind == TRAIN_MODE


def test_hook_dicts_are_read_again_after_any_hook_handle():
    """A hook handle made anywhere (here a tensor hook) makes the next check read the hook dicts; none added: it holds."""
    model = net()
    checked = bound(model)
    assert checked.first_failure((X,), {}) is None
    handle = torch.zeros(1, requires_grad=True).register_hook(lambda g: g)
    assert checked.first_failure((X,), {}) is None
    assert checked._hook_handles_seen == _torch_private.hook_handles_made()
    handle.remove()
    hook = model[1].register_forward_pre_hook(lambda *a: None)
    assert checked.first_failure((X,), {}).kind == HOOKS
    hook.remove()
    assert checked.first_failure((X,), {}) is None
