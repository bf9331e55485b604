"""What `fxopt.optimize` returns: the model, compiled by TorchDynamo with fxopt's backend, standing for the model.

An `OptimizedModule` stands for one model (`original`: the caller's model in training, a
private copy in inference). It shares that model's parameter, buffer and submodule dicts, so
`state_dict()` keys, `named_parameters()`, optimizers, `load_state_dict`, hooks registered on
`result.layer1`, `.train()` / `.eval()` / `requires_grad_()`, indexing and iterating a container,
and setting one of the model's plain attributes on the result all act on the model it stands for.

Every call goes through `torch.compile(original, backend=<fxopt>)`. Dynamo's guards decide, per
call, whether a compiled graph fits: a new padded length makes that dimension dynamic (one more
compile, then every length); `train()`/`eval()`, a hook, a changed attribute, another dtype, grad
mode or autocast recompile; code Dynamo cannot trace runs in Python between graphs (a graph
break); past Dynamo's recompile limit a new variant runs as written, with one warning. Where eight calls in a row
ran none of fxopt's graphs (Dynamo captured nothing, or nothing compiled fits), the result calls the model itself,
at eager's cost instead of Dynamo's per-frame work, and sends one call in sixteen through Dynamo to see whether a
graph fits again (`EAGER_AFTER`, `RETRY_EVERY`). fxopt's backend optimizes each
graph Dynamo hands it (fxopt/frontends/backend.py) and keeps one `Report` per graph
(`fxopt_reports`; `fxopt_report` is the latest). What fxopt bakes in, Dynamo does not guard: an
inference graph's frozen constants (folded weights) are checked on every call against the parameters'
identity and version and the BatchNorm statistics' values (fxopt/frontends/backend.py, FrozenInference).

Under `torch.compile` or `torch.export` of the result itself, the original model is what gets
traced: fxopt's graphs are made for eager calls, and the outer compiler optimizes on its own.

Training loops that read the model's class and signature (Hugging Face `Trainer`, `accelerate`) see the
model's: `inspect.signature(result.forward)` is the model's `forward` signature (Trainer keeps the dataset
columns it names and finds `labels` in it), and `result.__class__` is the model's class, as a
`unittest.mock` spec makes it, so `isinstance(result, PreTrainedModel)` holds and Trainer saves
checkpoints with the model's own `save_pretrained` (a plain `from_pretrained` loads them).
`type(result)` is still `OptimizedModule`. Attributes the result does not have (`config`,
`main_input_name`, `save_pretrained`, `_keys_to_ignore_on_save`, ...) are the model's.
"""
from __future__ import annotations

import inspect
import types

import torch

from .. import _torch_private
from ..errors import FxoptError
from ..user_code import warn_at_users_line
from .backend import FxoptBackend


# After this many calls in a row that ran no compiled graph (Dynamo captured nothing, or past its recompile limit
# nothing compiled fits), the result calls the model itself, at eager's cost rather than Dynamo's frame callback's;
# one call in RETRY_EVERY still goes through Dynamo, and back to it for good once a graph runs there.
EAGER_AFTER, RETRY_EVERY = 8, 16


