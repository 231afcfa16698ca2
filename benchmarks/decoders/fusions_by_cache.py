"""Where a decode step's fusions pay, by cache length: fusions-by-cache.json.

On each decode step (fixed at batch 1, as `--fix-dim batch=1` does), the input, every fusion applied wherever it
matches (`rlflow.search.candidates.all_fusions`) and every fusion but the attention ones, compared interleaved at past
128 and 1024 (`compare_profiled`, CPU, 1 thread, ROUNDS rounds): which fusion costs at which cache length, where a
search's 9-round screening cannot tell.

    python benchmarks/decoders/fusions_by_cache.py models   # the decode steps built with rlflow zoo build
"""
import datetime
import json
import sys
from pathlib import Path

import onnxruntime

from rlflow.bench.machine import environment
from rlflow.measure.memory import shares_weights
from rlflow.measure.profile_comparison import compare_profiled
from rlflow.measure.session import SessionSettings
from rlflow.measure.shape_profiles import parse_profile
from rlflow.optimize.pipeline import load_input  # as `rlflow optimize` reads a model
from rlflow.rewrites import RULES
from rlflow.search.candidates import Candidate, all_fusions

here = Path(__file__).resolve().parents[2] / "docs" / "results" / "decoders"
ROUNDS = 30
STEPS = {"smollm2-135m-decode-p128-dynamo": ("batch=1;past_sequence=128", "batch=1;past_sequence=1024"),
         "smollm2-135m-decode-p128-ts": ("batch=1;past_sequence=128;total_sequence=129",
                                         "batch=1;past_sequence=1024;total_sequence=1025")}
VARIANTS = ("input", "all fusions", "all fusions but attention")


def main(models: Path) -> dict:
    out = {"what": f"decode steps fixed at batch 1, CPU, 1 thread, onnxruntime {onnxruntime.__version__}: speedup over "
                   f"the input at each cache length, {ROUNDS} interleaved rounds, median [95% interval]; "
                   f"{datetime.date.today().isoformat()}",
           "environment": environment(SessionSettings(threads=1)), "models": {}}
    for step, profiles in STEPS.items():
        graph, _ = load_input(models / f"{step}.onnx", None, [parse_profile(p) for p in profiles], {"batch": 1})
        start = Candidate(graph, (), graph.fingerprint())
        fused = all_fusions(start)
        without_attention = all_fusions(start, [r for r in RULES if "attention" not in r.name])
        graphs = [graph, fused.graph, without_attention.graph]
        settings = SessionSettings(threads=1, share_weights=shares_weights(graph))
        measured = compare_profiled(graphs, settings, rounds=ROUNDS, seed=0, labels=list(VARIANTS))
        out["models"][step] = {
            "nodes": dict(zip(VARIANTS, map(len, graphs))),
            "input_ms": {p.label: c.timings[0].median_ms for p, c in zip(measured.profiles, measured.comparisons)},
            "speedup": {p.label: {v: str(r) for v, r in zip(VARIANTS[1:], c.ratios[1:])}
                        for p, c in zip(measured.profiles, measured.comparisons)}}
        print(step, json.dumps(out["models"][step], indent=1), flush=True)
    (here / "fusions-by-cache.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main(Path(sys.argv[1]))
