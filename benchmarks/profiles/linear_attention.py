"""Linear attention, y = q . (k^T . v), with q, k and v [n, 64] and n dynamic: which association of the product
needs fewer FLOPs depends on n (2 n d^2 as written, 2 n^2 d the other way), so matmul-assoc, which decides by the
FLOPs at the graph's static shapes, rewrites it at n < 64 into a graph slower at n > 64."""
import sys

import onnx
from onnx import TensorProto, helper

D = 64


def spec(name):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["n", D])



nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[1, 0], name="kt"),
         helper.make_node("MatMul", ["kt", "v"], ["kv"], name="kv"),
         helper.make_node("MatMul", ["q", "kv"], ["y"], name="qkv")]
g = helper.make_graph(nodes, "linear_attention", [spec("q"), spec("k"), spec("v")], [spec("y")])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
onnx.checker.check_model(m)
onnx.save(m, sys.argv[1])
