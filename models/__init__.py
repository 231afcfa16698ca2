"""rlflow's model zoo: PyTorch definitions of the architectures the graph-optimisation literature reports on.

Written for this project (no torchvision, timm or transformers; nothing is downloaded).  Each module exposes
``build(config) -> torch.nn.Module``; the registry that names the models, their configurations, input shapes and
published figures is ``rlflow.zoo``, which also exports them to ONNX through ``models.common``.  This package is
imported by ``rlflow.zoo`` under a private name, from this folder, so it need not be installed.
"""
