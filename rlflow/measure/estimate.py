"""The cost model of a GPU this machine does not have: a table measured on the device, and an estimate fitted to it.

TASO measures every operator configuration once on the device and then searches against the table.  A machine
without the device can still read such a table (`rlflow/measure/tables/`, measured by the GPU kit); for the fusion
groups the table lacks, a group's latency is estimated from its size:

    cost_ms = launch * kernels + bytes / bandwidth + conv_flops / conv_rate + matmul_flops / matmul_rate
              + other_flops / vector_rate

`kernels` counts the group's nodes that launch work, `bytes` the tensors they read (weights included) and write (views
such as Reshape alias their input: no kernel, no bytes), and FLOPs follow `rlflow.measure.flops`.  The coefficients
are fitted to the table's entries (weighted least squares, all coefficients non-negative), with the error on
whole held-out architectures reported beside them.  Without a table the coefficients come from the device's published
figures, and the estimate says it is uncalibrated.

    python -m rlflow.measure.estimate --table docs/results/gpu/cost-table-h100.json \\
        --out rlflow/measure/tables/cuda-h100.estimate.json --report docs/results/gpu/estimate.md
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter

from rlflow.errors import RlflowError
from rlflow.files import write_text_atomic
from rlflow.graph import Graph, load
from rlflow.measure.costmodel import TABLES, CostModel, spearman
from rlflow.measure.flops import node_flops
from rlflow.measure.session import PROVIDERS, SessionSettings

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

HELD_OUT = ("inception-v3", "densenet-121", "vit-b-16", "nasrnn")
"""Architectures whose entries are kept out of the fit that reports the held-out error (those the shipped agent never
trained on)."""


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
        return shape, int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize

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
class EstimatedCostModel(CostModel):
    """A cost model for a provider this machine cannot run: the shipped table, and the estimate for groups it lacks.

    It never measures and never writes: the table is the device's, read-only.  Groups the table holds cost what the
    device measured; the others cost what `estimate` says (remembered per group configuration).
    """

    def __init__(self, settings: SessionSettings, table: str | Path, estimate: Estimate):
        super().__init__(settings, cache_dir=Path(table).parent)
        self.path = Path(table)
        self.estimate = estimate
        self._estimated: dict[str, float] = {}

    def _measure_group(self, graph: Graph, group) -> float:
        cost = self._estimated.get(group.key)
        if cost is None:
            cost = self._estimated[group.key] = self.estimate(group_features(group))
        return cost

    def save(self) -> None:
        """Nothing to write: the table is the device's."""

    def _read(self) -> dict:
        data = json.loads(self.path.read_text())
        key = data.get("key", {})
        if key.get("version") != self.key["version"] or key.get("provider") != self.settings.provider:
            raise ValueError(f"{self.path}: a version-{key.get('version')} table for {key.get('provider')}, "
                             f"not version {self.key['version']} for {self.settings.provider}")
        return data


def cost_model_for(provider: str = "cpu", cache_dir: str | Path | None = None) -> CostModel:
    """The cost model a trainer uses for `provider`: measured here where the provider runs here; for CUDA on a machine
    without it, the shipped H100 table with its fitted estimate (nothing is measured)."""
    import onnxruntime as ort

    from rlflow.measure.session import resolve_provider

    name = PROVIDERS.get(provider.lower()) if provider != "auto" else None
    if name is not None and name not in ort.get_available_providers() and provider.lower() in SHIPPED:
        table, estimate = SHIPPED[provider.lower()]
        return EstimatedCostModel(SessionSettings(provider=name), table, load_estimate(estimate))
    return CostModel(SessionSettings(provider=resolve_provider(provider)), cache_dir=cache_dir)


def estimated_only(cost_model: CostModel, *, measuring: bool) -> bool:
    """Whether `cost_model` only estimates (its provider cannot run here); says so on stdout.

    Raises:
        RlflowError: `measuring` (a reward measured end to end) asked of a provider that cannot run here.
    """
    if not isinstance(cost_model, EstimatedCostModel):
        return False
    provider = cost_model.settings.provider
    if measuring:
        raise RlflowError(f"reward 'measure' needs the {provider}, which this machine lacks: train with reward 'cost'")
    estimate = "an estimate fitted to it" if cost_model.estimate.calibrated else "an uncalibrated estimate"
    print(f"{provider} is not available here: rewards come from {cost_model.path.name} and {estimate} "
          f"({cost_model.estimate.source}); nothing is measured", flush=True)
    return True


def load_estimate(path: str | Path) -> Estimate:
    """The estimate stored by this module's command (the published figures where the file does not exist)."""
    path = Path(path)
    if not path.exists():
        return published_h100()
    return Estimate.from_dict(json.loads(path.read_text())["estimate"])


# ------------------------------------------------------------------------------------------------ the command
def table_entries(table: dict, specs: list[str], sequences: int, length: int, seed: int) -> dict[str, list]:
    """Model name -> [(canonical key, features, cost)] for the groups of its graph and of random rewrites of it that
    the table holds (groups are found again here: the table stores hashes, not shapes)."""
    from rlflow.measure.costmodel_check import random_graphs, resolve_model

    probe = CostModel(SessionSettings(provider=table["key"]["provider"]), cache_dir="/nonexistent")
    found: dict[str, list] = {}
    for spec in specs:
        name, path = resolve_model(spec)
        graph = load(path)
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        rows, keys = [], set()
        for _, variant in random_graphs(graph, sequences, length, rng):
            for group in probe.groups(variant):
                canon = table["groups"].get(group.key)
                if canon in table["costs"] and canon not in keys:
                    keys.add(canon)
                    rows.append((canon, group_features(group), float(table["costs"][canon])))
        found[name] = rows
        print(f"{name}: {len(rows)} table entries found", flush=True)
    return found


