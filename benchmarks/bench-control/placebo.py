"""How often the bench's comparison calls a model faster or slower than itself: each trial is one `compare` of the
input against two copies of itself, as `rlflow bench` measures a model's outputs (12 rounds, fresh sessions), at the
session blocks given.  A calibrated 95% interval is wrong in 5% of calls, 2.5% each way.

    python benchmarks/bench-control/placebo.py [TRIALS]          # placebo.txt: each trial its own seed
    python benchmarks/bench-control/placebo.py TRIALS SEED       # fixed-seed.txt: every trial the same seed

With one seed every trial has the same session order and round order, as every model of one bench run had before
the bench seeded each model's measurement apart: does a copy's place in that order decide its ratio?  Settings are
interleaved trial by trial, so that a slow spell of the machine falls on all of them.
"""
import sys
import time

import numpy as np

from rlflow.graph.core import load
from rlflow.measure.session import SessionSettings
from rlflow.measure.timing import compare

MODELS = ["models/bert-l4-h256-s16-ts.onnx", "models/minilm-l12-h384-s16-dynamo.onnx",
          "models/distilbert-base-s128-ts.onnx"]
SETTINGS = [(12, 2), (12, 4), (24, 4)]  # (rounds, session blocks); (12, 2) is what `rlflow bench --rounds 12` runs
COPIES = 2


def trial_ratios(model, rounds: int, blocks: int, seed: int):
    return compare([model] * (1 + COPIES), SessionSettings(threads=1), rounds=rounds, blocks=blocks,
                   seed=seed).ratios[1:]


if __name__ == "__main__":
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    fixed = int(sys.argv[2]) if len(sys.argv) > 2 else None
    settings = SETTINGS if fixed is None else SETTINGS[:1]
    print(f"{trials} trials per model and setting, {COPIES} copies of the input each, 1 thread"
          + (f", every trial seed {fixed}" if fixed is not None else ", trial N seed N"), flush=True)
    for path in MODELS:
        model = load(path).to_model(static=True)
        calls = {s: {"faster": 0, "slower": 0, "medians": [], "widths": [], "seconds": 0.0} for s in settings}
        for trial in range(trials):
            for rounds, blocks in settings:
                start = time.monotonic()
                ratios = trial_ratios(model, rounds, blocks, trial if fixed is None else fixed)
                seen = calls[(rounds, blocks)]
                seen["seconds"] += time.monotonic() - start
                seen["faster"] += sum(r.faster for r in ratios)
                seen["slower"] += sum(r.slower for r in ratios)
                seen["medians"].append([r.median for r in ratios])
                seen["widths"] += [r.high - r.low for r in ratios]
        for (rounds, blocks), seen in calls.items():
            medians = np.asarray(seen["medians"])  # (trials, copies)
            per_copy = "; ".join(f"copy {c + 1}: median {np.median(medians[:, c]):.4f}, above 1 in "
                                 f"{int((medians[:, c] > 1).sum())} of {trials}" for c in range(COPIES))
            print(f"{path}: {rounds} rounds in {blocks} blocks: 'faster' {seen['faster']}, 'slower' {seen['slower']} "
                  f"of {medians.size} calls; median ratio {np.median(medians):.4f} [{medians.min():.3f}, "
                  f"{medians.max():.3f}], interval width median {np.median(seen['widths']):.3f}; {per_copy}; "
                  f"{seen['seconds'] / trials:.1f} s a comparison", flush=True)
