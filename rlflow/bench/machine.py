"""The machine a bench measures on: its matrix-product peak through onnxruntime (what the `peak` column divides by)
and the hardware and software versions every results file records.
"""
from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from rlflow.graph.model_file import max_ir_version
from rlflow.measure.session import SessionSettings
from rlflow.measure.timing import time_model

PEAK_MATMUL_SIZE = 512
"""Side of the square matrices whose product `measure_peak` times."""


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
    return {"gflops": gflops, "matmul": [size, size, size], "best_ms": timing.min_ms, "median_ms": timing.median_ms}


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
            "provider": settings.provider}
