"""On the CPU, is every fusion at once (greedy's first candidate, the agent's fuse-everything graph) faster with its
skip-LayerNormalizations unfused again?  Per model: the input, the fuse-everything graph (`all_fusions`) and the same
with `skip-layernorm-unfuse` applied everywhere, measured interleaved (24 rounds, 1 thread), and the operators
onnxruntime leaves in each after its own optimisation (ORT_ENABLE_ALL).  Writes skip-layernorm.md beside it.

    python benchmarks/agent-wide/prior/skip_layernorm.py models/<name>.onnx ...
"""
import collections
import sys
import tempfile
from pathlib import Path

import onnx
import onnxruntime as ort

import rlflow
from rlflow.measure.session import SessionSettings
from rlflow.measure.timing import compare
from rlflow.rewrites import apply_everywhere, rule
from rlflow.search.candidates import Candidate, all_fusions


def optimised_ops(graph, folder: Path) -> collections.Counter:
    """The operators onnxruntime runs for `graph` on the CPU after ORT_ENABLE_ALL."""
    source, target = folder / "model.onnx", folder / "optimised.onnx"
    onnx.save(graph.to_model(static=True), source)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath, options.intra_op_num_threads = str(target), 1
    options.log_severity_level = 3
    ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
    return collections.Counter(n.op_type for n in onnx.load(target).graph.node)


lines = ["| model | every fusion | every fusion, skip-LayerNorm unfused | onnxruntime then runs (skip-LayerNorm / "
         "LayerNorm + Add) |", "| --- | --- | --- | --- |"]
for path in sys.argv[1:]:
    graph = rlflow.load(path)
    fused = all_fusions(Candidate(graph, (), graph.fingerprint())).graph
    unfuse = rule("skip-layernorm-unfuse")
    unfused, _ = apply_everywhere(fused, unfuse, unfuse.find(fused))
    ratios = compare([g.to_model(static=True) for g in (graph, fused, unfused)], SessionSettings(threads=1),
                     rounds=24, labels=["input", "fused", "unfused"]).ratios
    with tempfile.TemporaryDirectory() as folder:
        ops = [optimised_ops(g, Path(folder)) for g in (fused, unfused)]
    kept = "; ".join(f"{c['SkipLayerNormalization']} / {c['LayerNormalization']} + {c['Add']}" for c in ops)
    lines.append(f"| {Path(path).stem} | {ratios[1]} | {ratios[2]} | {kept} |")
    print(lines[-1], flush=True)
(Path(__file__).resolve().parents[3] / "docs" / "results" / "agent-wide" / "prior" / "skip-layernorm.md").write_text(
    "# Every fusion, with and without its skip-LayerNormalizations (CPU, 1 thread)\n\nWritten by `python "
    "benchmarks/agent-wide/prior/skip_layernorm.py " + " ".join(sys.argv[1:]) + "`; speedups over the input, "
    "median [95% interval] of 24 interleaved rounds.\n\n" + "\n".join(lines) + "\n")