class OptimizedModule(torch.nn.Module):
    """See the module docstring."""

    def __init__(self, original: torch.nn.Module, backend: FxoptBackend):
        super().__init__()
        d = self.__dict__
        d["original"] = original
        # The model's own dicts, shared (not copied): its state and submodules are the result's.
        d.update(_parameters=original._parameters, _buffers=original._buffers, _modules=original._modules,
                 _non_persistent_buffers_set=original._non_persistent_buffers_set)
        d["_backend"] = backend
        d["_calls_without_graphs"] = 0  # calls in a row that ran none of fxopt's graphs (`forward`)
        d["_compiled"], d["_settings_at_compile"] = _torch_private.compile_with_settings(
            original, backend, self._warn_recompile_limit, backend.keeping.graph_breaks.converting)
        forward = _forward_with_signature_of(original)
        if forward is not None:  # an instance attribute: what `inspect.signature(result.forward)` reads
            d["forward"] = types.MethodType(forward, self)

    def forward(self, *args, **kwargs):
        if _torch_private.is_compiling():  # an outer torch.compile / torch.export traces the model itself
            return self.original(*args, **kwargs)
        d = self.__dict__
        streak = d["_calls_without_graphs"]
        if streak >= EAGER_AFTER and streak % RETRY_EVERY:  # fxopt has nothing for these calls: eager's own cost
            d["_calls_without_graphs"] = streak + 1
            return self.original(*args, **kwargs)
        graph_calls = self._backend.graph_calls
        if not self._settings_at_compile:  # a torch whose frame callback fxopt cannot wrap: settings on every call
            with _torch_private.settings_applied(self._warn_recompile_limit), \
                    self._backend.keeping.graph_breaks.converting():  # hooks guarded, NumPy's stream, ...
                outputs = self._run(self._compiled, args, kwargs)
        else:  # the compiled module's own forward: its Module.__call__ adds only a layer with no hooks of its own
            outputs = self._run(self._compiled.forward, args, kwargs)
        d["_calls_without_graphs"] = streak + 1 if self._backend.graph_calls == graph_calls else 0
        return outputs

    def _run(self, call, args: tuple, kwargs: dict):
        """`call(*args, **kwargs)`, a failure inside fxopt's backend raised in fxopt's words; warns once while Dynamo
        has handed fxopt no graph."""
        try:
            outputs = call(*args, **kwargs)
        except _torch_private.backend_compiler_failed() as e:
            _raise_fxopt_error_inside(e)
            raise
        if not self._backend.reports:
            self._warn_nothing_captured()
        return outputs

    def _warn_nothing_captured(self) -> None:
        """Once per result: Dynamo has handed fxopt no graph yet, so the calls so far ran as the model's own code."""
        if self.__dict__.get("_warned_nothing_captured"):
            return
        self.__dict__["_warned_nothing_captured"] = True
        warn_at_users_line(f"fxopt: nothing in this call of {type(self.original).__name__} was optimized: TorchDynamo "
                           f"captured no graph from it, so it ran as eager runs it (its forward, or all the code it "
                           f"calls, is disabled for or skipped by Dynamo, breaks the graph before any tensor op, or "
                           f"computes nothing); TORCH_LOGS=graph_breaks shows where Dynamo stopped")

    def _warn_recompile_limit(self) -> None:
        """Once per result: a call Dynamo would have compiled anew ran as the model's own code (eager's cost)."""
        if self.__dict__.get("_warned_recompile_limit"):
            return
        self.__dict__["_warned_recompile_limit"] = True
        _, limit = _torch_private.recompile_limit_hits()
        warn_at_users_line(f"fxopt: part or all of a call of {type(self.original).__name__} ran as eager runs it: "
                           f"TorchDynamo reached its recompile limit ({limit}); calls that match a graph compiled "
                           f"before stay optimized (after {EAGER_AFTER} calls in a row that matched none, one call in "
                           f"{RETRY_EVERY} is tried). TORCH_LOGS=recompiles names what changed each time (a float "
                           f"computed anew each call is a common cause); raise the limit if the variants are few")

    # ---- what fxopt did --------------------------------------------------------------------------

    @property
    def fxopt_reports(self) -> list:
        """One `Report` per graph compiled so far, in the order Dynamo compiled them."""
        return list(self._backend.reports)

    @property
    def fxopt_report(self):
        """The report of the most recently compiled graph (None before the first call)."""
        reports = self._backend.reports
        return reports[-1] if reports else None

    @property
    def graph_modules(self) -> list[torch.nn.Module]:
        """The optimized graphs compiled so far, in the order Dynamo compiled them."""
        return list(self._backend.graph_modules)

    @property
    def graph_module(self) -> torch.nn.Module:
        """The most recently compiled optimized graph."""
        if not self._backend.graph_modules:
            raise FxoptError("nothing is compiled yet: call the result (or give fxopt.optimize an example) first")
        return self._backend.graph_modules[-1]

    @property
    def graph_inputs(self) -> list | None:
        """The inputs the most recent graph module was compiled on (parameters and buffers among them, in its
        placeholders' order), while they are alive; None otherwise."""
        return self._backend.inputs_of(len(self._backend.graph_modules) - 1) if self._backend.graph_modules else None

    # ---- behaving like the model ---------------------------------------------------------------

    @property
    def __class__(self):
        """The model's class: `isinstance(result, type(model))` holds, and what a training loop reads from the
        class (Trainer: the labels named in `forward`'s signature; `isinstance(model, PreTrainedModel)` to save
        with `save_pretrained`) is the model's. `type(result)` is OptimizedModule."""
        original = self.__dict__.get("original")
        return type(original) if original is not None else type(self)

    @__class__.setter
    def __class__(self, cls: type) -> None:
        """An engine that re-classes a module in place (FSDP2's `fully_shard` makes it `FSDP<class>`, its mixin
        before the class it read) re-classes the result with the same mixins before OptimizedModule, so the
        result keeps its compiled `forward` and gains the engine's methods (`unshard`, `reshard`)."""
        model_class = type(self.__dict__["original"])
        if cls is not model_class and issubclass(cls, model_class) and model_class in cls.__bases__:
            cls = _reclassed(cls, model_class)
        object.__dict__["__class__"].__set__(self, cls)

    def _get_name(self) -> str:  # the repr says what this is, whatever `__class__` says
        return type(self).__name__

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
        """`.to()`, `.half()`, `.cuda()` convert the model: Dynamo's guards see the new tensors and recompile."""
        self.original._apply(fn, recurse)
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
        """A plain attribute the model has (`result.drop_rate = 0.2`) is set on the model, which is what runs;
        a submodule, parameter or buffer lands in the shared dicts anyway."""
        original = self.__dict__.get("original")
        if (original is not None and name not in self.__dict__ and not hasattr(type(self), name)
                and name in vars(original)):
            setattr(original, name, value)
        else:
            super().__setattr__(name, value)

    def __bool__(self) -> bool:  # a module is true, whether or not the model it stands for has a length
        return True

    def __len__(self) -> int:
        return len(self.original)

    def __getitem__(self, index):
        return self.original[index]

    def __iter__(self):
        return iter(self.original)

    def __getstate__(self):
        """Pickled (torch.save, deepcopy) as the model and fxopt's options; graphs compile again on first call."""
        return {"original": self.original, "options": self._backend.options, "training": self.training}

    def __setstate__(self, state):
        self.__init__(state["original"], FxoptBackend.from_options(state["options"]))

    def __reduce_ex__(self, protocol):
        """Rebuilt from `__getstate__` by OptimizedModule itself: pickle's default would take `__class__` (the model's)."""
        return _rebuild, (self.__getstate__(),)

    def extra_repr(self) -> str:
        return f"{type(self.original).__name__}, {len(self._backend.reports)} graph(s) compiled"


