"""What the `fxopt` command line is given, turned into a model and inputs, or a clear FxoptError.

    load_model("package.module:attr" | "path/to/file.py:attr")   -> nn.Module
    parse_shape("8x3x224x224")                                     -> (8, 3, 224, 224)
    make_inputs(shapes, dtypes, int_high)                          -> random example tensors
    check_model_accepts(model, inputs, int_high)                   -> names the layer that rejects them

`attr` may be an `nn.Module` subclass (constructed with no arguments), a factory function taking
no arguments, or a module instance; a dotted `attr` (`Outer.make`) is looked up step by step.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import pathlib
import re
import sys

import torch

from ..running_modules import rejection
from ..errors import FxoptError
from .cli_args import DEFAULT_INT_HIGH, DTYPE_NAMES

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
_SHAPE = re.compile(r"[1-9][0-9]*(x[1-9][0-9]*)*")


def parse_shape(text: str) -> tuple[int, ...]:
    if not _SHAPE.fullmatch(text.strip()):
        raise FxoptError(f"malformed --input-shape {text!r}: expected positive sizes separated by 'x', "
                         "e.g. 8x3x224x224")
    return tuple(int(s) for s in text.strip().split("x"))


def format_shape(shape) -> str:
    return "x".join(str(s) for s in shape) if len(shape) else "scalar"


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not on this platform
        return None


def _check_size(shapes: list[tuple[int, ...]], dtypes: list[str]) -> None:
    """Inputs that cannot fit in this machine's memory are the user's mistake, said before allocating."""
    total = sum(math.prod(s) * DTYPES[d].itemsize for s, d in zip(shapes, dtypes))
    memory = _memory_bytes()
    if memory is not None and total > memory // 2:
        shapes_text = ", ".join(format_shape(s) for s in shapes)
        raise FxoptError(f"--input-shape {shapes_text} needs {total / 2**30:.3g} GiB for the inputs alone, more than "
                         f"half of this machine's {memory / 2**30:.3g} GiB of memory: give smaller shapes")


def make_inputs(shapes: list[tuple[int, ...]], dtypes: list[str], int_high: int = DEFAULT_INT_HIGH
                ) -> tuple[torch.Tensor, ...]:
    """Random inputs, the same on every run (seeded): normal floats, or integers in [0, int_high)."""
    if int_high < 1:
        raise FxoptError(f"--int-high must be at least 1, got {int_high}")
    _check_size(shapes, dtypes)
    generator = torch.Generator().manual_seed(0)
    inputs = []
    try:
        for shape, dtype in zip(shapes, dtypes):
            torch_dtype = DTYPES[dtype]
            if torch_dtype.is_floating_point:
                inputs.append(torch.randn(shape, generator=generator).to(torch_dtype))
            else:
                inputs.append(torch.randint(0, int_high, shape, generator=generator, dtype=torch_dtype))
    except (RuntimeError, MemoryError) as e:  # allocation failed
        raise FxoptError(f"cannot allocate inputs {', '.join(format_shape(s) for s in shapes)}: "
                         f"{(str(e).strip().splitlines() or [''])[0]}") from e
    return tuple(inputs)


def _import_file(path: pathlib.Path):
    if not path.is_file():
        raise FxoptError(f"cannot import {str(path)!r}: no such file")
    if path.suffix != ".py":
        raise FxoptError(f"cannot import {str(path)!r}: not a Python file; MODEL is 'path/to/file.py:attr' "
                         "or 'package.module:attr'")
    sys.path.insert(0, str(path.resolve().parent))  # sibling imports work, as when running the file
    name = "_fxopt_model_" + re.sub(r"[^0-9A-Za-z_]", "_", path.stem)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    spec.loader.exec_module(module)
    return module


def _import_target(target: str):
    """Import `path/to/file.py` or `package.module`; any failure in the user's code becomes an FxoptError."""
    try:
        if target.endswith(".py") or "/" in target or os.sep in target or os.path.isfile(target):
            return _import_file(pathlib.Path(target))
        if os.getcwd() not in sys.path:  # `fxopt inspect pkg.mod:attr` finds pkg the way `python -m` would
            sys.path.insert(0, os.getcwd())
        return importlib.import_module(target)
    except FxoptError:
        raise
    except SystemExit as e:
        raise FxoptError(f"cannot import {target!r}: it called sys.exit({e.code!r}) at import; put the code that runs "
                         "the script under `if __name__ == \"__main__\":`") from e
    except Exception as e:  # noqa: BLE001 - whatever the user's module raised while importing
        raise FxoptError(f"cannot import {target!r}: {type(e).__name__}: {e}") from e


def _candidates(module) -> list[str]:
    """Names in `module` that could be given as attr: modules, module classes, functions defined there."""
    names = []
    for name, value in vars(module).items():
        if name.startswith("_"):
            continue
        is_module_class = isinstance(value, type) and issubclass(value, torch.nn.Module)
        defined_here = getattr(value, "__module__", None) == module.__name__
        if isinstance(value, torch.nn.Module) or (defined_here and (is_module_class or inspect.isfunction(value))):
            names.append(name)
    return names


