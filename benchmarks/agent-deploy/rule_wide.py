"""Per rule, applied wherever it matches (one rule-wide step, as the agents act): the cost model's speedup against the
measured one (interleaved end to end against the input, CPU, 1 thread).  Shows where the training reward misprices a
step the agents learn from.

    python benchmarks/agent-deploy/rule_wide.py MODEL.onnx... --rules R1,R2 --out FILE.md
"""
from __future__ import annotations

import argparse
from pathlib import Path

from rlflow.graph.core import load
from rlflow.measure.costmodel.model import CostModel
from rlflow.measure.session import SessionSettings
from rlflow.measure.timing import compare
from rlflow.rewrites import apply_everywhere, rule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--rules", required=True, help="comma-separated rule names")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    cost_model, settings = CostModel(), SessionSettings(threads=1)
    lines = ["# One rule-wide step: cost model against measurement", "",
             f"`python benchmarks/agent-deploy/rule_wide.py {' '.join(map(str, args.models))} --rules {args.rules} "
             f"--rounds {args.rounds} --out {args.out}`", "",
             f"Settings: {settings}. Speedup of the input with the rule applied wherever it matches over the input; "
             "measured: median and 95% interval over interleaved rounds.", "",
             "| model | rule | places | cost model | measured |", "|---|---|---:|---:|---|"]
    for path in args.models:
        graph = load(path)
        for name in args.rules.split(","):
            matches = rule(name).find(graph)
            if not matches:
                lines.append(f"| {path.stem} | {name} | 0 | | |")
                continue
            rewritten, applied = apply_everywhere(graph, rule(name), matches[:1])
            estimate = cost_model.graph_cost(graph) / cost_model.graph_cost(rewritten)
            ratio = compare([graph.to_model(static=True), rewritten.to_model(static=True)], settings,
                            rounds=args.rounds, seed=0).ratios[1]
            lines.append(f"| {path.stem} | {name} | {len(applied)} | {estimate:.3f}x | {ratio} |")
            print(lines[-1], flush=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
