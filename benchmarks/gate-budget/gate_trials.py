"""The gate's decision on a large decoder step at the budget it had (30 s) and at the budget that fits its whole plan
(`gate_budget` since 2026-11-29), over several seeds: on greedy's output (a real gain, measured 1.08-1.13x by the
bench) and on the input against itself (a placebo, which a calibrated gate keeps in at most 2.5% of trials).

    python benchmarks/gate-budget/gate_trials.py MODEL OUTPUT --profile P [--profile P] [--fix-dim batch=1] \
        [--seeds 3] --out docs/results/gate-budget/NAME.json
"""
from __future__ import annotations

import argparse
import json
import time

from rlflow.bench.machine import environment
from rlflow.measure.gate import GATE_MAX_SECONDS, gate_budget, measure_gate
from rlflow.measure.memory import shares_weights
from rlflow.measure.session import SessionSettings
from rlflow.measure.shape_profiles import parse_profile
from rlflow.optimize.options import DEFAULT_TIME_LIMITS, rules_for
from rlflow.optimize.pipeline import _default_time_limit, _planned_candidates, _time_input, load_input
from rlflow.rewrites import RULES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("output", help="the rewritten model (rlflow optimize's output)")
    parser.add_argument("--profile", action="append", default=[])
    parser.add_argument("--fix-dim", action="append", default=[])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    profiles = [parse_profile(p) for p in args.profile]
    fixed = {k: int(v) for k, v in (f.split("=") for f in args.fix_dim)}
    graph, given = load_input(args.model, None, profiles, fixed)
    candidate, _ = load_input(args.output, None, list(graph.profiles), None)  # written with the dimensions fixed
    settings = SessionSettings(threads=1, share_weights=shares_weights(graph))
    rules = rules_for(RULES, "all", settings.provider)
    trials = []
    for seed in range(args.seeds):
        for label, other in (("output", candidate), ("placebo", graph.clone())):
            paces, _ = _time_input(graph, given, settings, seed)
            limit = _default_time_limit("greedy", paces, _planned_candidates("greedy", graph, rules))
            for budget_name, budget in (("30 s", GATE_MAX_SECONDS), ("whole plan", gate_budget(limit, paces, 30))):
                start = time.monotonic()
                gate = measure_gate(graph, other, settings, paces, rounds=30, budget=budget, seed=seed)
                row = {"seed": seed, "candidate": label, "budget": budget_name, "budget_s": round(budget, 1),
                       "seconds": round(time.monotonic() - start, 1),
                       "blocks": [c.extra["blocks"] for c in gate.comparisons],
                       "rounds": [c.rounds for c in gate.comparisons], "ratio": gate.ratio.as_dict(),
                       "kept": gate.keep}
                trials.append(row)
                print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "output": args.output, "profiles": args.profile, "fix_dim": args.fix_dim,
                   "default_limits": DEFAULT_TIME_LIMITS, "environment": environment(settings), "trials": trials},
                  f, indent=1)


if __name__ == "__main__":
    main()
