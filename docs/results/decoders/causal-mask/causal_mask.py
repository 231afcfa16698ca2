"""What dropping the mask from GroupQueryAttention costs or gains on the CPU: causal-mask.json.

On each decode step fixed at batch 1 and declared unpadded (`--fix-dim batch=1 --fix-value attention_mask=1`), the
input, every fusion with the attention mask kept (every fusion rule but group-query-attention-causal) and every fusion
with it dropped (`rlflow.search.candidates.all_fusions`), compared interleaved at past 128 and 1024
(`compare_profiled`, CPU, 1 thread, ROUNDS rounds).  On CUDA a mask keeps the operator off its fused kernels; this
says what the CPU's kernel makes of it.

    python docs/results/decoders/causal-mask/causal_mask.py models   # the decode steps built with rlflow zoo build
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

here = Path(__file__).resolve().parent
ROUNDS = 30
DYNAMO = ("batch=1;past_sequence=128", "batch=1;past_sequence=1024")
TS = ("batch=1;past_sequence=128;total_sequence=129", "batch=1;past_sequence=1024;total_sequence=1025")
STEPS = {"smollm2-135m-decode-p128-dynamo": DYNAMO, "qwen3-0.6b-l8-decode-p128-dynamo": DYNAMO,
         "smollm2-135m-decode-p128-ts": TS, "qwen3-0.6b-l8-decode-p128-ts": TS}
VARIANTS = ("input", "all fusions, mask kept", "all fusions, mask dropped")


def main(models: Path) -> dict:
    out = {"what": f"decode steps fixed at batch 1 and attention_mask=1, CPU, 1 thread, onnxruntime "
                   f"{onnxruntime.__version__}: speedup over the input at each cache length, {ROUNDS} interleaved "
                   f"rounds, median [95% interval]; {datetime.date.today().isoformat()}",
           "environment": environment(SessionSettings(threads=1)), "models": {}}
    for step, profiles in STEPS.items():
        graph, _ = load_input(models / f"{step}.onnx", None, [parse_profile(p) for p in profiles], {"batch": 1},
                              {"attention_mask": 1})
        start = Candidate(graph, (), graph.fingerprint())
        kept = all_fusions(start, [r for r in RULES if r.name != "group-query-attention-causal"])
        dropped = all_fusions(start)
        graphs = [graph, kept.graph, dropped.graph]
        counts = [sum(len(n.inputs) > 10 for n in g.gs.nodes if n.op == "GroupQueryAttention") for g in graphs]
        settings = SessionSettings(threads=1, share_weights=shares_weights(graph))
        measured = compare_profiled(graphs, settings, rounds=ROUNDS, seed=0, labels=list(VARIANTS))
        out["models"][step] = {
            "nodes": dict(zip(VARIANTS, map(len, graphs))),
            "attentions with a mask": dict(zip(VARIANTS, counts)),
            "input_ms": {p.label: c.timings[0].median_ms for p, c in zip(measured.profiles, measured.comparisons)},
            "speedup": {p.label: {v: str(r) for v, r in zip(VARIANTS[1:], c.ratios[1:])}
                        for p, c in zip(measured.profiles, measured.comparisons)}}
        print(step, json.dumps(out["models"][step], indent=1), flush=True)
    (here / "causal-mask.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main(Path(sys.argv[1]))
