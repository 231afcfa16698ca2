"""From how many rows does a tied head pay as `FusedMatMul(transB)` on the CPU?  `matmul-transpose-fusion` fuses
`MatMul(X, Transpose(E))` over a constant table E only from FUSED_CONSTANT_MIN_ROWS rows of X; below, onnxruntime's
own folding of the Transpose (a second, transposed copy of the table) is left to run.  This measures both forms of
the head alone, at the decoders' real widths (SmolLM2-135M: 576 x 49152; Qwen3-0.6B: 1024 x 151936; random table),
for each row count, in one interleaved comparison per row count, and writes rows-prepacked.json (or, with
--no-prepacking, rows-no-prepacking.json: the sessions' setting for models of 1 GiB of weights or more, which share
them in place) beside this file and prints the table.  CPU, 1 thread.

    python docs/results/fuse-variants/tied-head-rows/tied_head_rows.py [--rows 1 4 8 16 32 64 128] [--rounds 12] \
        [--no-prepacking]
"""
import argparse
import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from rlflow.measure.session import SessionSettings
from rlflow.measure.timing import compare
from rlflow.rewrites.fusion_linear import FUSED_CONSTANT_MIN_ROWS

WIDTHS = {"smollm2-135m": (576, 49152), "qwen3-0.6b": (1024, 151936)}


def head(hidden: int, vocab: int, rows: int, fused: bool, table: np.ndarray) -> onnx.ModelProto:
    """The head over `rows` rows: the export's MatMul over a Transpose of the table, or the rule's FusedMatMul."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, hidden])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [rows, vocab])
    if fused:
        nodes = [helper.make_node("FusedMatMul", ["x", "table"], ["logits"], domain="com.microsoft", transB=1,
                                  transA=0, alpha=1.0)]
    else:
        nodes = [helper.make_node("Transpose", ["table"], ["table_t"], perm=[1, 0]),
                 helper.make_node("MatMul", ["x", "table_t"], ["logits"])]
    graph = helper.make_graph(nodes, "tied_head", [x], [y], [numpy_helper.from_array(table, "table")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--no-prepacking", action="store_true", help="sessions as for large models (share_weights)")
    args = parser.parse_args()
    settings = SessionSettings(threads=1, share_weights=args.no_prepacking)
    results = []
    for name, (hidden, vocab) in WIDTHS.items():
        table = np.random.default_rng(0).standard_normal((vocab, hidden), dtype=np.float32) * 0.02
        for rows in args.rows:
            ratio = compare([head(hidden, vocab, rows, fused, table) for fused in (False, True)], settings,
                            rounds=args.rounds, seed=0).ratios[1]
            results.append({"model": name, "hidden": hidden, "vocab": vocab, "rows": rows, "fused_speedup": {
                "median": ratio.median, "low": ratio.low, "high": ratio.high}})
            print(f"{name} rows {rows}: FusedMatMul(transB) {ratio}", flush=True)
    out = Path(__file__).with_name(f"rows-{'no-prepacking' if args.no_prepacking else 'prepacked'}.json")
    out.write_text(json.dumps({"settings": settings.as_dict(), "rounds": args.rounds, "results": results}, indent=1)
                   + "\n")
    lines = ["| rows | " + " | ".join(WIDTHS) + " |", "| ---: |" + " --- |" * len(WIDTHS)]
    for rows in args.rows:
        cells = [next(r["fused_speedup"] for r in results if r["model"] == m and r["rows"] == rows) for m in WIDTHS]
        lines.append(f"| {rows} | " + " | ".join(f"{c['median']:.3f} [{c['low']:.3f}, {c['high']:.3f}]"
                                                  for c in cells) + " |")
    print("\n".join(lines))
    print(f"(the rule fuses from {FUSED_CONSTANT_MIN_ROWS} rows)")


if __name__ == "__main__":
    main()
