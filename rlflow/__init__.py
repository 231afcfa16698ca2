"""rlflow: make ONNX models faster with verified graph rewrites chosen by model-based reinforcement learning.

Heavy dependencies (torch, onnxruntime) are imported only by the parts that need them.
"""
from rlflow.errors import InputError, ProviderError, RlflowError
from rlflow.graph import Graph, load

__version__ = "0.1.0"


def optimize(model, **options):
    """Optimises a model path or Graph; see `rlflow.optimize.optimize` for the options."""
    from rlflow.optimize import optimize as _optimize

    return _optimize(model, **options)


__all__ = ["Graph", "load", "optimize", "InputError", "ProviderError", "RlflowError", "__version__"]
