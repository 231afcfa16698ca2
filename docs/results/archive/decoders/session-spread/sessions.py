"""How far sessions of one decode step differ, and why: six sessions of the same model in one interleaved comparison
(9 rounds), the spread of their median times (the standard deviation of their logs), per trial; with onnxruntime's
default session, with pre-packing off (`SessionSettings.share_weights`: every session reads the one mapped copy of
the weights instead of its own packed copy) and with the CPU memory arena off.

    python docs/results/archive/decoders/session-spread/sessions.py [TRIALS [VARIANT ...]]
    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python docs/results/archive/decoders/session-spread/sessions.py 3 default

(the second: glibc's large allocations advised to transparent huge pages, which this machine gives only on request)
"""
import sys

import numpy as np

from rlflow.measure import session
from rlflow.measure.profile_comparison import export_at
from rlflow.measure.session import SessionSettings
from rlflow.measure.shape_profiles import parse_profile
from rlflow.measure.timing import compare
from rlflow.optimize.pipeline import load_input

MODELS = {"models/smollm2-135m-decode-p128-dynamo.onnx": "batch=1;past_sequence=128",
          "models/smollm2-135m-decode-p128-ts.onnx": "batch=1;past_sequence=128;total_sequence=129"}
SESSIONS = 6
VARIANTS = {"default": SessionSettings(), "pre-packing-off": SessionSettings(share_weights=True),
            "arena-off": SessionSettings()}
_options = session.session_options


def _arena_off(settings, profile_prefix=None):
    options = _options(settings, profile_prefix)
    options.enable_cpu_mem_arena = False
    return options


if __name__ == "__main__":
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    variants = sys.argv[2:] or list(VARIANTS)
    for path, profile in MODELS.items():
        graph, _ = load_input(path, None, [parse_profile(profile)], None)
        model = export_at(graph, graph.profiles[0] if graph.profiles else None)
        for name in variants:
            session.session_options = _arena_off if name == "arena-off" else _options
            spreads, medians = [], []
            for seed in range(trials):
                timings = compare([model] * SESSIONS, VARIANTS[name], rounds=9, seed=seed).timings
                logs = np.log([t.median_ms for t in timings])
                spreads.append(float(np.std(logs, ddof=1)))
                medians.append(float(np.exp(logs.mean())))
            print(f"{path} at {profile}, {name}: {SESSIONS} sessions, {trials} trials: session spread "
                  f"{', '.join(f'{100 * s:.1f}%' for s in spreads)}; median run {min(medians):.1f}-{max(medians):.1f} ms",
                  flush=True)
