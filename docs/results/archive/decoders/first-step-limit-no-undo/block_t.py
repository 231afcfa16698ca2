"""Placebo trials (placebo.py) scored two ways from the same rounds: the interval `compare` gives (a percentile bootstrap
of the median ratio over blocks, then rounds) and one from the blocks' own log-ratios (their mean, with a t quantile
on the number of blocks less one).  A calibrated 95% interval excludes 1 in 5% of trials.  With `gain`, the
candidate is the step with every fusion applied (a true gain at past 128), and what is counted is how often each
interval calls it faster.

    python docs/results/archive/decoders/first-step-limit-no-undo/block_t.py [TRIALS] [gain]
"""
import math
import sys

import numpy as np

from rlflow.measure.bootstrap import bootstrap_ratio
from rlflow.measure.inputs import random_inputs
from rlflow.measure.profile_comparison import export_at
from rlflow.measure.session import SessionSettings
from rlflow.measure.shape_profiles import parse_profile
from rlflow.measure.timing import MIN_ROUND_SECONDS, WARMUP_RUNS, Runner
from rlflow.optimize.pipeline import load_input
from rlflow.search.candidates import Candidate, all_fusions

STEP, PROFILE = "models/smollm2-135m-decode-p128-ts.onnx", "batch=1;past_sequence=128;total_sequence=129"
T975 = {2: 4.303, 4: 2.776}  # two-sided 95% t quantiles by degrees of freedom (3 and 5 blocks)


def trial(models, feeds, blocks: int, rounds: int, rng) -> tuple[bool, bool]:
    """One comparison of models[1] with models[0]: (bootstrap interval excludes 1, block-t interval excludes 1), each
    counted only in the direction of a gain when the models differ."""
    times, groups, runs = [[], []], [], None
    for block in range(blocks):
        runners = [None, None]
        for i in rng.permutation(2):
            runners[i] = Runner(models[i], SessionSettings(), feeds)
        for runner in runners:
            for _ in range(WARMUP_RUNS):
                runner.run()
        runs = runs or max(1, math.ceil(MIN_ROUND_SECONDS / max(r.time(1) for r in runners)))
        for _ in range(rounds):
            for i in rng.permutation(2):
                times[i].append(runners[i].time(runs))
            groups.append(block)
    base, other, groups = np.asarray(times[0]), np.asarray(times[1]), np.asarray(groups)
    boot = bootstrap_ratio(base, other, rng=rng, groups=groups)
    logs = np.array([np.log(np.median(base[groups == b] / other[groups == b])) for b in range(blocks)])
    half = T975[blocks - 1] * logs.std(ddof=1) / math.sqrt(blocks)
    if models[0] is models[1]:
        return not boot.low <= 1.0 <= boot.high, abs(logs.mean()) > half
    return boot.low > 1.0, logs.mean() > half


if __name__ == "__main__":
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    gain = "gain" in sys.argv[2:]
    graph, _ = load_input(STEP, None, [parse_profile(PROFILE)], None)
    profile = graph.profiles[0] if graph.profiles else None
    model = export_at(graph, profile)
    fused = all_fusions(Candidate(graph, (), graph.fingerprint())) if gain else None
    models = (model, export_at(fused.graph, profile)) if gain else (model, model)
    feeds = random_inputs(model, 0)
    for blocks, rounds in ((3, 6), (5, 6)):
        rng = np.random.default_rng(blocks)
        calls = [trial(models, feeds, blocks, rounds, rng) for _ in range(trials)]
        what = "every fusion called faster" if gain else "wrong calls"
        print(f"{STEP} at {PROFILE}, {blocks} blocks of {rounds} rounds, {trials} trials: {what}, bootstrap "
              f"{sum(c[0] for c in calls)}, block-t {sum(c[1] for c in calls)}", flush=True)
