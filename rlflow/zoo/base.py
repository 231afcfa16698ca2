"""What the zoo's two builders share (`rlflow.zoo` for the models of ``models/``, `rlflow.zoo.deploy` for the
deployment section): the seed, the ``models/`` package and the `Export` a builder hands to `rlflow.zoo.build`.
Its own module so that neither builder imports the other."""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
SEED = 0
_PACKAGE = "rlflow_zoo_models"  # private import name of MODELS_DIR, so that no installed `models` can shadow it


def models_package():
    """The ``models/`` folder imported as a package under a private name."""
    if _PACKAGE not in sys.modules:
        if not (MODELS_DIR / "__init__.py").is_file():
            raise RuntimeError(f"the zoo's model definitions are missing ({MODELS_DIR}): build from a source "
                               "checkout installed with `pip install -e .`")
        spec = importlib.util.spec_from_file_location(_PACKAGE, MODELS_DIR / "__init__.py",
                                                      submodule_search_locations=[str(MODELS_DIR)])
        package = importlib.util.module_from_spec(spec)
        sys.modules[_PACKAGE] = package
        spec.loader.exec_module(package)
    return sys.modules[_PACKAGE]


@dataclass
class Export:
    """What a builder hands to `build`: the exported model, the feeds it is checked with and PyTorch's outputs."""

    proto: object  # onnx.ModelProto
    feeds: dict  # input name -> numpy array
    expected: list  # PyTorch's outputs on ``feeds`` (numpy)
    exporter: str  # how it was exported, for the metadata
    opset: int
    props: dict = field(default_factory=dict)  # extra ONNX metadata_props
    metadata: dict = field(default_factory=dict)  # extra sidecar JSON fields
    tolerance: float = 1e-3  # largest difference from PyTorch's outputs, relative to their largest magnitude
    sidecars: dict = field(default_factory=dict)  # file suffix -> bytes written beside the model (a held-out set)
