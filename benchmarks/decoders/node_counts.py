"""Issue #79's structure target as node-counts.json: on each static decode step (batch 1, past 128), the nodes after
onnxruntime's ORT_ENABLE_ALL on the CPU provider of the export, of the export with every fusion applied and sibling
projections packed (`rlflow.bench.builder_reference.fused_and_packed`), the same with the attention mask declared
all ones (`--fix-value attention_mask=1`: the mask then leaves GroupQueryAttention), the same under the padding
contract (`--padding attention_mask=right`, docs/padding.md: the builder's own form, the attentions reading the rows'
lengths) with chains of Reshapes cleaned (`CLEANUP`), and of onnxruntime-genai's builder's graph of the same weights (as builder-reference/ recorded it: one
builder graph per decoder, whichever exporter).  Target (issue #79): the padding contract's graph at most the
builder's node count.

    rlflow zoo build smollm2-135m-decode-p128-dynamo ... --out models   # the four steps
    python benchmarks/decoders/node_counts.py models
"""
import datetime
import json
import sys
from pathlib import Path

import onnxruntime

from rlflow.bench.builder_reference import fused_and_packed, optimized_ops
from rlflow.graph.core import Graph, load
from rlflow.graph.input_values import fix_values
from rlflow.optimize.padding import contract_rewrite
from rlflow.rewrites import RULES, apply_everywhere, rule

here = Path(__file__).resolve().parents[2] / "docs" / "results" / "decoders"
STEPS = {"smollm2-135m-decode-p128-dynamo": "smollm2-135m-decode-p128-dynamo",
         "qwen3-0.6b-l8-decode-p128-dynamo": "qwen3-0.6b-l8-decode-p128-dynamo",
         "smollm2-135m-decode-p128-ts": "smollm2-135m-decode-p128-dynamo",
         "qwen3-0.6b-l8-decode-p128-ts": "qwen3-0.6b-l8-decode-p128-dynamo"}  # step -> its builder record
TARGET = 1.0


CLEANUP = ("shape-dim-fold", "constant-fold", "reshape-chain", "reshape-noop-elim", "concat-single-elim")
"""Layout and fold rules any search has, applied after the contract: the value's Reshape to heads and back that the
packed projections leave before the attention (Qwen3's query and key keep theirs, around their norms, as the
builder's do), whose target the TorchScript export computes from shapes (folded first), and the one-input Concat
that exporter writes before the first layer's cache."""


def under_contract(model):
    """`model` (the fused and packed step) as `--padding attention_mask=right` leaves it, Reshape chains cleaned."""
    graph, _, _ = contract_rewrite(Graph.from_model(model), "attention_mask")
    for step in map(rule, CLEANUP):
        graph, _ = apply_everywhere(graph, step, step.find(graph))
    return graph.to_model(static=True)


def builder_ops(record: str) -> dict:
    row = json.loads((here / "builder-reference" / f"{record}.json").read_text())["rows"][0]
    return row["peer_settings"]["ops_after_ort_all"]["genai-builder"]


def main(models: Path) -> dict:
    out = {"what": f"static decode steps (batch 1, past 128): nodes after onnxruntime {onnxruntime.__version__}'s "
                   f"ORT_ENABLE_ALL on the CPU provider; 'all-fusions' is every fusion rule applied wherever it "
                   f"matches, then sibling projections packed (rules 0-{len(RULES) - 1}); the builder's from "
                   f"builder-reference/; {datetime.date.today().isoformat()}",
           "target": f"all-fusions under the padding contract at most {TARGET}x the builder's nodes", "models": {}}
    for step, record in STEPS.items():
        source = load(models / f"{step}.onnx").to_model(static=True)
        unpadded = load(models / f"{step}.onnx").to_model(static=True)
        fix_values(unpadded, {"attention_mask": 1})
        fused = fused_and_packed(source)
        ops = {"export": optimized_ops(source), "all-fusions": optimized_ops(fused),
               "all-fusions, unpadded": optimized_ops(fused_and_packed(unpadded)),
               "all-fusions, padding contract": optimized_ops(under_contract(fused)),
               "genai-builder": builder_ops(record)}
        nodes = {k: sum(v.values()) for k, v in ops.items()}
        ratio = nodes["all-fusions, padding contract"] / nodes["genai-builder"]
        out["models"][step] = {"nodes": nodes, "ratio": round(ratio, 3), "holds": ratio <= TARGET, "ops": ops}
        print(f"{step}: export {nodes['export']}, all fusions {nodes['all-fusions']} (unpadded "
              f"{nodes['all-fusions, unpadded']}, padding contract {nodes['all-fusions, padding contract']}), builder "
              f"{nodes['genai-builder']}: {ratio:.3f} ({'holds' if ratio <= TARGET else 'misses'})", flush=True)
    (here / "node-counts.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "models"))
