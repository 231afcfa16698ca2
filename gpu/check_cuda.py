"""Checks on the GPU machine that the carried onnxruntime-gpu loads CUDA and runs a model there."""
import json
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

try:
    ort.preload_dlls()  # CUDA, cuDNN and cuBLAS from the nvidia-* pip packages the image has
except Exception as exc:  # noqa: BLE001 - torch loads the same libraries; rlflow imports torch anyway
    print(f"preload_dlls failed ({exc}); loading CUDA libraries through torch")
    import torch  # noqa: F401
print(f"onnxruntime {ort.__version__} from {ort.__file__}; providers {ort.get_available_providers()}")
graph = helper.make_graph([helper.make_node("MatMul", ["x", "x"], ["y"])], "check",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 64])])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
session = ort.InferenceSession(model.SerializeToString(), providers=["CUDAExecutionProvider"])
x = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
y = session.run(None, {"x": x})[0]
ok = session.get_providers()[0] == "CUDAExecutionProvider" and np.allclose(y, x @ x, rtol=1e-3, atol=1e-3)
print(json.dumps({"session_providers": session.get_providers(), "matmul_matches_numpy": bool(ok)}))
sys.exit(0 if ok else 1)
