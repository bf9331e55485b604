"""fxopt: a graph-level optimization compiler for PyTorch models.

    import fxopt
    fast = fxopt.optimize(model, (example_input,))
    print(fast.fxopt_report)
"""
from .errors import FxoptError
from .frontends.api import available_passes, optimize

__all__ = ["FxoptError", "available_passes", "optimize"]
__version__ = "0.1.0"
