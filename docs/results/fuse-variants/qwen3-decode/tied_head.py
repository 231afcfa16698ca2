"""Which fusion makes every fusion slower on Qwen3's decode step (CPU, 1 thread)?  The input, every fusion, every
fusion but matmul-transpose-fusion, and matmul-transpose-fusion alone (the tied language-model head), measured in one
interleaved comparison at the step's own shapes (past 128), written to tied-head.md beside this file.

Ran at ff79dd8, before the rule learnt to leave a transposed constant alone; since then the rule refuses the tied
head, so the last two graphs are every fusion and the input again.

    python docs/results/fuse-variants/qwen3-decode/tied_head.py [MODEL.onnx] [--rounds 12]
"""
import argparse
import collections
from pathlib import Path

import rlflow
from rlflow.measure.memory import shares_weights
from rlflow.measure.session import SessionSettings
from rlflow.measure.timing import compare
from rlflow.rewrites import RULES
from rlflow.search.candidates import Candidate, all_fusions, apply_everywhere, find_matches

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("model", nargs="?", default="models/qwen3-0.6b-l8-decode-p128-dynamo.onnx")
parser.add_argument("--rounds", type=int, default=12)
args = parser.parse_args()
graph = rlflow.load(args.model)
start = Candidate(graph, (), graph.fingerprint())
every = all_fusions(start, RULES)
without = all_fusions(start, [r for r in RULES if r.name != "matmul-transpose-fusion"])
head = next(r for r in RULES if r.name == "matmul-transpose-fusion")
alone, applied = apply_everywhere(graph, head, find_matches(graph, [head]), RULES)
settings = SessionSettings(threads=1, share_weights=shares_weights(graph))
ratios = compare([g.to_model(static=True) for g in (graph, every.graph, without.graph, alone)], settings,
                 rounds=args.rounds, seed=0).ratios[1:]
names = ["every fusion", "every fusion but matmul-transpose-fusion", f"matmul-transpose-fusion alone ({len(applied)})"]
lines = ["# Qwen3's decode step: every fusion, and the tied head's FusedMatMul (CPU, 1 thread)", "",
         f"Written by `python docs/results/fuse-variants/qwen3-decode/tied_head.py {args.model}` ({args.rounds} "
         f"interleaved rounds, {settings.as_dict()}). Speedup over the input, median [95% interval].", "",
         "| graph | fusions | measured |", "| --- | --- | --- |"]
for name, candidate, ratio in zip(names, (every, without, None), ratios):
    fusions = ", ".join(f"{k} x{v}" for k, v in collections.Counter(m.rule for m in candidate.applied).items()) \
        if candidate else "the tied head"
    lines.append(f"| {name} | {fusions} | {ratio} |")
out = Path(__file__).with_name("tied-head.md")
out.write_text("\n".join(lines) + "\n")
print("\n".join(lines))
