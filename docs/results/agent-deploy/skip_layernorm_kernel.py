"""onnxruntime's CPU SkipLayerNormalization against Add (+ bias Add) + LayerNormalization, one op each, 1 thread.

Why skip-layernorm-fusion costs DeiT-tiny 16-18% (docs/results/agent-deploy/README.md). Without a bias Add,
onnxruntime's own optimizer fuses the unfused pair into SkipLayerNormalization too, so both columns time that kernel.

    python docs/results/agent-deploy/skip_layernorm_kernel.py
"""
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper as h, TensorProto as T
def model(fused, S, H, bias):
    x = h.make_tensor_value_info("x", T.FLOAT, [1, S, H]); s = h.make_tensor_value_info("s", T.FLOAT, [1, S, H])
    y = h.make_tensor_value_info("y", T.FLOAT, [1, S, H])
    inits = [onnx.numpy_helper.from_array(np.ones(H, np.float32), "g"), onnx.numpy_helper.from_array(np.zeros(H, np.float32), "b"),
             onnx.numpy_helper.from_array(np.full(H, 0.1, np.float32), "bias")]
    if fused:
        ins = ["x", "s", "g", "b"] + (["bias"] if bias else [])
        nodes = [h.make_node("SkipLayerNormalization", ins, ["y"], domain="com.microsoft", epsilon=1e-12)]
    else:
        nodes = [h.make_node("Add", ["x", "s"], ["t0"])]
        last = "t0"
        if bias:
            nodes.append(h.make_node("Add", ["t0", "bias"], ["t1"])); last = "t1"
        nodes.append(h.make_node("LayerNormalization", [last, "g", "b"], ["y"], axis=-1, epsilon=1e-12))
    g = h.make_graph(nodes, "g", [x, s], [y], inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)]); m.ir_version = 9
    return m
so = ort.SessionOptions()
so.intra_op_num_threads = 1
print("onnxruntime", ort.__version__)
for S, H in ((197, 192), (16, 128)):
    for bias in (False, True):
        res = {}
        for fused in (False, True):
            sess = ort.InferenceSession(model(fused, S, H, bias).SerializeToString(), so, providers=["CPUExecutionProvider"])
            feed = {"x": np.random.rand(1, S, H).astype(np.float32), "s": np.random.rand(1, S, H).astype(np.float32)}
            for _ in range(200): sess.run(None, feed)
            t = []
            for _ in range(7):
                t0 = time.perf_counter()
                for _ in range(500): sess.run(None, feed)
                t.append((time.perf_counter() - t0) / 500 * 1e6)
            res[fused] = np.median(t)
        print(f"S={S} H={H} bias={bias}: Add+LN {res[False]:.1f} us, SkipLN {res[True]:.1f} us")
