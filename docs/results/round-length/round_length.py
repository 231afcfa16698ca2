"""How a screening comparison resolves a gain on a small model (the measurement greedy search takes its steps on: 9
rounds, one pair of sessions), by the runs a round starts with untimed (`rlflow.measure.timing.SWITCH_RUNS`) and by
the round's length (`MIN_ROUND_SECONDS`).  For each model, the input against its every-fusion graph (`all_fusions`),
`compare(rounds=9)`, six seeds per setting, settings interleaved seed by seed; writes table.md beside this file.

    python docs/results/round-length/round_length.py      # models in models/ (rlflow zoo build ... --out models)
"""
import statistics
import time
from pathlib import Path

import rlflow.measure.timing as timing
from rlflow.graph.core import load
from rlflow.measure.session import SessionSettings
from rlflow.rewrites import RULES
from rlflow.search.candidates import Candidate, all_fusions

MODELS = ("bert-l2-h128-s16-dynamo", "bert-l4-h256-s16-ts", "bert-l4-h256-s16-dynamo", "minilm-l12-h384-s16-dynamo")
SETTINGS = ((0.01, 0), (0.01, 1), (0.01, 2), (0.01, 3), (0.05, 0))  # (round seconds, untimed runs at most)
SEEDS = range(6)

here = Path(__file__).resolve().parent
lines = ["| model | input ms | round | untimed runs a round (at most a quarter of the timed) | interval width, median "
         "[range] | median ratio [range] | measurably faster | seconds a comparison |",
         "| --- | ---: | ---: | ---: | --- | --- | ---: | ---: |"]
settings = SessionSettings()
default = (timing.MIN_ROUND_SECONDS, timing.SWITCH_RUNS)
for name in MODELS:
    graph = load(f"models/{name}.onnx")
    fused = all_fusions(Candidate(graph, (), graph.fingerprint()), RULES).graph
    models = [graph.to_model(), fused.to_model()]
    got = {s: {"width": [], "median": [], "faster": 0, "seconds": [], "ms": [], "warm": 0} for s in SETTINGS}
    for seed in SEEDS:
        for setting in SETTINGS:
            timing.MIN_ROUND_SECONDS, timing.SWITCH_RUNS = setting
            start = time.monotonic()
            comparison = timing.compare(models, settings, rounds=9, seed=seed)
            entry, ratio = got[setting], comparison.ratios[1]
            entry["seconds"].append(time.monotonic() - start)
            entry["width"].append(ratio.high - ratio.low)
            entry["median"].append(ratio.median)
            entry["faster"] += ratio.low > 1
            entry["ms"].append(comparison.timings[0].median_ms)
            entry["warm"] = comparison.extra["untimed_runs_per_round"]
    for (length, switch), e in got.items():
        mark = " (default)" if (length, switch) == default else ""
        lines.append(f"| {name} | {statistics.median(e['ms']):.2f} | {length * 1000:.0f} ms | {e['warm']}{mark} | "
                     f"{statistics.median(e['width']):.3f} [{min(e['width']):.3f}, {max(e['width']):.3f}] | "
                     f"{statistics.median(e['median']):.3f} [{min(e['median']):.3f}, {max(e['median']):.3f}] | "
                     f"{e['faster']} of {len(SEEDS)} | {statistics.median(e['seconds']):.2f} |")
        print(lines[-1], flush=True)
timing.MIN_ROUND_SECONDS, timing.SWITCH_RUNS = default
(here / "table.md").write_text("\n".join(lines) + "\n")
