"""The machine a bench measures on: its matrix-product peak and its streaming bandwidth through onnxruntime (what
the `peak` and `memory` columns divide by) and the hardware and software versions every results file records.

Two roofs, because models hit different ones: an encoder at sequence 128 is bound by arithmetic, a decoder's one-token
step by reading its weights and cache, so a decode step far below the matrix-product peak may still be at the limit.
"""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from rlflow.graph.model_file import max_ir_version
from rlflow.measure.session import SessionSettings
from rlflow.measure.timing import time_model

PEAK_MATMUL_SIZE = 512
"""Side of the square matrices whose product `measure_peak` times."""

STREAM_MEGABYTES = {"CPUExecutionProvider": 64, "CUDAExecutionProvider": 512}
"""Size of the weight a one-row matrix product streams to time the bandwidth: well past the caches, and on a GPU
large enough that the read, not the kernel launch, takes the time."""


def measure_peak(settings: SessionSettings, size: int = PEAK_MATMUL_SIZE) -> dict:
    """The machine's matrix-product throughput through onnxruntime (GFLOP/s) with the bench's own settings."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((size, size)).astype(np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "peak",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [size, size])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=max_ir_version())
    timing = time_model(model, settings, warmup=3, repeats=20)
    gflops = 2 * size ** 3 / (timing.min_ms * 1e-3) / 1e9
    return {"gflops": gflops, "matmul": [size, size, size], "best_ms": timing.min_ms, "median_ms": timing.median_ms,
            **measure_bandwidth(settings)}


def measure_bandwidth(settings: SessionSettings) -> dict:
    """The machine's streaming bandwidth through onnxruntime (GB/s): a one-row matrix product, the shape of a decode
    step's every projection, reads its whole weight once and does two FLOPs per weight, so its time is the read."""
    megabytes = STREAM_MEGABYTES.get(settings.provider, 64)
    rows, cols = 4096, megabytes * 2**20 // (4 * 4096)
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "stream",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, cols])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=max_ir_version())
    timing = time_model(model, settings, warmup=3, repeats=20)
    read = rows * cols * 4 + 4 * (rows + cols)
    return {"gbs": read / (timing.min_ms * 1e-3) / 1e9, "stream_bytes": read, "stream_best_ms": timing.min_ms}


def environment(settings: SessionSettings) -> dict:
    """The machine and software versions the results were measured with."""
    import onnxruntime

    from rlflow import __version__

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "onnxruntime": onnxruntime.__version__, "onnx": onnx.__version__, "rlflow": __version__,
            "commit": source_commit(), "provider": settings.provider, "gpu": gpu_name(settings.provider)}


def gpu_name(provider: str) -> str | None:
    """The GPU a CUDA measurement ran on, as nvidia-smi names it (`NVIDIA H200`), so that every results file says
    which card it is about; None on the CPU or where nvidia-smi cannot tell."""
    if provider != "CUDAExecutionProvider":
        return None
    try:
        found = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    names = [line.strip() for line in found.stdout.splitlines() if line.strip()] if found.returncode == 0 else []
    return ", ".join(dict.fromkeys(names)) or None


def source_commit() -> str | None:
    """The git commit rlflow runs from (``-dirty`` where tracked files differ from it), so that a results file says
    which code made it; None for an installed copy outside its checkout."""
    root = Path(__file__).resolve().parents[2]
    if not ((root / ".git").exists() and (root / "setup.cfg").is_file()):
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("-dirty" if changed.returncode == 0 and changed.stdout.strip() else "")
