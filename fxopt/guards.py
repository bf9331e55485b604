"""Guards: the facts an optimized graph relies on, as data, and a check cheap enough for every call.

A pass or capture that relies on a fact about the model records one `Guard`: what kind of
fact, about which module / parameter / input (`target`, a path in the model as the caller
sees it), the value relied on, who relies on it (`owner`: "capture" or a pass name) and why.

    ctx.guards.add(Guard(TRAIN_MODE, "layer1.0.bn1", False, "fold_conv_bn", "folded into layer1.0.conv1"))

The optimized result binds its `GuardSet` to the model it stands for (`bind(model)`): paths
are resolved once into the objects to read, grouped by kind and by expected value, so a call
runs a few C-level loops over flat lists (`not any(map(training, eval_modules))`, microseconds
for hundreds of modules).
`BoundGuards.first_failure(args, kwargs)` returns None, or the first guard that no longer
holds, so the result can say which assumption changed.

Kinds (what `expected` holds):
  TRAIN_MODE     module path     -> bool: `module.training`
  REQUIRES_GRAD  parameter name  -> bool: `p.requires_grad`
  HOOKS          module path     -> the hook ids per kind (forward-pre, forward, backward-pre, backward)
                 at record time, usually all empty; target GLOBAL_HOOKS: torch's global module hooks.
                 Empty dicts are re-read only after torch made a hook handle: a hook registered through
                 torch's API is always seen, one written straight into a module's private dict is not
  MODULE         module path     -> class name: the same module object, of the same class, sits at the path
                 (catches a replaced layer, `torch.nn.utils.parametrize`, old-style weight_norm's class change)
  SAME_OBJECT    param/buffer    -> None: the same tensor object is registered under that name (or held as a
                 plain attribute: `self.scale = torch.ones(4)`)
                 (catches `torch.nn.utils.prune`, `module.weight = nn.Parameter(...)`, a replaced
                 buffer; the graph reads the model's own tensor objects, so writes into them need
                 no guard)
  SAME_STORAGE   param/buffer    -> None: the same object over the same storage as when bound (export
                 specialized the graph to its shape and dtype, which `p.data = t` may change; catches
                 that without bumping a version; writes into the storage need no guard)
  SAME_VALUE     param/buffer    -> None: the same object with the same storage and version as when
                 bound (a value baked into the graph; catches `copy_`, optimizer steps, `load_state_dict`,
                 `p.data = t`; NOT `p.data.mul_()`, which bumps no version counter)
  SETTINGS       module path     -> ((name, value), ...): the module's plain attributes (numbers, strings,
                 flags, dtypes, and tuples, lists, sets and dicts of them: `Dropout.p`,
                 `LeakyReLU.negative_slope`, `BatchNorm.eps`) and those of the plain objects it holds (an HF
                 config: `config.output_attentions`) and that these hold (`cfg.model.dropout`, up to
                 SETTINGS_DEPTH objects deep), as captured. torch.export reads them once and bakes
                 them into the graph; reassigning one (`model.drop.p = 0.2`) is caught, and so is changing
                 a list or dict in place (`model.sizes[0] = 8`): lists, sets and dicts are recorded as
                 copies and compared by value; a list, tuple or dict holding tensors is recorded as its
                 items, the tensors compared by identity (`SameItems`: `model.anchors[0] = t` is seen)
  GLOBALS        Python module   -> ((name, value), ...): the module-level globals holding constants
                 (numbers, strings, flags, tuples of them) the model's own code loads by name (`SCALE` in
                 `x * SCALE`: fxopt.global_reads), as captured; export bakes them in like settings, and
                 they are checked the same way. A global list or dict is not guarded (often a cache)
  CALL           graph path      -> an object with `mismatch(args, kwargs) -> str | None` (None: the
                 graph may take the call, else why not) and `describe()`: capture's own call check (CallSpec)
"""
from __future__ import annotations

import copy
import dataclasses
import enum
import operator
import sys
import types
from collections.abc import Iterable, Iterator
from itertools import repeat
from operator import attrgetter, is_, itemgetter
from typing import Any

import torch

from . import _torch_private
from .global_reads import globals_read
from .user_code import plain_attributes

