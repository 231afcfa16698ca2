"""Does the cost model rank the fuse-everything variants as measurement does?  Per model: every fusion at once
(`all_fusions`), and that graph with one inverse rule applied everywhere (each that matches twice or more), priced by
the cost model on this machine's table (`CostModel.graph_costs`, as the agent prices them) and measured interleaved
against the input (1 thread).  Writes results.json and results.md into FOLDER.

    python benchmarks/fuse-variants/fuse_variants.py MODEL.onnx... --out FOLDER [--rounds 30]
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import rlflow
from rlflow.measure.costmodel.model import CostModel
from rlflow.measure.memory import shares_weights
from rlflow.measure.session import SessionSettings
from rlflow.measure.timing import compare
from rlflow.rewrites import RULES
from rlflow.search.candidates import Candidate
from rlflow.search.fuse_everything import VARIANTS_MEASURED, fuse_variants


def variants(path: str) -> tuple[rlflow.Graph, list[tuple[str, Candidate]]]:
    graph = rlflow.load(path)
    fused, *undone = fuse_variants(Candidate(graph, (), graph.fingerprint()), RULES)
    return graph, [("every fusion", fused), *((f"with {c.applied[-1].rule}", c) for c in undone)]


def row(path: str, settings: SessionSettings, rounds: int) -> dict:
    graph, named = variants(path)
    settings = replace(settings, share_weights=shares_weights(graph))  # a 1 GiB decoder: as `rlflow optimize` runs it
    cost_model = CostModel(settings)
    prices = cost_model.graph_costs([graph] + [c.graph for _, c in named])
    cost_model.save()
    ratios = compare([graph.to_model(static=True)] + [c.graph.to_model(static=True) for _, c in named], settings,
                     rounds=rounds, seed=0).ratios[1:]
    rows = [{"variant": name, "estimated": prices[0] / price, "measured": r.median, "low": r.low, "high": r.high}
            for (name, _), price, r in zip(named, prices[1:], ratios)]
    rows.sort(key=lambda r: -r["estimated"])
    best = max(rows, key=lambda r: r["measured"])
    return {"model": Path(path).stem, "variants": rows, "fastest_measured": best["variant"],
            "rank_by_estimate": rows.index(best) + 1}


def markdown(results: list[dict], command: str) -> str:
    lines = ["# Fuse-everything variants: the cost model's ranking against measurement (CPU, 1 thread)", "",
             f"Written by `{command}`. Per model, the variants cheapest by the cost model first; estimated and "
             "measured speedups over the input (median [95% interval] of interleaved rounds). The agent measures the "
             f"first {VARIANTS_MEASURED}.", "",
             "| model | variant | estimated | measured | fastest measured |", "| --- | --- | ---: | --- | --- |"]
    for result in results:
        for i, r in enumerate(result["variants"]):
            mark = "**yes**" if r["variant"] == result["fastest_measured"] else ""
            lines.append(f"| {result['model'] if i == 0 else ''} | {r['variant']} | {r['estimated']:.3f} | "
                         f"{r['measured']:.3f} [{r['low']:.3f}, {r['high']:.3f}] | {mark} |")
    ranks = [r["rank_by_estimate"] for r in results]
    lines += ["", f"The fastest measured is the cost model's first on {ranks.count(1)} of {len(ranks)} models, within "
              f"its first {VARIANTS_MEASURED} on {sum(k <= VARIANTS_MEASURED for k in ranks)}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    settings = SessionSettings(threads=1)
    results = []
    for path in args.models:
        results.append(row(path, settings, args.rounds))
        print(results[-1]["model"], results[-1]["fastest_measured"], results[-1]["rank_by_estimate"], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"settings": settings.as_dict(), "rounds": args.rounds,
                                                       "models": results}, indent=1))
    command = "python benchmarks/fuse-variants/fuse_variants.py " + " ".join(args.models) + f" --out {args.out}"
    (args.out / "results.md").write_text(markdown(results, command))


if __name__ == "__main__":
    main()
