"""Greedy's first candidate on a decode step (every fusion at once) screened as greedy's first batch screens it, at
both cache lengths: with the base in six sessions and the session-spread interval (06cbfd6), and with the percentile
bootstrap of one pair of sessions (every other commit), one trial per seed.  Runs at 06cbfd6 only
(`git worktree add /tmp/spread 06cbfd6`, then `PYTHONPATH=/tmp/spread`).

    python docs/results/archive/decoders/session-spread/every_fusion.py MODEL fix|dynamic TRIALS
"""
import sys

from rlflow.measure.profile_comparison import compare_profiled
from rlflow.measure.session import SessionSettings
from rlflow.measure.session_spread import SessionSpread
from rlflow.measure.shape_profiles import parse_profile
from rlflow.optimize.pipeline import load_input
from rlflow.search.candidates import Candidate, all_fusions

if __name__ == "__main__":
    path, fix, trials = sys.argv[1], sys.argv[2] == "fix", int(sys.argv[3])
    profiles = [parse_profile("batch=1;past_sequence=128"), parse_profile("batch=1;past_sequence=1024")]
    graph, _ = load_input(path, None, profiles, {"batch": 1} if fix else None)
    fused = all_fusions(Candidate(graph, (), graph.fingerprint()))
    for seed in range(trials):
        spreads = [SessionSpread(), SessionSpread()]
        spread = compare_profiled([graph, fused.graph], SessionSettings(), rounds=9, seed=seed, spreads=spreads)
        plain = compare_profiled([graph, fused.graph], SessionSettings(), rounds=9, seed=seed)
        print(f"seed {seed}: session spread {spread.ratios[1]} (past 128 {spread.comparisons[0].ratios[1]}, past 1024 "
              f"{spread.comparisons[1].ratios[1]}; a session's sigma {spreads[0].sigma:.3f}, {spreads[1].sigma:.3f}) | "
              f"bootstrap {plain.ratios[1]}", flush=True)
