"""onnxruntime's CPU SkipLayerNormalization against Add (+ bias Add) + LayerNormalization, one op each, 1 thread,
measured interleaved (`rlflow.measure.timing.compare`).

Why skip-layernorm-fusion costs DeiT-tiny 16-18% (docs/results/archive/agent-deploy/README.md, fifth part). Without a
bias Add, onnxruntime's own optimizer fuses the unfused pair into SkipLayerNormalization too, so both columns time
that kernel.

    python benchmarks/agent-deploy/skip_layernorm_kernel.py
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
from onnx import TensorProto, helper, numpy_helper

from rlflow.measure.session import SessionSettings
from rlflow.measure.timing import compare


def model(fused: bool, seq: int, hidden: int, bias: bool) -> onnx.ModelProto:
    """x + skip (+ bias), layer-normalised: one SkipLayerNormalization, or Add (, Add) and LayerNormalization."""
    shape = [1, seq, hidden]
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name in ("x", "skip")]
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)
    weights = [numpy_helper.from_array(np.ones(hidden, np.float32), "gamma"),
               numpy_helper.from_array(np.zeros(hidden, np.float32), "beta")]
    if bias:
        weights.append(numpy_helper.from_array(np.full(hidden, 0.1, np.float32), "bias"))
    if fused:
        nodes = [helper.make_node("SkipLayerNormalization", ["x", "skip", "gamma", "beta"] + (["bias"] if bias else []),
                                  ["y"], domain="com.microsoft", epsilon=1e-12)]
    else:
        nodes = [helper.make_node("Add", ["x", "skip"], ["sum"])]
        if bias:
            nodes.append(helper.make_node("Add", ["sum", "bias"], ["biased"]))
        nodes.append(helper.make_node("LayerNormalization", [nodes[-1].output[0], "gamma", "beta"], ["y"], axis=-1,
                                      epsilon=1e-12))
    graph = helper.make_graph(nodes, "skip_layernorm", inputs, [output], weights)
    built = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    built.ir_version = 9  # onnxruntime 1.31 refuses onnx 1.23's default
    return built


def main() -> None:
    settings = SessionSettings(threads=1)
    print(f"onnxruntime {onnxruntime.__version__}; {settings}")
    for seq, hidden in ((197, 192), (16, 128)):
        for bias in (False, True):
            result = compare([model(False, seq, hidden, bias), model(True, seq, hidden, bias)], settings, rounds=20,
                             seed=0, labels=["Add+LN", "SkipLN"])
            unfused, fused = (t.median_ms * 1000 for t in result.timings)
            print(f"S={seq} H={hidden} bias={bias}: Add+LN {unfused:.1f} us, SkipLN {fused:.1f} us, "
                  f"SkipLN speedup {result.ratios[1]}")


if __name__ == "__main__":
    main()
