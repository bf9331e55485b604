"""fxopt: a graph-level optimization compiler for PyTorch models.

    import fxopt
    fast = fxopt.optimize(model, (example_input,))
    print(fast.fxopt_report)

    compiled = torch.compile(model, backend="fxopt")   # importing fxopt registers the backend
"""
from . import _torch_private
from .errors import FxoptError
from .frontends.api import available_passes, optimize
from .frontends.backend import backend, fxopt_backend
from .frontends.result import OptimizedModule

_torch_private.register_dynamo_backend("fxopt", fxopt_backend)

__all__ = ["FxoptError", "OptimizedModule", "available_passes", "backend", "optimize"]
__version__ = "0.1.0"
