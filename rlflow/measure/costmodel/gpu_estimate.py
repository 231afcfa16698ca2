"""The cost model of a GPU this machine does not have: a table measured on the device, and an estimate fitted to it.

TASO measures every operator configuration once on the device and then searches against the table.  A machine
without the device can still read such a table (`rlflow/measure/costmodel/tables/`, measured by the GPU kit); for the fusion
groups the table lacks, a group's latency is estimated from its size:

    cost_ms = launch * kernels + bytes / bandwidth + conv_flops / conv_rate + matmul_flops / matmul_rate
              + other_flops / vector_rate

`kernels` counts the group's nodes that launch work, `bytes` the tensors they read (weights included) and write (views
such as Reshape alias their input: no kernel, no bytes), and FLOPs follow `rlflow.graph.flops`.  The coefficients
are fitted to the table's entries (weighted least squares, all coefficients non-negative), with the error on
whole held-out architectures reported beside them.  Without a table the coefficients come from the device's published
figures, and the estimate says it is uncalibrated.

    rlflow costmodel fit --table docs/results/gpu/cost-table-h100.json \\
        --out rlflow/measure/costmodel/tables/cuda-h100.estimate.json --report docs/results/gpu/estimate.md
"""
from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np

from rlflow.errors import RlflowError
from rlflow.files import write_text_atomic
from rlflow.graph.core import Graph, load
from rlflow.measure.costmodel.model import CostModel
from rlflow.measure.costmodel.size_estimate import (
    FEATURES,
    FIT_FLOOR_MS,
    SHIPPED,
    Estimate,
    error,
    fit,
    group_features,
    load_estimate,
)
from rlflow.measure.session import PROVIDERS, SessionSettings

HELD_OUT = ("inception-v3", "densenet-121", "vit-b-16", "nasrnn")
"""Architectures whose entries are kept out of the fit that reports the held-out error (those the shipped agent never
trained on)."""


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


# ------------------------------------------------------------------------------------------------ the command
def table_entries(table: dict, specs: list[str], sequences: int, length: int, seed: int) -> dict[str, list]:
    """Model name -> [(canonical key, features, cost)] for the groups of its graph and of random rewrites of it that
    the table holds (groups are found again here: the table stores hashes, not shapes)."""
    from rlflow.measure.costmodel.check import random_graphs, resolve_model

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


def fit_to_table(table: str | Path, out: str | Path, models=None, sequences: int = 8, length: int = 4, seed: int = 0,
                 report: str | Path | None = None) -> dict:
    """`rlflow costmodel fit`: fits the estimate to the cost table at `table` (measured on the device) over the table
    entries of `models` (zoo names or .onnx files; None: every full-size zoo model) and `sequences` random rewrite
    sequences of each, and reports its error on the architectures of `HELD_OUT` kept out of one fit; writes the
    result to `out` (JSON) and the markdown report to `report`, prints the report and returns the result."""
    if models is None:
        from rlflow import zoo

        models = zoo.names(include_tiny=False)
    models = list(models)
    table_path = table
    table = json.loads(Path(table_path).read_text())
    per_model = table_entries(table, models, sequences, length, seed)
    unique: dict[str, tuple] = {}
    for rows in per_model.values():
        for key, feats, cost in rows:
            unique.setdefault(key, (feats, cost))
    if len(unique) < len(FEATURES):
        raise RlflowError(f"only {len(unique)} table entries found: too few to fit")
    x_all = np.array([f for f, _ in unique.values()])
    y_all = np.array([c for _, c in unique.values()])
    source = (f"{table_path} ({len(unique)} entries; {table['key']['machine']}, "
              f"onnxruntime {table['key']['onnxruntime']})")
    estimate = fit(x_all, y_all, source)
    held = [m for m in HELD_OUT if m in per_model]
    train_keys = {k for m, rows in per_model.items() if m not in held for k, _, _ in rows}
    train = [unique[k] for k in train_keys]
    partial = fit(np.array([f for f, _ in train]), np.array([c for _, c in train]), "fit without held-out models")
    held_rows = {m: [(f, c) for k, f, c in per_model[m] if k not in train_keys] for m in held}
    held_rows = {m: rows for m, rows in held_rows.items() if rows}
    every = [r for rows in held_rows.values() for r in rows]
    result = {
        "table": str(table_path), "models": list(per_model), "sequences": sequences, "length": length,
        "seed": seed, "entries": len(unique), "estimate": estimate.as_dict(),
        "in_sample": error(estimate, x_all, y_all),
        "held_out": {"models": held, "fitted_on_entries": len(train), "estimate": partial.as_dict(),
                     "all": error(partial, np.array([f for f, _ in every]), np.array([c for _, c in every])),
                     "per_model": {m: error(partial, np.array([f for f, _ in rows]), np.array([c for _, c in rows]))
                                   for m, rows in held_rows.items()}},
    }
    write_text_atomic(out, json.dumps(result, indent=1) + "\n")
    if report:
        write_text_atomic(report, report_markdown(result))
    print(report_markdown(result))
    return result
