"""How often a search step's measurement calls a model faster than itself: the same model as base and candidate, in
two sessions, 9 rounds in one block as greedy screens (`GreedyConfig.rounds`), at one profile; and the same at 18
rounds in three blocks and 30 in five, as the gate measures (5 blocks of 6 rounds where its budget allows).  A
calibrated 95% interval lies wholly above 1 in 2.5% of trials.

    python docs/results/archive/decoders/first-step-limit-no-undo/placebo.py [TRIALS]
"""
import sys

from rlflow.graph.core import load
from rlflow.measure.profile_comparison import export_at
from rlflow.measure.session import SessionSettings
from rlflow.measure.shape_profiles import parse_profile
from rlflow.measure.timing import compare
from rlflow.optimize.pipeline import load_input

MODELS = {"models/smollm2-135m-decode-p128-ts.onnx": "batch=1;past_sequence=128;total_sequence=129",
          "models/bert-l4-h256-s16-ts.onnx": None}

if __name__ == "__main__":
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    for path, profile in MODELS.items():
        if profile:
            graph, _ = load_input(path, None, [parse_profile(profile)], None)
            model = export_at(graph, graph.profiles[0] if graph.profiles else None)
        else:
            model = load(path).to_model(static=True)
        for rounds, blocks in ((9, 1), (18, 3), (30, 5)):
            ratios = [compare([model, model], SessionSettings(), rounds=rounds, blocks=blocks, seed=seed).ratios[1]
                      for seed in range(trials)]
            faster, slower = sum(r.faster for r in ratios), sum(r.slower for r in ratios)
            spread = sorted(r.median for r in ratios)
            print(f"{path}: {rounds} rounds in {blocks} block(s), {trials} trials: 'faster' {faster}, 'slower' "
                  f"{slower}; medians {spread[0]:.3f} to {spread[-1]:.3f}", flush=True)
