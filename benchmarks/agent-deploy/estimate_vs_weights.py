"""The cost model's estimate of each model against its measured run time, beside the bytes of weights one run reads:
whether the estimate falls short where the weights cannot stay in the last-level cache (isolated groups are timed
with their weights hot).  Embedding tables are left out of the bytes: a Gather reads a few rows of them.

    python benchmarks/agent-deploy/estimate_vs_weights.py models/*.onnx --out FILE.md
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from onnx import numpy_helper

from rlflow.graph.core import load
from rlflow.measure.costmodel.model import CostModel
from rlflow.measure.inputs import random_inputs
from rlflow.measure.session import SessionSettings
from rlflow.measure.timing import Runner

EMBEDDING_ROWS = 10000
"""A 2-D initializer with at least this many rows is taken for an embedding table (read a row at a time)."""


def weight_mib(model) -> tuple[float, float]:
    """(MiB of weights a run reads in full, MiB of embedding tables)."""
    full = table = 0
    for tensor in model.graph.initializer:
        array = numpy_helper.to_array(tensor)
        if array.ndim == 2 and array.shape[0] >= EMBEDDING_ROWS:
            table += array.nbytes
        else:
            full += array.nbytes
    return full / 2**20, table / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    settings = SessionSettings(threads=1)
    cost_model = CostModel(settings)
    lines = ["# Cost-model estimate against measured run time, by weight bytes", "",
             f"`python benchmarks/agent-deploy/estimate_vs_weights.py {' '.join(map(str, args.models))} "
             f"--out {args.out}`", "", f"Settings: {settings}; table `{cost_model.path}`. Measured: median of "
             f"{args.runs} warm runs of the whole model, call overhead included.", "",
             "| model | weights read (MiB) | embedding tables (MiB) | estimate ms | measured ms | "
             "estimate / measured |",
             "|---|---:|---:|---:|---:|---:|"]
    for path in args.models:
        graph = load(path)
        model = graph.to_model(static=True)
        estimate = cost_model.graph_cost(graph)
        runner = Runner(model, settings, random_inputs(model, 0))
        for _ in range(3):
            runner.run()
        measured = 1000 * statistics.median(runner.time(1) for _ in range(args.runs))
        full, table = weight_mib(model)
        lines.append(f"| {path.stem} | {full:.1f} | {table:.1f} | {estimate:.3f} | {measured:.3f} | "
                     f"{estimate / measured:.2f} |")
        print(lines[-1], flush=True)
    cost_model.save()
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