def _raise_fxopt_error_inside(error: Exception) -> None:
    """Raise what failed in fxopt's backend in fxopt's words, the FxoptError inside Dynamo's wrapper of it, if any."""
    inner = getattr(error, "inner_exception", None) or error.__cause__
    if isinstance(inner, FxoptError):
        raise inner from None


_RECLASSED: dict[type, type] = {}


def _reclassed(cls: type, model_class: type) -> type:
    """`cls` (mixins, then `model_class`) remade with OptimizedModule in the model's class's place; one per `cls`."""
    if cls not in _RECLASSED:
        bases = tuple(OptimizedModule if base is model_class else base for base in cls.__bases__)
        body = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
        _RECLASSED[cls] = type(cls.__name__, bases, body)
    return _RECLASSED[cls]


def _rebuild(state: dict) -> OptimizedModule:
    result = OptimizedModule.__new__(OptimizedModule)
    result.__setstate__(state)
    return result


def _forward_with_signature_of(original: torch.nn.Module):
    """A function calling `OptimizedModule.forward` whose signature is the model's `forward` (plus `self`), or None
    where the model's has none Python can read."""
    try:
        signature = inspect.signature(original.forward)
    except (TypeError, ValueError):
        return None

    def forward(self, *args, **kwargs):
        return OptimizedModule.forward(self, *args, **kwargs)

    own = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    forward.__signature__ = signature.replace(parameters=[own, *signature.parameters.values()])
    forward.__doc__ = getattr(original.forward, "__doc__", None)
    forward.__qualname__ = "OptimizedModule.forward"
    return forward
