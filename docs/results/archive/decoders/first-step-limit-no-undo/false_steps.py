"""Greedy's false steps on SmolLM2's TorchScript decode step at a dynamic batch (README.md here): the input as the user
has it, the search's export of it, and the graph of greedy's four steps (each rule everywhere), compared at past 128
as the gate compares (18 rounds, 3 blocks of sessions) and as a search step does (9 rounds, one block).

    python docs/results/archive/decoders/first-step-limit-no-undo/false_steps.py
"""
from rlflow.measure.profile_comparison import export_at
from rlflow.measure.session import SessionSettings
from rlflow.measure.shape_profiles import instantiate, parse_profile
from rlflow.measure.timing import compare
from rlflow.optimize.pipeline import load_input
from rlflow.rewrites import apply_everywhere, rule

STEP = "models/smollm2-135m-decode-p128-ts.onnx"
PROFILES = ("batch=1;past_sequence=128;total_sequence=129", "batch=1;past_sequence=1024;total_sequence=1025")
STEPS = ("rotary-fusion", "cast-noop-elim", "rmsnorm-fusion", "skip-rmsnorm-fusion")

if __name__ == "__main__":
    graph, given = load_input(STEP, None, [parse_profile(p) for p in PROFILES], None)
    stepped = graph
    for name in STEPS:
        stepped, applied = apply_everywhere(stepped, rule(name), rule(name).find(stepped))
        print(f"{name}: {len(applied)} rewrites, {len(stepped)} nodes")
    profile = graph.profiles[0]
    models = [instantiate(given, profile.shapes), export_at(graph, profile), export_at(stepped, profile)]
    gate_like = compare(models, SessionSettings(), rounds=18, labels=["input", "the search's export", "four steps"])
    print("18 rounds:", ", ".join(f"{t.label} {t.median_ms:.2f} ms {r}" for t, r in zip(gate_like.timings,
                                                                                       gate_like.ratios)))
    step_like = compare(models[1:], SessionSettings(), rounds=9)
    print(f"9 rounds, one block, four steps over the search's export: {step_like.ratios[1]}")
