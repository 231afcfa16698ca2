"""Checks on the GPU machine that the carried onnxruntime-gpu loads CUDA and runs a model there.

Passes when the session's first provider is CUDAExecutionProvider and its float32 MatMul is within 1e-2 (relative
norm) of a float64 product: a check of loading, not of precision. The errors are printed so that precision is on
record; above 1e-5 the likely cause is TF32 (the CUDA provider's `use_tf32` option), so the MatMul is rerun with it
off and that error printed too.
"""
import json
import sys

import numpy as np
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
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10).SerializeToString()
x = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
ref = x.astype(np.float64) @ x.astype(np.float64)


def errors(y: np.ndarray) -> dict:
    """Max absolute, max relative (entries under 1e-3 of the largest left out) and relative-norm error against ref."""
    diff = np.abs(y.astype(np.float64) - ref)
    big = np.abs(ref) >= 1e-3 * np.abs(ref).max()
    return {"max_abs": float(diff.max()), "max_rel": float((diff[big] / np.abs(ref[big])).max()),
            "rel_norm": float(np.linalg.norm(diff) / np.linalg.norm(ref))}


def run(options: dict | None = None) -> tuple[list[str], dict]:
    session = ort.InferenceSession(model, providers=[("CUDAExecutionProvider", options or {})])
    return session.get_providers(), errors(session.run(None, {"x": x})[0])


providers, error = run()
report = {"session_providers": providers, "cuda_matmul_error": error, "numpy_float32_error": errors(x @ x)}
if error["rel_norm"] > 1e-5:
    report["cuda_matmul_error_use_tf32_0"] = run({"use_tf32": "0"})[1]
ok = providers[0] == "CUDAExecutionProvider" and error["rel_norm"] < 1e-2
print(json.dumps(report))
if error["rel_norm"] > 1e-5:
    print(f"MatMul relative-norm error {error['rel_norm']:.1e} is above float32's (numpy: "
          f"{report['numpy_float32_error']['rel_norm']:.1e}): TF32 is the likely cause; with use_tf32=0 it is "
          f"{report['cuda_matmul_error_use_tf32_0']['rel_norm']:.1e}")
print("CUDA check passed" if ok else "CUDA check FAILED: " + (
    f"session runs on {providers[0]}" if providers[0] != "CUDAExecutionProvider" else "MatMul error above 1e-2"))
sys.exit(0 if ok else 1)
