"""The size model of a fusion group's latency: its features and the estimate fitted to a measured table.

    cost_ms = launch * kernels + bytes / bandwidth + conv_flops / conv_rate + matmul_flops / matmul_rate
              + other_flops / vector_rate

Apart from `rlflow.measure.costmodel.gpu_estimate` (the cost model of a device this machine lacks, and the command that fits) so
that `rlflow.measure.costmodel.fallback`, which the cost model itself asks past a search's deadline, needs no cost model.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter

from rlflow.graph.flops import node_flops
from rlflow.measure.ranks import spearman

TABLES = Path(__file__).resolve().parent / "tables"
"""Cost tables measured on devices and shipped with the package (with the estimates fitted to them)."""

FEATURES = ("kernels", "bytes", "conv_flops", "matmul_flops", "other_flops")

VIEWS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Dropout"})
"""Operators that alias their input on the GPU: no kernel is launched."""

CONV_OPS = frozenset({"Conv", "ConvTranspose", "FusedConv", "ConvInteger", "QLinearConv"})
MATMUL_OPS = frozenset({"MatMul", "Gemm", "FusedMatMul", "FusedGemm", "MatMulInteger", "QLinearMatMul", "Einsum"})

SHIPPED = {"cuda": (TABLES / "cuda-h100.json", TABLES / "cuda-h100.estimate.json")}
"""Provider -> (cost table, fitted estimate) used where the provider cannot run here."""

FIT_FLOOR_MS = 2e-3
"""Costs count as at least this much in the fit's weights and its error figures: entries at the table's floor (a group
cheaper than the call overhead it is measured beside, 0.1 us) would otherwise weigh far more than a real kernel."""

@dataclass(frozen=True)
class Estimate:
    """Milliseconds per unit of each of `FEATURES`; `calibrated` is False for published figures not fitted to a table.

    Attributes:
        coefficients: ms per kernel, per byte, per convolution FLOP, per matrix-product FLOP, per other FLOP.
        calibrated: fitted to a measured table.
        source: where the coefficients come from (a table and its entry count, or the published figures).
    """

    coefficients: tuple[float, ...]
    calibrated: bool
    source: str

    def __call__(self, features: np.ndarray) -> float:
        return max(float(np.dot(self.coefficients, features)), 1e-4)

    def as_dict(self) -> dict:
        return {**asdict(self), "features": list(FEATURES)}

    @classmethod
    def from_dict(cls, data: dict) -> "Estimate":
        if list(data.get("features", FEATURES)) != list(FEATURES):
            raise ValueError(f"estimate features {data.get('features')} are not {list(FEATURES)}")
        return cls(tuple(float(c) for c in data["coefficients"]), bool(data["calibrated"]), str(data["source"]))


def published_h100() -> Estimate:
    """The H100's published figures: 5 us per kernel launched (a CUDA launch and onnxruntime's per-node work at batch
    1), 3.0 TB/s (a device-to-device copy measured on the H100 lent here), 67 TFLOP/s float32 on CUDA cores (NVIDIA's
    H100 SXM datasheet) for every kind of FLOP."""
    per_flop = 1e3 / 67e12
    return Estimate((5e-3, 1e3 / 3.0e12, per_flop, per_flop, per_flop), False, "published H100 figures, not fitted")


# ---------------------------------------------------------------------------------------------------- features
def _itemsize(dtype) -> int:
    """Bytes per element of a numpy dtype, or of an ONNX element type that numpy lacks (graphsurgeon keeps bfloat16 and
    the float8 types as their ONNX enum)."""
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return onnx.helper.tensor_dtype_to_np_dtype(int(dtype)).itemsize if isinstance(dtype, int) else 4


def group_features(group) -> np.ndarray:
    """The `FEATURES` of one fusion group (`CostModel.groups`)."""
    members = {id(n) for n in group.members}
    produced = {id(t) for n in group.members for t in n.outputs}
    shapes: dict[str, tuple[int, ...]] = {}
    read = written = 0
    seen: set[str] = set()

    def size(tensor) -> tuple[tuple[int, ...] | None, int]:
        if isinstance(tensor, gs.Constant):  # its own shape and dtype; the values are never loaded
            shape, dtype = tuple(int(d) for d in tensor.shape), tensor.dtype
        else:
            shape, dtype = group.shapes.get(tensor)
        if shape is None or dtype is None:
            return None, 0
        return shape, int(np.prod(shape, dtype=np.int64)) * _itemsize(dtype)

    for node in group.members:
        moves = node.op not in VIEWS  # a view reads and writes nothing
        for tensor in node.inputs:
            shape, nbytes = size(tensor)
            if shape is not None:
                shapes[tensor.name] = shape
            if moves and tensor.name and id(tensor) not in produced and tensor.name not in seen:
                seen.add(tensor.name)
                read += nbytes
        for tensor in node.outputs:
            shape, nbytes = size(tensor)
            if shape is not None:
                shapes[tensor.name] = shape
            if moves and (not tensor.outputs or any(id(c) not in members for c in tensor.outputs)):
                written += nbytes
    kernels = conv = matmul = other = 0
    for node in group.members:
        kernels += node.op not in VIEWS
        flops = node_flops(OnnxExporter.export_node(node), shapes)
        if node.op in CONV_OPS:
            conv += flops
        elif node.op in MATMUL_OPS:
            matmul += flops
        else:
            other += flops
    return np.array([kernels, read + written, conv, matmul, other], dtype=np.float64)


# ---------------------------------------------------------------------------------------------------- fitting
def fit(features: np.ndarray, costs: np.ndarray, source: str) -> Estimate:
    """Non-negative coefficients minimising the squared error over the square root of the cost.

    Relative error alone let the many microsecond groups decide and underestimated the large ones (held-out sums at
    0.61 of measured on the H100 table); absolute error, the few large ones (held-out within 2x: 71%).  Between the
    two: 95% within 2x, sums at 0.90.  With five features every subset of them is solved by least squares and the
    best whose coefficients are all non-negative is kept: exact non-negative least squares, without a solver.
    """
    scale = np.maximum(features.max(axis=0), 1e-30)
    weights = 1.0 / np.sqrt(np.maximum(costs, FIT_FLOOR_MS))
    a, b = features / scale * weights[:, None], costs * weights
    best, best_loss = np.zeros(len(FEATURES)), float(np.sum(b ** 2))
    for k in range(1, len(FEATURES) + 1):
        for cols in itertools.combinations(range(len(FEATURES)), k):
            coef, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if (coef < 0).any():
                continue
            loss = float(np.sum((a[:, cols] @ coef - b) ** 2))
            if loss < best_loss:
                best_loss, best = loss, np.zeros(len(FEATURES))
                best[list(cols)] = coef
    return Estimate(tuple(float(c) for c in best / scale), True, source)


def error(estimate: Estimate, features: np.ndarray, costs: np.ndarray) -> dict:
    """How far the estimate is from measured costs: median |log ratio|, share within 2x, rank correlation."""
    predicted = np.array([estimate(f) for f in features])
    floor = np.maximum(costs, FIT_FLOOR_MS)
    log_ratio = np.abs(np.log(np.maximum(predicted, FIT_FLOOR_MS) / floor))
    return {"entries": int(len(costs)), "median_abs_log_ratio": float(np.median(log_ratio)),
            "median_factor": float(np.exp(np.median(log_ratio))), "within_2x": float(np.mean(log_ratio < np.log(2))),
            "spearman": spearman(predicted, costs), "sum_estimated_over_measured": float(predicted.sum() / costs.sum())}


# ------------------------------------------------------------------------------------------------ cost model
def load_estimate(path: str | Path) -> Estimate:
    """The estimate stored by this module's command (the published figures where the file does not exist)."""
    path = Path(path)
    if not path.exists():
        return published_h100()
    return Estimate.from_dict(json.loads(path.read_text())["estimate"])
