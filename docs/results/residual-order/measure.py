"""What `residual-bias-reorder` alone is worth on the deployment section's encoders: each export against itself with
the rule applied wherever it matches, end to end (interleaved rounds, 1 thread, ORT_ENABLE_ALL on both sides), with
the nodes onnxruntime leaves in each after its own optimisation.

    python docs/results/residual-order/measure.py [--rounds 12] models/<export>.onnx ...   # writes results.md beside it
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from rlflow.graph.core import Graph
from rlflow.graph.input_shapes import deployed_shapes
from rlflow.graph.model_file import read_model
from rlflow.measure.session import SessionSettings, create_session
from rlflow.measure.timing import compare
from rlflow.rewrites import apply_everywhere, rule

HERE = Path(__file__).parent


def fused_ops(model, path: Path) -> Counter:
    """Operators in the graph onnxruntime 1.31's CPU provider runs after ORT_ENABLE_ALL."""
    import onnx

    create_session(model, SessionSettings(threads=1), save_optimised=str(path))
    return Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    settings = SessionSettings(threads=1)
    reorder = rule("residual-bias-reorder")
    rows = []
    for path in args.models:
        model = read_model(path)
        graph = Graph.from_model(model, deployed_shapes(model), source=str(path))
        matches = reorder.find(graph)
        if not matches:
            rows.append({"model": path.stem, "matches": 0})
            print(path.stem, "no match", flush=True)
            continue
        new, done = apply_everywhere(graph, reorder, matches)
        before, after = graph.to_model(), new.to_model()
        timing = compare([before, after], settings, rounds=args.rounds, seed=0)
        ratio = timing.ratios[1]
        ops = [fused_ops(m, HERE / "scratch.onnx") for m in (before, after)]
        for scratch in HERE.glob("scratch.onnx*"):
            scratch.unlink()
        row = {"model": path.stem, "matches": len(done), "speedup": ratio.median, "low": ratio.low,
               "high": ratio.high, "ops_before": {k: ops[0][k] for k in ("SkipLayerNormalization", "Gemm",
                                                                         "LayerNormalization", "Add")},
               "ops_after": {k: ops[1][k] for k in ("SkipLayerNormalization", "Gemm", "LayerNormalization", "Add")}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    (HERE / "results.json").write_text(json.dumps({"rounds": args.rounds, "threads": 1, "rows": rows}, indent=1))
    lines = ["| export | matches | speedup [95% interval] | after ORT: SkipLayerNorm / Gemm / LayerNorm, before -> after |",
             "| --- | ---: | --- | --- |"]
    for r in rows:
        if not r["matches"]:
            lines.append(f"| {r['model']} | 0 | | |")
            continue
        b, a = r["ops_before"], r["ops_after"]
        lines.append(f"| {r['model']} | {r['matches']} | {r['speedup']:.3f} [{r['low']:.3f}, {r['high']:.3f}] | "
                     f"{b['SkipLayerNormalization']}/{b['Gemm']}/{b['LayerNormalization']} -> "
                     f"{a['SkipLayerNormalization']}/{a['Gemm']}/{a['LayerNormalization']} |")
    (HERE / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
