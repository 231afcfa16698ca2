"""The GPU machine's device, driver and library versions, as JSON (recorded beside every GPU result)."""
import importlib.metadata as metadata
import json
import platform
import subprocess


def version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def smi(field: str) -> str | None:
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


import onnxruntime as ort  # noqa: E402 - after the helpers, so a missing CUDA build still reports the rest
import torch  # noqa: E402

info = {
    "device": smi("name"), "memory": smi("memory.total"), "driver": smi("driver_version"),
    "cuda_runtime_torch": torch.version.cuda, "cudnn_torch": torch.backends.cudnn.version(),
    "onnxruntime": ort.__version__, "onnxruntime_build": ort.get_build_info() if hasattr(ort, "get_build_info") else None,
    "onnxruntime_providers": ort.get_available_providers(), "torch": torch.__version__, "onnx": version("onnx"),
    # the zoo's exports depend on these (the deployment section's models are written by transformers' code)
    "transformers": version("transformers"), "onnxscript": version("onnxscript"),
    "python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
    "nvidia_packages": {p: version(p) for p in ("nvidia-cudnn-cu13", "nvidia-cublas", "nvidia-cuda-runtime",
                                                "nvidia-cufft", "nvidia-curand", "nvidia-cuda-nvrtc")},
}
print(json.dumps(info, indent=1))
