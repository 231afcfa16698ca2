"""How a screening comparison resolves a gain on a small model (the measurement greedy search takes its steps on: 9
rounds, one pair of sessions), by the runs a round starts with untimed (`rlflow.measure.timing.SWITCH_RUNS`), by the
round's length (`MIN_ROUND_SECONDS`) and by the runs that set that length (`RUN_PROBES`).  For each model, the input
against its every-fusion graph (`all_fusions`), `compare(rounds=9)`, several seeds per setting, settings interleaved
seed by seed; writes a table beside this file.

    python benchmarks/round-length/round_length.py switch   # table.md (2026-11-29): untimed runs, round length
    python benchmarks/round-length/round_length.py probes   # probes.md (2026-11-30): one run or up to five set it
"""
import statistics
import sys
import time
from pathlib import Path

import rlflow.measure.timing as timing
from rlflow.graph.core import load
from rlflow.measure.session import SessionSettings
from rlflow.rewrites import RULES
from rlflow.search.candidates import Candidate, all_fusions

MODELS = ("bert-l2-h128-s16-dynamo", "bert-l4-h256-s16-ts", "bert-l4-h256-s16-dynamo", "minilm-l12-h384-s16-dynamo")
QUESTIONS = {  # (round seconds, untimed runs at most, runs that set the round's length)
    "switch": ("table.md", ((0.01, 0, 1), (0.01, 1, 1), (0.01, 2, 1), (0.01, 3, 1), (0.05, 0, 1)), range(6)),
    "probes": ("probes.md", ((0.01, 3, 1), (0.01, 3, 5)), range(8)),
}

here = Path(__file__).resolve().parents[2] / "docs" / "results" / "round-length"
out, SETTINGS, SEEDS = QUESTIONS[sys.argv[1] if len(sys.argv) > 1 else "switch"]
lines = ["| model | input ms | round | untimed runs a round (at most a quarter of the timed) | runs setting its length | "
         "interval width, median [range] | median ratio [range] | measurably faster | seconds a comparison |",
         "| --- | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: |"]
settings = SessionSettings()
default = (timing.MIN_ROUND_SECONDS, timing.SWITCH_RUNS, timing.RUN_PROBES)
for name in MODELS:
    graph = load(f"models/{name}.onnx")
    fused = all_fusions(Candidate(graph, (), graph.fingerprint()), RULES).graph
    models = [graph.to_model(), fused.to_model()]
    got = {s: {"width": [], "median": [], "faster": 0, "seconds": [], "ms": [], "warm": []} for s in SETTINGS}
    for seed in SEEDS:
        for setting in SETTINGS:
            timing.MIN_ROUND_SECONDS, timing.SWITCH_RUNS, timing.RUN_PROBES = setting
            start = time.monotonic()
            comparison = timing.compare(models, settings, rounds=9, seed=seed)
            entry, ratio = got[setting], comparison.ratios[1]
            entry["seconds"].append(time.monotonic() - start)
            entry["width"].append(ratio.high - ratio.low)
            entry["median"].append(ratio.median)
            entry["faster"] += ratio.low > 1
            entry["ms"].append(comparison.timings[0].median_ms)
            entry["warm"].append(comparison.extra["untimed_runs_per_round"])
    for (length, switch, probes), e in got.items():
        mark = " (default)" if (length, switch, probes) == default else ""
        warm = f"{min(e['warm'])}-{max(e['warm'])}" if min(e["warm"]) != max(e["warm"]) else f"{e['warm'][0]}"
        lines.append(f"| {name} | {statistics.median(e['ms']):.2f} | {length * 1000:.0f} ms | {warm} | {probes}{mark} | "
                     f"{statistics.median(e['width']):.3f} [{min(e['width']):.3f}, {max(e['width']):.3f}] | "
                     f"{statistics.median(e['median']):.3f} [{min(e['median']):.3f}, {max(e['median']):.3f}] | "
                     f"{e['faster']} of {len(SEEDS)} | {statistics.median(e['seconds']):.2f} |")
        print(lines[-1], flush=True)
timing.MIN_ROUND_SECONDS, timing.SWITCH_RUNS, timing.RUN_PROBES = default
(here / out).write_text("\n".join(lines) + "\n")
