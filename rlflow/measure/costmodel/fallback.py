"""Costs of the fusion groups a time-limited search had no time to measure: an estimate from each group's size.

Measuring a group the cost table lacks takes a few tenths of a second (sessions built and timed, see
`rlflow.measure.costmodel.model`), so a model never seen can need more than a search's whole time limit to fill its table
(BERT L6/H384: 30 groups).  Past its deadline, a `CostModel` therefore asks this estimate instead, in the form of
`rlflow.measure.costmodel.gpu_estimate`:

    cost_ms = launch * kernels + bytes / bandwidth + conv_flops / conv_rate + matmul_flops / matmul_rate
              + other_flops / vector_rate

starting from the provider's figures (`cpu_figures`, or the shipped CUDA fit) and calibrated to the groups whose cost
this process did look up or measure: scaled by their median ratio, or refitted on them when that fits them better.
An estimate is a guess the end-to-end measurement of the search's candidates and the final gate then judge; it never
enters the table on disk.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from rlflow.measure.costmodel.size_estimate import SHIPPED, Estimate, error, fit, group_features, load_estimate

MIN_FIT = 12
"""Calibration groups from which a full refit is tried (below, the provider's figures are only scaled)."""

MAX_SAMPLES = 256
"""Calibration groups kept at most (the first met)."""

MIN_SCALE = 3
"""Calibration groups from which the provider's figures are scaled (one odd group must not scale every estimate)."""

MAX_SCALE = 8.0
"""The scale stays within [1 / MAX_SCALE, MAX_SCALE]."""

GATHERS = frozenset({"Gather", "GatherElements", "GatherND"})
"""Operators that read only the rows they return, however large the table they index."""


def features(group) -> np.ndarray:
    """`group_features`, except that a gather from a constant table reads what it returns, not the whole table
    (BERT's word embedding: 16 rows of 47 MB)."""
    values = group_features(group)
    for node in group.members:
        if node.op in GATHERS and node.inputs and isinstance(node.inputs[0], gs.Constant):
            table = node.inputs[0].values
            out_shape, out_dtype = group.shapes.get(node.outputs[0])
            returned = (int(np.prod(out_shape, dtype=np.int64)) * np.dtype(out_dtype).itemsize
                        if out_shape is not None and out_dtype is not None else 0)
            values[1] = max(values[1] - table.nbytes + returned, 0.0)
    return values


def cpu_figures() -> Estimate:
    """One CPU core under onnxruntime, roughly as measured on the project's machines (BERT L6/H384's 30 groups at
    sequence 16 within 2.5x of their table entries): 1.5 us per kernel, 25 GB/s, 100 GFLOP/s for matrix products and
    50 for convolutions, 2 GFLOP/s for the rest."""
    return Estimate((1.5e-3, 1e3 / 25e9, 1e3 / 50e9, 1e3 / 100e9, 1e3 / 2e9), False, "CPU figures, not fitted")


def default_estimate(provider: str) -> Estimate:
    """The provider's figures before calibration: the shipped fit for CUDA, else `cpu_figures`."""
    if provider.startswith("CUDA"):
        return load_estimate(SHIPPED["cuda"][1])
    return cpu_figures()


class Fallback:
    """The estimate for groups not measured in time, calibrated to the (group, cost) pairs it is shown.

    Args:
        provider: onnxruntime provider name (`CPUExecutionProvider`...).
    """

    def __init__(self, provider: str):
        self.base = default_estimate(provider)
        self._samples: dict[str, tuple[np.ndarray, float]] = {}
        self._estimate: Estimate | None = None
        self._fitted_on = -1

    def learn(self, key: str, group, cost: float) -> None:
        """Remembers one group whose cost is known (measured or in the table)."""
        if key not in self._samples and len(self._samples) < MAX_SAMPLES and cost > 0:
            self._samples[key] = (features(group), float(cost))

    def knows(self, key: str) -> bool:
        return key in self._samples

    def __call__(self, group) -> float:
        """Estimated milliseconds of one group."""
        return self.estimate(features(group))

    @property
    def source(self) -> str:
        return self._calibrated().source

    def estimate(self, features: np.ndarray) -> float:
        return self._calibrated()(features)

    def _calibrated(self) -> Estimate:
        """The base scaled to the samples, or refitted on them where that fits them better (cached until more come)."""
        if self._estimate is not None and self._fitted_on == len(self._samples):
            return self._estimate
        self._fitted_on = len(self._samples)
        if not self._samples:
            self._estimate = self.base
            return self._estimate
        features = np.array([f for f, _ in self._samples.values()])
        costs = np.array([c for _, c in self._samples.values()])
        predicted = np.array([self.base(f) for f in features])
        scale = 1.0
        if len(costs) >= MIN_SCALE:
            scale = float(np.clip(np.median(costs / predicted), 1 / MAX_SCALE, MAX_SCALE))
        best = Estimate(tuple(c * scale for c in self.base.coefficients), False,
                        f"{self.base.source}, scaled by {scale:.2f} to {len(costs)} groups measured")
        if len(costs) >= MIN_FIT:
            refit = fit(features, costs, f"fitted to {len(costs)} groups measured")
            if _log_error(refit, features, costs) < _log_error(best, features, costs):
                best = refit
        self._estimate = best
        return best


def _log_error(estimate: Estimate, features: np.ndarray, costs: np.ndarray) -> float:
    return error(estimate, features, costs)["median_abs_log_ratio"]


__all__ = ["Fallback", "cpu_figures", "default_estimate"]
