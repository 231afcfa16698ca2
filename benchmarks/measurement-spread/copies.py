"""How often does a measurement call a graph faster than itself?  Each model against copies of itself, as greedy's
screening measures a batch (the base and six candidates, greedy's 9 interleaved rounds, one block of sessions) and as
the bench measures a pair (12 rounds, two blocks), several seeds: every interval that excludes 1 is a false
difference.  Writes copies.json beside this file.

    python benchmarks/measurement-spread/copies.py models/gpt2-decode-kv128-ts.onnx models/bert-l2-h128-s16-ts.onnx ...
"""
import datetime
import json
import sys
from pathlib import Path

from rlflow.bench.machine import environment
from rlflow.graph.core import load
from rlflow.measure.session import SessionSettings
from rlflow.measure.timing import compare

SETUPS = (("screening batch", 6, 9), ("bench pair", 1, 12))
"""(name, copies measured against the model, interleaved rounds)."""
SEEDS = (0, 1, 2)


def main(paths: list[str]) -> dict:
    settings = SessionSettings(threads=1)
    out = {"date": datetime.date.today().isoformat(), "environment": environment(settings), "seeds": SEEDS,
           "models": {}}
    for path in paths:
        model = load(path).to_model(static=True)
        rows = []
        for name, copies, rounds in SETUPS:
            for seed in SEEDS:
                compared = compare([model] * (copies + 1), settings, rounds=rounds, seed=seed)
                for ratio in compared.ratios[1:]:
                    rows.append({"setup": name, "rounds": rounds, "seed": seed, "median": ratio.median,
                                 "low": ratio.low, "high": ratio.high, "apart": ratio.low > 1 or ratio.high < 1})
        out["models"][Path(path).stem] = rows
        for name, _, _ in SETUPS:
            mine = [r for r in rows if r["setup"] == name]
            print(f"{Path(path).stem} / {name}: {sum(r['apart'] for r in mine)} of {len(mine)} intervals exclude 1; "
                  f"medians {min(r['median'] for r in mine):.3f}-{max(r['median'] for r in mine):.3f}", flush=True)
    (Path(__file__).resolve().parents[2] / "docs" / "results" / "measurement-spread" / "copies.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
