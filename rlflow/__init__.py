"""rlflow: make ONNX models faster with verified graph rewrites chosen by model-based reinforcement learning.

torch and onnxruntime are imported only by the parts that need them, so `import rlflow` stays light.
"""
from rlflow.errors import InputError, ProviderError, RlflowError
from rlflow.graph import Graph, load
from rlflow.optimize import Result, optimize  # rebinds the name: `rlflow.optimize` is the function, as documented

__version__ = "0.1.0"

__all__ = ["Graph", "load", "optimize", "Result", "InputError", "ProviderError", "RlflowError", "__version__"]