TRAIN_MODE = "train_mode"
REQUIRES_GRAD = "requires_grad"
HOOKS = "hooks"
MODULE = "module"
SAME_OBJECT = "same_object"
SAME_STORAGE = "same_storage"
SAME_VALUE = "same_value"
SETTINGS = "settings"
GLOBALS = "globals"
CALL = "call"
KINDS = (TRAIN_MODE, REQUIRES_GRAD, HOOKS, MODULE, SAME_OBJECT, SAME_STORAGE, SAME_VALUE, SETTINGS, GLOBALS, CALL)
_NAMED_VALUES = (SETTINGS, GLOBALS)  # kinds whose expected is ((name, value), ...), read from a __dict__ each

NO_HOOKS = ((), (), (), ())
GLOBAL_HOOKS = "<global>"  # the HOOKS target for torch's global module hooks


@dataclasses.dataclass(frozen=True)
class Guard:
    """One fact an optimized graph relies on (see the module docstring for the kinds)."""

    kind: str
    target: str  # module path, parameter/buffer name, or graph path (CALL)
    expected: Any
    owner: str  # "capture" or the name of the pass that relies on it
    reason: str = ""  # why the owner relies on it, one short sentence

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown guard kind {self.kind!r}; kinds: {', '.join(KINDS)}")

    def describe(self) -> str:
        """The fact in words: `layer1.0.bn1 in eval mode`."""
        where = self.target or "the model"
        if self.kind == TRAIN_MODE:
            return f"{where} in {'train' if self.expected else 'eval'} mode"
        if self.kind == REQUIRES_GRAD:
            return f"{self.target}.requires_grad is {self.expected}"
        if self.kind == HOOKS:
            scope = "torch's global module hooks" if self.target == GLOBAL_HOOKS else where
            return f"no hooks added to or removed from {scope}"
        if self.kind == MODULE:
            return f"{where} is the same {self.expected} module"
        if self.kind == SAME_OBJECT:
            return f"{self.target} is the same tensor object"
        if self.kind == SAME_STORAGE:
            return f"{self.target} is the same tensor over the same storage"
        if self.kind == SAME_VALUE:
            return f"{self.target} keeps its value (same tensor, storage and version)"
        if self.kind in _NAMED_VALUES:
            shown = ", ".join(f"{'.'.join(filter(None, (self.target, name)))} == {value!r}"
                              for name, value in self.expected[:3])
            return shown + (f" and {len(self.expected) - 3} more settings" if len(self.expected) > 3 else "")
        return f"calls like the example ({self.expected.describe()})"

    def to_dict(self) -> dict[str, Any]:
        expected = self.expected
        if self.kind == CALL:
            expected = expected.describe()
        elif not (expected is None or isinstance(expected, (bool, int, float, str))):
            expected = repr(expected)
        return {"kind": self.kind, "target": self.target, "expected": expected, "owner": self.owner,
                "reason": self.reason, "describe": self.describe()}


class GuardSet:
    """The guards of one optimized model, in the order recorded; one per (kind, target): the first,
    so a pass's or capture's specific reason wins over the whole-model default."""

    def __init__(self, guards: Iterable[Guard] = ()):
        self._guards: dict[tuple, Guard] = {}
        self.extend(guards)

    def add(self, guard: Guard) -> None:
        self._guards.setdefault((guard.kind, guard.target), guard)

    def extend(self, guards: Iterable[Guard]) -> None:
        for g in guards:
            self.add(g)

    def __iter__(self) -> Iterator[Guard]:
        return iter(self._guards.values())

    def __len__(self) -> int:
        return len(self._guards)

    def bind(self, model: torch.nn.Module) -> BoundGuards:
        return BoundGuards(list(self), model)

    def summary(self) -> list[tuple[str, str, int, str]]:
        """(owner, kind, how many, first target) per owner and kind, for the report."""
        groups: dict[tuple[str, str], list[Guard]] = {}
        for g in self:
            groups.setdefault((g.owner, g.kind), []).append(g)
        return [(owner, kind, len(gs), gs[0].describe()) for (owner, kind), gs in groups.items()]


# Why an optimized model relies on each part of the model's state (the whole-model default guards).
STATE_REASONS = {
    TRAIN_MODE: "the graph was captured in this mode (batch_norm's training and dropout's train are baked in)",
    MODULE: "the graph inlines this module's code",
    HOOKS: "hooks added later would not run inside the graph",
    REQUIRES_GRAD: "passes decided what keeps a gradient from requires_grad",
    SAME_OBJECT: "the graph reads this tensor object",
    SAME_STORAGE: "the graph reads this tensor object, specialized to its shape and dtype",
    SETTINGS: "the graph was traced with these values baked in",
    GLOBALS: "the graph was traced with these global values baked in",
}


