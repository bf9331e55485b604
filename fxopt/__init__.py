"""fxopt: a graph-level optimization compiler for PyTorch models.

    import fxopt
    fast = fxopt.optimize(model, (example_input,))
    print(fast.fxopt_report)
    fxopt.save(fast, "fast.pt"); fast = fxopt.load("fast.pt")   # torch.load needs weights_only=False

    compiled = torch.compile(model, backend="fxopt")   # importing fxopt registers the backend

The public names are imported on first use, so the `fxopt` command line parses its arguments
without importing torch. When torch is already imported, importing fxopt registers the
"fxopt" torch.compile backend at once; otherwise Dynamo finds it through the package's
`torch_dynamo_backends` entry point, or on first use of any public name.
"""
import importlib
import sys

from ._version import __version__
from .errors import FxoptError

__all__ = ["FxoptError", "OptimizedModule", "available_passes", "backend", "load", "optimize", "save"]

_LAZY = {"optimize": ".frontends.api", "available_passes": ".frontends.api", "backend": ".frontends.backend",
         "fxopt_backend": ".frontends.backend", "OptimizedModule": ".frontends.result", "save": ".frontends.saving",
         "load": ".frontends.saving"}


def _register_backend() -> None:
    from . import _torch_private
    from .frontends.backend import fxopt_backend

    _torch_private.register_dynamo_backend("fxopt", fxopt_backend)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'fxopt' has no attribute {name!r}")
    _register_backend()
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


if "torch" in sys.modules:  # a library user: behave as before, the backend is there after `import fxopt`
    _register_backend()
