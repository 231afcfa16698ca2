"""What the NaN guards after fused attentions cost on the CPU: every fusion but attention-nan-guard-elim, against the
same graph with the guards dropped, interleaved, 1 thread.

    python benchmarks/nan-guard/guard_ab.py ROUNDS MODEL...   # writes docs/results/nan-guard/guard-cost.json
"""
import json
import sys
from pathlib import Path

from rlflow.graph.core import load
from rlflow.measure.session import SessionSettings
from rlflow.measure.timing import compare
from rlflow.rewrites import RULES, apply_everywhere, rule
from rlflow.search.candidates import Candidate, all_fusions

GUARD = "attention-nan-guard-elim"


def main(rounds: int, paths: list[str]) -> dict:
    out = {}
    for path in paths:
        graph = load(path)
        fused = all_fusions(Candidate(graph, (), graph.fingerprint()), [r for r in RULES if r.name != GUARD]).graph
        guard = rule(GUARD)
        dropped, done = apply_everywhere(fused, guard, guard.find(fused))
        c = compare([fused.to_model(), dropped.to_model()], SessionSettings(threads=1), rounds=rounds, seed=0)
        ratio = c.ratios[1]
        out[path] = {"guards": len(done), "speedup": ratio.median, "low": ratio.low, "high": ratio.high,
                     "ms_with_guards": c.timings[0].median_ms, "rounds": c.rounds, "blocks": c.extra.get("blocks")}
        print(path, out[path], flush=True)
    return out


if __name__ == "__main__":
    result = main(int(sys.argv[1]), sys.argv[2:])
    results = Path(__file__).resolve().parents[2] / "docs" / "results" / "nan-guard"
    (results / "guard-cost.json").write_text(json.dumps(result, indent=1) + "\n")