def model_state_guards(model: torch.nn.Module, owner: str, *, storage: bool = False,
                       graph_paths: Iterable[str] | None = None) -> list[Guard]:
    """Guards on the whole state of `model` as it is now: every module's mode, class, hooks and settings
    (SETTINGS), the plain globals its code reads (GLOBALS), every parameter's `requires_grad`, every
    parameter's, buffer's and plain tensor attribute's identity, and with `storage` their storage too
    (SAME_STORAGE instead of SAME_OBJECT). Not their values: the graph reads the
    model's tensors, so a write into one is what the model computes next too; a pass that bakes a
    value into the graph guards that value itself (SAME_VALUE). Reasons: STATE_REASONS.

    Settings and globals are guarded only where a graph baked them: for the modules at or under `graph_paths`
    (the paths of the exported graphs; None: the whole model is one). A module whose forward runs as written
    reads them live, as eager does (a forward counting its calls in `self.calls` must not look like a change)."""
    same = SAME_STORAGE if storage else SAME_OBJECT
    graph_paths = [""] if graph_paths is None else list(graph_paths)

    def baked(path: str) -> bool:
        return any(p == "" or path == p or path.startswith(p + ".") for p in graph_paths)

    def guard(kind, target, expected):
        return Guard(kind, target, expected, owner, STATE_REASONS[kind])

    guards = [guard(HOOKS, GLOBAL_HOOKS, _hook_ids(None))]
    objects_read = set()  # ids of the held objects whose settings are guarded already (one config, many modules)
    baked_modules, tensor_attributes = [], []
    for path, module in model.named_modules(remove_duplicate=False):
        guards += [guard(TRAIN_MODE, path, module.training), guard(MODULE, path, type(module).__qualname__),
                   guard(HOOKS, path, _hook_ids(module))]
        if not baked(path):
            continue
        baked_modules.append(module)
        settings = _settings(module, objects_read)
        if settings:
            guards.append(guard(SETTINGS, path, settings))
        # tensors held as plain attributes (`self.scale = torch.ones(4)`): export reads the object
        tensor_attributes += [_join(path, name) for name, value in plain_attributes(module).items()
                              if isinstance(value, torch.Tensor)]
    for name, p in model.named_parameters(remove_duplicate=False):
        guards += [guard(REQUIRES_GRAD, name, p.requires_grad), guard(same, name, None)]
    guards += [guard(same, name, None) for name, _ in model.named_buffers(remove_duplicate=False)]
    guards += [guard(same, name, None) for name in tensor_attributes]
    guards += [guard(GLOBALS, module_name, constants) for module_name, constants in _constants_read(baked_modules)]
    return guards


# ---- reading the model --------------------------------------------------------------------

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _hook_dicts(module: torch.nn.Module | None) -> list[dict]:
    """The four hook dicts of `module`, or torch's global module hook dicts for None."""
    if module is None:
        return _torch_private.global_module_hook_dicts()
    return [getattr(module, name, {"missing module": None}) for name in _HOOK_DICTS]


def _hook_ids(module: torch.nn.Module | None) -> tuple:
    return tuple(tuple(d) for d in _hook_dicts(module))


_PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum)


def _is_plain(value) -> bool:
    """A value export bakes into a graph as a constant and `==` compares cheaply: a number, string, flag,
    dtype, device or enum member, or a tuple, list, set or dict of those (a Conv's `padding`, a list of sizes)."""
    if isinstance(value, (tuple, list, set, frozenset)):
        return all(map(_is_plain, value))
    if isinstance(value, dict):
        return all(map(_is_plain, value.keys())) and all(map(_is_plain, value.values()))
    return isinstance(value, _PLAIN_TYPES)


def _is_constant(value) -> bool:
    """A plain value that cannot change in place (a number, string, flag, None, or a tuple of those): the module
    globals guarded. A global list or dict is often a cache the code fills, which would re-optimize at every fill."""
    return _is_plain(value) and not _holds_mutable(value)


