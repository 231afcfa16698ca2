"""rlflow: make ONNX models faster with verified graph rewrites chosen by model-based reinforcement learning.

torch and onnxruntime are imported only by the parts that need them, so `import rlflow` stays light.
"""
from rlflow.errors import InputError, ProviderError, RlflowError
from rlflow.graph.core import Graph, load
from rlflow.optimize import (  # rebinds the name: `rlflow.optimize` is the function, as documented
    Options,
    Result,
    optimize,
)

__version__ = "0.1.0"


def _register_env() -> None:
    """Registers `rlflow/Rewrite-v0` so `gymnasium.make("rlflow/Rewrite-v0", model=PATH)` works after `import rlflow`."""
    import gymnasium

    if "rlflow/Rewrite-v0" not in gymnasium.registry:
        gymnasium.register(id="rlflow/Rewrite-v0", entry_point="rlflow.env.rewrite_env:RewriteEnv")


_register_env()

__all__ = ["Graph", "load", "optimize", "Options", "Result", "InputError", "ProviderError", "RlflowError", "__version__"]
