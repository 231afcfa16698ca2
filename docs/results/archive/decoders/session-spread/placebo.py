"""How often greedy's screening calls a model faster or slower than itself, with the baseline in several sessions
(`rlflow.measure.session_spread`): each trial is a search's first three batches on one fresh `SessionSpread`, each
batch the baseline against three candidates that are the baseline itself, 9 rounds in one block as greedy screens.
A calibrated 95% interval is wrong in 5% of calls (2.5% each way); a batch of three has a wrong call in up to 14%.

    python docs/results/archive/decoders/session-spread/placebo.py [TRIALS]

Runs at 737ddd3 (the base in 4 sessions in the first batch; placebo.txt) or 06cbfd6 (6), where
`rlflow.measure.session_spread` exists: `git worktree add /tmp/spread 06cbfd6`, then `PYTHONPATH=/tmp/spread`.
"""
import sys

from rlflow.graph.core import load
from rlflow.measure.profile_comparison import export_at
from rlflow.measure.session import SessionSettings
from rlflow.measure.session_spread import FIRST_SESSIONS, LATER_SESSIONS, SessionSpread
from rlflow.measure.shape_profiles import parse_profile
from rlflow.measure.timing import compare
from rlflow.optimize.pipeline import load_input

MODELS = {"models/smollm2-135m-decode-p128-ts.onnx": "batch=1;past_sequence=128;total_sequence=129",
          "models/bert-l4-h256-s16-ts.onnx": None}
BATCHES, CANDIDATES = 3, 3

if __name__ == "__main__":
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    for path, profile in MODELS.items():
        if profile:
            graph, _ = load_input(path, None, [parse_profile(profile)], None)
            model = export_at(graph, graph.profiles[0] if graph.profiles else None)
        else:
            model = load(path).to_model(static=True)
        faster, slower, batches_wrong, sigmas, halves = [0] * BATCHES, [0] * BATCHES, [0] * BATCHES, [], []
        for trial in range(trials):
            spread = SessionSpread()
            for batch in range(BATCHES):
                ratios = compare([model] * (1 + CANDIDATES), SessionSettings(), rounds=9, seed=trial * 10 + batch,
                                 spread=spread).ratios[1:]
                faster[batch] += sum(r.faster for r in ratios)
                slower[batch] += sum(r.slower for r in ratios)
                batches_wrong[batch] += any(r.faster or r.slower for r in ratios)
            sigmas.append(spread.sigma)
            halves.append(ratios[0].high / ratios[0].median)
        for batch in range(BATCHES):
            print(f"{path}: batch {batch + 1} ({FIRST_SESSIONS if batch == 0 else LATER_SESSIONS} baseline sessions), {trials} trials of "
                  f"{CANDIDATES} calls: 'faster' {faster[batch]}, 'slower' {slower[batch]} of {trials * CANDIDATES}; "
                  f"batches with a wrong call {batches_wrong[batch]} of {trials}", flush=True)
        sigmas.sort()
        halves.sort()
        print(f"{path}: a session's sigma after {BATCHES} batches {sigmas[0]:.4f} to {sigmas[-1]:.4f} (median "
              f"{sigmas[len(sigmas) // 2]:.4f}); the third batch's interval +{100 * (halves[len(halves) // 2] - 1):.1f}% "
              "(median half-width)", flush=True)