def _recorded(value):
    """What a SETTINGS guard keeps of a plain value: a copy of one that can change in place (a list, set or dict,
    also inside a tuple), so that a later in-place change no longer compares equal; the value itself otherwise."""
    return copy.deepcopy(value) if _holds_mutable(value) else value


def _holds_mutable(value) -> bool:
    if isinstance(value, (list, set, dict)):
        return True
    return isinstance(value, (tuple, frozenset)) and any(map(_holds_mutable, value))


def _holds_tensors(value) -> bool:
    """A list, tuple or dict of tensors and plain values, with at least one tensor (`self.anchors = [t0, t1]`)."""
    items = list(value.values()) if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else None
    return (items is not None and any(isinstance(v, torch.Tensor) for v in items)
            and all(isinstance(v, torch.Tensor) or _is_plain(v) for v in items))


class SameItems:
    """What a SETTINGS guard keeps of a list, tuple or dict holding tensors: its keys and items as they are now,
    compared with a later value tensor by tensor by identity (export reads those objects: a write into one is read
    live, a replaced one is not), the rest by `==`. Compared from either side (`[t] == SameItems([t])`)."""

    def __init__(self, value):
        self.kind = type(value)
        self.keys, self.items = _keys_and_items(value)

    def __eq__(self, other) -> bool:
        if type(other) is not self.kind:
            return False
        keys, items = _keys_and_items(other)
        return keys == self.keys and len(items) == len(self.items) and all(map(_same_item, items, self.items))

    __hash__ = None

    def __repr__(self) -> str:
        return f"{self.kind.__name__} of {len(self.items)} (its tensors the same objects)"


def _keys_and_items(value) -> tuple[list, list]:
    return (list(value.keys()), list(value.values())) if isinstance(value, dict) else ([], list(value))


def _same_item(now, then) -> bool:
    """Tensors by identity (never `==`, whose result is a tensor), anything else by `==`."""
    if isinstance(now, torch.Tensor) or isinstance(then, torch.Tensor):
        return now is then
    return now == then


def _holds_settings(value) -> bool:
    """An object a module holds for its plain attributes (an HF config), not a module, tensor or callable."""
    return (hasattr(value, "__dict__") and not callable(value)
            and not isinstance(value, (torch.nn.Module, torch.Tensor, types.ModuleType)))


SETTINGS_DEPTH = 3  # plain-data objects read this deep: a module's `self.cfg.model.dropout`


def _settings(module: torch.nn.Module, objects_read: set[int]) -> tuple[tuple[str, Any], ...]:
    """(name, value) of the plain attributes in `module`'s own __dict__ and, as `holder.name`, in the __dict__
    of each plain-data object it holds (`config.scale`), and of those these hold in turn (`cfg.model.dropout`),
    SETTINGS_DEPTH objects deep, each object once: the objects `objects_read` does not name yet (then added)."""
    return tuple(_plain_settings(plain_attributes(module), "", objects_read, SETTINGS_DEPTH))


def _plain_settings(attributes: dict, prefix: str, objects_read: set[int], depth: int) -> list[tuple[str, Any]]:
    settings = []
    for name, value in attributes.items():
        if _is_plain(value):
            settings.append((prefix + name, _recorded(value)))
        elif _holds_tensors(value):
            settings.append((prefix + name, SameItems(value)))
        elif depth and _holds_settings(value) and id(value) not in objects_read:
            objects_read.add(id(value))
            settings += _plain_settings(vars(value), f"{prefix}{name}.", objects_read, depth - 1)
    return settings


def _settings_dict(module, name: str) -> dict:
    """The __dict__ a SETTINGS entry `name` ("p", "config.use_cache" or "cfg.model.dropout") is read from."""
    holder, _, _ = name.rpartition(".")
    try:
        owner = attrgetter(holder)(module) if holder else module
    except AttributeError:  # a holder no longer there: the setting is not as recorded
        return {}
    return vars(owner) if hasattr(owner, "__dict__") else {}


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _constants_read(modules: list[torch.nn.Module]) -> list[tuple[str, tuple]]:
    """(Python module name, ((global name, value), ...)) of the constants (`_is_constant`) the code of `modules`
    loads by global name (fxopt.global_reads), per Python module holding some."""
    read = []
    for module_name, names in sorted(globals_read(modules).items()):
        module_globals = vars(sys.modules[module_name]) if module_name in sys.modules else {}
        constants = tuple((name, module_globals[name]) for name in sorted(names) if _is_constant(module_globals[name]))
        if constants:
            read.append((module_name, constants))
    return read