def _rate(ms_per_unit: float, unit: float) -> str:
    """A coefficient in ms per byte or FLOP as a rate in `unit`s per second ("inf": the fit gave the term no weight)."""
    return "inf" if ms_per_unit <= 0 else f"{1e3 / ms_per_unit / unit:.3g}"


def report_markdown(result: dict) -> str:
    e, held = result["estimate"], result["held_out"]
    coef = dict(zip(FEATURES, e["coefficients"]))
    rows = [f"| {name} | {r['entries']} | {r['median_factor']:.2f}x | {r['within_2x']:.2f} | {r['spearman']:.3f} | "
            f"{r['sum_estimated_over_measured']:.2f} |" for name, r in held["per_model"].items()]
    return "\n".join([
        "# CUDA cost estimate fitted to the H100 table", "",
        f"Table: `{result['table']}` ({result['entries']} entries found again from {len(result['models'])} zoo models "
        f"and {result['sequences']} random rewrite sequences each). Estimate per fusion group:", "",
        "`cost_ms = launch * kernels + bytes / bandwidth + conv_flops / conv_rate + matmul_flops / matmul_rate + "
        "other_flops / vector_rate`", "",
        "| fitted on all entries | value |", "|---|---:|",
        f"| launch per kernel | {coef['kernels'] * 1e3:.2f} us |",
        f"| bandwidth | {_rate(coef['bytes'], 1e9)} GB/s |",
        f"| convolution rate | {_rate(coef['conv_flops'], 1e12)} TFLOP/s |",
        f"| matrix-product rate | {_rate(coef['matmul_flops'], 1e12)} TFLOP/s |",
        f"| other FLOP rate | {_rate(coef['other_flops'], 1e12)} TFLOP/s |",
        "", "(A rate shown as inf: the fit gave that term no weight.)", "",
        f"Held-out error: fitted without the entries of {', '.join(held['models'])}, evaluated on their entries the fit "
        "never saw. *Factor*: median of max(est/meas, meas/est); costs below "
        f"{FIT_FLOOR_MS * 1e3:.0f} us count as {FIT_FLOOR_MS * 1e3:.0f} us.", "",
        "| held-out model | entries | median factor | within 2x | Spearman | sum est / sum meas |",
        "|---|---:|---:|---:|---:|---:|", *rows,
        f"| **all held out** | {held['all']['entries']} | {held['all']['median_factor']:.2f}x | "
        f"{held['all']['within_2x']:.2f} | {held['all']['spearman']:.3f} | {held['all']['sum_estimated_over_measured']:.2f} |",
        "", f"In-sample (all entries): median factor {result['in_sample']['median_factor']:.2f}x, within 2x "
        f"{result['in_sample']['within_2x']:.2f}, Spearman {result['in_sample']['spearman']:.3f}.", ""])


def main(argv: list[str] | None = None) -> int:
    from rlflow import zoo

    parser = argparse.ArgumentParser(prog="python -m rlflow.measure.estimate", description=__doc__.splitlines()[0])
    parser.add_argument("--table", required=True, help="a cost table measured on the device")
    parser.add_argument("--models", nargs="+", default=zoo.names(include_tiny=False), help="zoo names or .onnx files")
    parser.add_argument("--sequences", type=int, default=8, help="random rewrite sequences per model")
    parser.add_argument("--length", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="JSON: the estimate fitted on every entry, and the report")
    parser.add_argument("--report", help="markdown report")
    args = parser.parse_args(argv)
    table = json.loads(Path(args.table).read_text())
    per_model = table_entries(table, args.models, args.sequences, args.length, args.seed)
    unique: dict[str, tuple] = {}
    for rows in per_model.values():
        for key, feats, cost in rows:
            unique.setdefault(key, (feats, cost))
    if len(unique) < len(FEATURES):
        raise SystemExit(f"only {len(unique)} table entries found: too few to fit")
    x_all = np.array([f for f, _ in unique.values()])
    y_all = np.array([c for _, c in unique.values()])
    source = f"{args.table} ({len(unique)} entries; {table['key']['machine']}, onnxruntime {table['key']['onnxruntime']})"
    estimate = fit(x_all, y_all, source)
    held = [m for m in HELD_OUT if m in per_model]
    train_keys = {k for m, rows in per_model.items() if m not in held for k, _, _ in rows}
    train = [unique[k] for k in train_keys]
    partial = fit(np.array([f for f, _ in train]), np.array([c for _, c in train]), "fit without held-out models")
    held_rows = {m: [(f, c) for k, f, c in per_model[m] if k not in train_keys] for m in held}
    held_rows = {m: rows for m, rows in held_rows.items() if rows}
    every = [r for rows in held_rows.values() for r in rows]
    result = {
        "table": args.table, "models": list(per_model), "sequences": args.sequences, "length": args.length,
        "seed": args.seed, "entries": len(unique), "estimate": estimate.as_dict(),
        "in_sample": error(estimate, x_all, y_all),
        "held_out": {"models": held, "fitted_on_entries": len(train), "estimate": partial.as_dict(),
                     "all": error(partial, np.array([f for f, _ in every]), np.array([c for _, c in every])),
                     "per_model": {m: error(partial, np.array([f for f, _ in rows]), np.array([c for _, c in rows]))
                                   for m, rows in held_rows.items()}},
    }
    write_text_atomic(args.out, json.dumps(result, indent=1) + "\n")
    if args.report:
        write_text_atomic(args.report, report_markdown(result))
    print(report_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