def _required_parameters(fn) -> list[str]:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: just call them
        return []
    return [p.name for p in signature.parameters.values()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _instantiate(obj, spec: str) -> torch.nn.Module:
    if isinstance(obj, torch.nn.Module):
        return obj
    if isinstance(obj, type) and not issubclass(obj, torch.nn.Module):
        raise FxoptError(f"{spec!r} is the class {obj.__name__}, which is not an nn.Module subclass")
    if not callable(obj):
        raise FxoptError(f"{spec!r} is a {type(obj).__name__}, not an nn.Module subclass, a factory function "
                         "or a module instance")
    required = _required_parameters(obj)
    if required:
        raise FxoptError(f"{spec!r} needs arguments ({', '.join(required)}) but fxopt calls it with none: "
                         "point at a function that takes no arguments and returns the model")
    try:
        result = obj()
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's constructor failed
        raise FxoptError(f"constructing {spec!r} failed: {type(e).__name__}: {e}") from e
    if not isinstance(result, torch.nn.Module):
        raise FxoptError(f"{spec!r} returned a {type(result).__name__}, not an nn.Module")
    return result


def load_model(spec: str) -> torch.nn.Module:
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise FxoptError(f"MODEL must be 'package.module:attr' or 'path/to/file.py:attr', got {spec!r}")
    if ":" in target and not pathlib.Path(target).exists():  # a colon in a path ('C:/...') is fine
        first, _, rest = spec.partition(":")
        raise FxoptError(f"MODEL {spec!r} has more than one ':'; an attribute inside another is reached with a dot: "
                         f"'{first}:{rest.replace(':', '.')}'")
    module = _import_target(target)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = _candidates(module)
            hint = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "") or "none"
            raise FxoptError(f"{target!r} has no attribute {attr!r} (models and factories there: {hint})")
        obj = getattr(obj, part)
    return _instantiate(obj, spec)


def _describe_shapes(args) -> str:
    shapes = [format_shape(a.shape) for a in args if isinstance(a, torch.Tensor)]
    return ", ".join(shapes) or "no tensors"


def describe_inputs(inputs: tuple) -> str:
    """Shapes with their dtype: '2x6, 2x4 (float32)', or each its own: '2x5 (int64), 2x5 (float32)'."""
    dtypes = [str(x.dtype).removeprefix("torch.") for x in inputs]
    if len(set(dtypes)) == 1:
        return f"{_describe_shapes(inputs)} ({dtypes[0]})"
    return ", ".join(f"{format_shape(x.shape)} ({d})" for x, d in zip(inputs, dtypes))


def _hint(inputs: tuple, layer, args: tuple, error: BaseException, message: str, int_high: int) -> str:
    """What to change on the command line when the model rejects the inputs: the dtype of token ids, or their range."""
    given = [a for a in args if isinstance(a, torch.Tensor)] if layer is not None else list(inputs)
    if isinstance(layer, torch.nn.Embedding) and given and not given[0].is_floating_point():
        if isinstance(error, IndexError) and int_high > layer.num_embeddings:
            return (f"; token ids are drawn from [0, {int_high}) (--int-high) but this embedding has "
                    f"{layer.num_embeddings} rows: give --int-high {layer.num_embeddings} or less")
        return ""
    if isinstance(error, IndexError) and any(not x.is_floating_point() for x in given):
        return (f"; integer inputs are drawn from [0, {int_high}) (--int-high): if they index a table, give "
                "--int-high at most its size")
    if any(x.is_floating_point() for x in given) and (isinstance(layer, torch.nn.Embedding)
                                                      or re.search(r"\b(Long|Int)\b|indices", message)):
        return "; the model wants integer token ids: add --dtype int64 (values drawn from [0, --int-high))"
    return ""


def check_model_accepts(model: torch.nn.Module, inputs: tuple, int_high: int = DEFAULT_INT_HIGH) -> None:
    """Run `model(*inputs)` once (state restored); on failure name the innermost layer running
    (`fxopt.running_modules.rejection`) and what to change (`_hint`)."""
    failed = rejection(model, inputs)
    if failed is not None:
        e = failed.error
        message = f"the model rejects inputs {describe_inputs(inputs)}"
        layer, args = failed.module, failed.args
        where = f"layer {failed.path!r}" if failed.path else "the model's own forward"
        message += f": {where} ({type(layer).__name__}) called with {_describe_shapes(args)}"
        first_line = (str(e).strip().splitlines() or [""])[0]
        if isinstance(e, SystemExit):
            first_line = f"sys.exit({e.code!r}) was called"
        hint = _hint(inputs, layer, args, e, first_line, int_high)
        raise FxoptError(f"{message} raised {type(e).__name__}: {first_line}{hint}") from e