def _resolve_tensor(model: torch.nn.Module, name: str) -> tuple[dict, str]:
    """(the `_parameters` or `_buffers` dict holding `name`, or the module's own __dict__ for a plain tensor
    attribute, the key in it)."""
    owner_path, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_path)
    for holder in (owner._parameters, owner._buffers):
        if attr in holder:
            return holder, attr
    return (vars(owner) if isinstance(vars(owner).get(attr), torch.Tensor) else owner._buffers), attr


def _module_slot(model: torch.nn.Module, path: str) -> tuple[dict, str]:
    """(the `_modules` dict of the parent of `path`, the key): where a replaced submodule would go.

    The root has no parent; a one-entry dict holding it stands in, so its class is still checked.
    """
    if not path:
        return {"": model}, ""
    parent_path, _, attr = path.rpartition(".")
    try:
        return model.get_submodule(parent_path)._modules, attr
    except AttributeError:
        return {}, attr


class _Unresolvable:
    """Stands in for an object a guard names but the model no longer has: every check of it fails."""

    training = requires_grad = _version = object()


class BoundGuards:
    """Guards resolved against one model: `first_failure()` is the per-call check.

    Each kind becomes flat lists of objects to read, split by expected value where it is a flag
    (`not any(map(training, eval_modules))`: no list built, no comparison per element), so a call
    runs a handful of C-level loops. Only on a mismatch does it look for which guard failed.
    """

    def __init__(self, guards: list[Guard], model: torch.nn.Module):
        self.guards = guards
        self.model = model
        by_kind: dict[str, list[Guard]] = {k: [] for k in KINDS}
        for g in guards:
            by_kind[g.kind].append(g)
        self._by_kind = by_kind
        self._modules = [self._module(g.target) for g in by_kind[TRAIN_MODE]]
        self._params = [self._tensor(g.target) for g in by_kind[REQUIRES_GRAD]]
        # A target the model no longer has fails every call (its stand-in's flag is neither True nor False).
        self._unresolved = any(isinstance(x, _Unresolvable) for x in (*self._modules, *self._params))
        # `training` read straight from a module's __dict__ where that is where Python finds it (3x faster)
        train, evaluating = _split_by_flag(self._modules, by_kind[TRAIN_MODE])
        self._train_dicts = [vars(m) for m in train if _training_in_dict(m)]
        self._eval_dicts = [vars(m) for m in evaluating if _training_in_dict(m)]
        self._train_modules = [m for m in train if not _training_in_dict(m)]
        self._eval_modules = [m for m in evaluating if not _training_in_dict(m)]
        self._grad_params, self._frozen_params = _split_by_flag(self._params, by_kind[REQUIRES_GRAD])
        self._hook_dicts_per_guard = [_hook_dicts(None if g.target == GLOBAL_HOOKS else self._module(g.target))
                                      for g in by_kind[HOOKS]]
        self._hooks_empty, self._hooks_kept, self._hooks_kept_expected = [], [], []
        for g, dicts in zip(by_kind[HOOKS], self._hook_dicts_per_guard):
            for d, ids in zip(dicts, g.expected):
                if ids:
                    self._hooks_kept.append(d)
                    self._hooks_kept_expected.append(ids)
                else:
                    self._hooks_empty.append(d)
        self._hook_handles_seen = -1  # torch's hook-handle count when the empty hook dicts were last found empty
        slots = [_module_slot(model, g.target) for g in by_kind[MODULE]]
        self._slot_dicts = [slot for slot, _ in slots]
        self._slot_keys = [key for _, key in slots]
        self._slot_modules = list(map(dict.get, self._slot_dicts, self._slot_keys))
        self._slot_types = [type(m) for m in self._slot_modules]
        # Each tensor a SAME_OBJECT, SAME_STORAGE or SAME_VALUE guard names is looked up once per call.
        identity = {g.target: _resolve_tensor_safe(model, g.target)
                    for kind in (SAME_OBJECT, SAME_STORAGE, SAME_VALUE) for g in by_kind[kind]}
        self._tensor_targets = list(identity)
        self._tensor_holders = [holder for holder, _ in identity.values()]
        self._tensor_keys = [key for _, key in identity.values()]
        self._storage_targets = list(dict.fromkeys(g.target for kind in (SAME_STORAGE, SAME_VALUE)
                                                   for g in by_kind[kind]))
        self._value_targets = [g.target for g in by_kind[SAME_VALUE]]
        # Every SETTINGS entry as (the __dict__ it is read from, its key there, the value captured); per call, one
        # itemgetter per __dict__ reads all of its entries (a quarter of the calls of one `dict.get` per entry).
        per_dict: dict[int, tuple[dict, list, list]] = {}
        for d, key, value in (entry for kind in _NAMED_VALUES for g in by_kind[kind]
                              for entry in self._setting_entries_of(g)):
            _, keys, values = per_dict.setdefault(id(d), (d, [], []))
            keys.append(key)
            values.append(value)
        self._setting_dicts = [d for d, _, _ in per_dict.values()]
        self._setting_getters = [itemgetter(*keys) for _, keys, _ in per_dict.values()]
        self._setting_values = [values[0] if len(values) == 1 else tuple(values) for _, _, values in per_dict.values()]
        self._calls = [g.expected for g in by_kind[CALL]]
        self.refresh_values()

    def _module(self, path: str):
        try:
            return self.model.get_submodule(path)
        except AttributeError:
            return _Unresolvable()

    def _setting_entries_of(self, guard: Guard) -> list[tuple[dict, str, Any]]:
        """(the __dict__ it is read from, its key there, the value captured) per SETTINGS or GLOBALS entry."""
        if guard.kind == GLOBALS:
            module = sys.modules.get(guard.target)
            return [(vars(module) if module is not None else {}, name, value) for name, value in guard.expected]
        module = self._module(guard.target)
        return [(_settings_dict(module, name), name.rpartition(".")[2], value) for name, value in guard.expected]

    def _tensor(self, name: str):
        holder, key = _resolve_tensor_safe(self.model, name)
        value = holder.get(key)
        return value if value is not None else _Unresolvable()

    def note_own_writes(self) -> None:
        """After a call of the guarded graph: its own in-place writes (a counter buffer it
        increments) are part of what it computes, not a change by the user. Only versions move."""
        if self._value_tensors:
            self._value_versions = _torch_private.tensor_versions(self._value_tensors)

    def refresh_values(self) -> None:
        """Record the current object of every tensor a guard names, the storage of those a
        SAME_STORAGE or SAME_VALUE guard names, and the version of those a SAME_VALUE guard names."""
        self._tensors = [t if t is not None else _Unresolvable()
                         for t in map(dict.get, self._tensor_holders, self._tensor_keys)]
        by_target = dict(zip(self._tensor_targets, self._tensors))
        self._storage_tensors = [by_target[name] for name in self._storage_targets]
        self._storage_pointers = list(map(_data_pointer, self._storage_tensors))
        self._value_tensors = [by_target[name] for name in self._value_targets]
        self._value_versions = _torch_private.tensor_versions(self._value_tensors)

    def first_failure(self, args: tuple = (), kwargs: dict | None = None) -> Guard | None:
        """None if every guard holds for this call, else the first one that does not."""
        if (not self._unresolved
                # truthiness, as a module's own `if self.training:` reads it
                and not any(map(dict.get, self._eval_dicts, repeat("training")))
                and all(map(dict.get, self._train_dicts, repeat("training")))
                and not any(map(_training, self._eval_modules)) and all(map(_training, self._train_modules))
                and not any(map(_requires_grad, self._frozen_params)) and all(map(_requires_grad, self._grad_params))
                and self._no_hooks_added()
                and list(map(tuple, self._hooks_kept)) == self._hooks_kept_expected
                and all(map(is_, map(dict.get, self._slot_dicts, self._slot_keys), self._slot_modules))
                and all(map(is_, map(type, self._slot_modules), self._slot_types))
                # identity first: the stand-in of a tensor the model no longer has has no data pointer
                and all(map(is_, map(dict.get, self._tensor_holders, self._tensor_keys), self._tensors))
                and list(map(_DATA_PTR, self._storage_tensors)) == self._storage_pointers
                and _torch_private.tensor_versions(self._value_tensors) == self._value_versions
                and self._settings_hold()
                and all(spec.mismatch(args, kwargs or {}) is None for spec in self._calls)):
            return None
        return self._find_failure(args, kwargs or {})

    def _settings_hold(self) -> bool:
        """Whether every SETTINGS entry holds its captured value (a deleted attribute does not)."""
        try:
            return list(map(_read_with, self._setting_getters, self._setting_dicts)) == self._setting_values
        except KeyError:
            return False

    def _no_hooks_added(self) -> bool:
        """Whether every hook dict that was empty when bound still is. Each registration through torch's hook
        API makes a handle first: while no handle was made since the dicts were last found empty, they still
        are, and the dicts (four per module) are not read."""
        made = _torch_private.hook_handles_made()
        if made == self._hook_handles_seen:
            return True
        if any(self._hooks_empty):
            return False
        self._hook_handles_seen = made  # read before the dicts: a handle made meanwhile is seen next call
        return True

    def untrue_now(self) -> list[Guard]:
        """Guards, other than call checks, that do not hold on the model right now (for the state a
        graph was just built for, a recording mistake: a target the model does not have)."""
        facts = [g for g in self.guards if g.kind != CALL]
        if BoundGuards(facts, self.model)._holds():  # the usual case: all of them at once
            return []
        return [g for g in facts if not BoundGuards([g], self.model)._holds()]

    def _holds(self) -> bool:
        return self._find_failure((), {}) is None

    def _find_failure(self, args: tuple, kwargs: dict) -> Guard | None:
        """The guard that failed (slow path, only after `first_failure`'s fast check found one)."""
        b = self._by_kind
        for g, m in zip(b[TRAIN_MODE], self._modules):
            if m.training != g.expected:
                return g
        for g, p in zip(b[REQUIRES_GRAD], self._params):
            if p.requires_grad != g.expected:
                return g
        for g, dicts in zip(b[HOOKS], self._hook_dicts_per_guard):
            if tuple(tuple(d) for d in dicts) != g.expected:
                return g
        for g, slot, key, m, cls in zip(b[MODULE], self._slot_dicts, self._slot_keys, self._slot_modules,
                                        self._slot_types):
            if slot.get(key) is not m or type(m) is not cls:
                return g
        tensors = dict(zip(self._tensor_targets, zip(self._tensor_holders, self._tensor_keys, self._tensors)))
        pointers = dict(zip(self._storage_targets, self._storage_pointers))
        versions = dict(zip(self._value_targets, self._value_versions))
        for kind in (SAME_OBJECT, SAME_VALUE, SAME_STORAGE):  # a baked value first: its variant is never valid again
            for g in b[kind]:
                holder, key, t = tensors[g.target]
                if (holder.get(key) is not t or (kind != SAME_OBJECT and _data_pointer(t) != pointers[g.target])
                        or (kind == SAME_VALUE and _torch_private.tensor_version(t) != versions[g.target])):
                    return g
        for g in b[SETTINGS] + b[GLOBALS]:
            for (name, _), (holder, key, value) in zip(g.expected, self._setting_entries_of(g)):
                now = holder.get(key)
                if not (now is value or now == value):  # the guard on that one setting: the warning names it
                    return dataclasses.replace(g, expected=((name, value),))
        for g in b[CALL]:
            if g.expected.mismatch(args, kwargs) is not None:
                return g
        return None


def _split_by_flag(objects: list, guards: list[Guard]) -> tuple[list, list]:
    """(the objects whose guard expects True, those whose guard expects False)."""
    return ([o for o, g in zip(objects, guards) if g.expected is True],
            [o for o, g in zip(objects, guards) if g.expected is not True])


def _training_in_dict(module) -> bool:
    """Whether `module.training` is the entry of its instance __dict__ (no class-level data descriptor
    such as a property takes precedence over it)."""
    return "training" in getattr(module, "__dict__", {}) and not hasattr(
        type(getattr(type(module), "training", None)), "__set__")


def _resolve_tensor_safe(model: torch.nn.Module, name: str) -> tuple[dict, str]:
    try:
        return _resolve_tensor(model, name)
    except AttributeError:
        return {}, name


_training = attrgetter("training")
_read_with = getattr(operator, "call", itemgetter.__call__)  # _read_with(getter, d) is getter(d); operator.call
# (Python 3.11+) is 30% faster
_requires_grad = attrgetter("requires_grad")
_DATA_PTR = torch.Tensor.data_ptr


def _data_pointer(t) -> int:
    """Where a tensor's data lives: `p.data = other` changes it without bumping the version."""
    return t.data_ptr() if isinstance(t, torch.Tensor) else -1
