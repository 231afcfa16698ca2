"""Fold rules: constants absorbed into weights, constant subgraphs computed once."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, numpy_helper

from rlflow.measure.verify import verify

from .helpers import assert_refuses, assert_rewrites, case_tests, graph, ints, node, weights

IMAGE = {"x": [1, 3, 6, 6]}


def _bn_consts(channels):
    return {"g": weights(channels, seed=1), "be": weights(channels, seed=2), "m": weights(channels, seed=3),
            "v": np.abs(weights(channels, seed=4)) + 0.5}


def _conv_then(op, const_shape, extra=None):
    nodes = [node("Conv", ["x", "w", "b"], "c", kernel_shape=[3, 3], pads=[1, 1, 1, 1]), node(op, ["c", "k"])]
    if extra:
        nodes.append(extra)
    return graph(nodes, IMAGE, outputs=("y",) if not extra else ("y", "c"),
                 consts={"w": weights(4, 3, 3, 3), "b": weights(4), "k": weights(*const_shape, seed=5)})


def _bn_after(op, rank=2):
    x = {"x": [3, 5] if rank == 2 else [2, 3, 5]}
    consts = {"w": weights(5, 4), **_bn_consts(4)}
    if op == "Gemm":
        first = node("Gemm", ["x", "w", "c"], "h", transB=1, alpha=0.5, beta=2.0)
        consts.update(w=weights(4, 5), c=weights(4))
    else:
        first = node("MatMul", ["x", "w"], "h")
    return graph([first, node("BatchNormalization", ["h", "g", "be", "m", "v"])], x, consts=consts)


def _scaled(op, producer="MatMul", const_shape=(4,), rank=3):
    consts = {"w": weights(5, 4), "s": weights(*const_shape, seed=9) + 3}
    if producer == "Gemm":
        first, x = node("Gemm", ["x", "w", "c"], "h", alpha=2.0), {"x": [3, 5]}
        consts["c"] = weights(4)
    else:
        first, x = node("MatMul", ["x", "w"], "h"), {"x": [2, 3, 5] if rank == 3 else [3, 5]}
    return graph([first, node(op, ["h", "s"])], x, consts=consts)


CASES = {
    "conv-bn-fold": (
        lambda: graph([node("Conv", ["x", "w"], "c", kernel_shape=[3, 3]),
                       node("BatchNormalization", ["c", "g", "be", "m", "v"])], IMAGE,
                      consts={"w": weights(4, 3, 3, 3), **_bn_consts(4)}),
        lambda: graph([node("Relu", ["x"], "c"), node("BatchNormalization", ["c", "g", "be", "m", "v"])], IMAGE,
                      consts=_bn_consts(3)),
        "not produced by a Conv"),
    "conv-mul-fold": (lambda: _conv_then("Mul", (4, 1, 1)), lambda: _conv_then("Mul", (6, 1)),
                      "not one value per output channel"),
    "conv-add-fold": (lambda: _conv_then("Add", (1, 4, 1, 1)),
                      lambda: _conv_then("Add", (4, 1, 1), extra=node("Relu", ["c"], "r")),
                      "read elsewhere too"),
    "matmul-bn-fold": (lambda: _bn_after("Gemm"), lambda: _bn_after("MatMul", rank=3), "features are not 2-D"),
    "matmul-scale-fold": (lambda: _scaled("Div", const_shape=(1, 4)), lambda: _scaled("Mul", const_shape=(3, 1)),
                          "not one value per output column"),
    "gemm-bias-fold": (
        lambda: graph([node("Gemm", ["x", "w", "c"], "h", beta=0.5, transB=1), node("Add", ["d", "h"])],
                      {"x": [3, 5]}, consts={"w": weights(4, 5), "c": weights(4), "d": weights(3, 1)}),
        lambda: graph([node("Gemm", ["x", "w"], "h"), node("Add", ["d", "h"])], {"x": [1, 5]},
                      consts={"w": weights(5, 4), "d": weights(3, 4)}),
        "broadcasts the product to a larger shape"),
    "add-const-chain-fold": (
        lambda: graph([node("Add", ["c1", "x"], "t"), node("Add", ["t", "c2"])], {"x": [2, 3]},
                      consts={"c1": weights(3), "c2": weights(2, 1)}),
        lambda: graph([node("Add", ["z", "x"], "t"), node("Add", ["t", "c2"])], {"x": [2, 3], "z": [3]},
                      consts={"c2": weights(2, 1)}),
        "inner Add has no constant operand"),
    "mul-const-chain-fold": (
        lambda: graph([node("Mul", ["x", "c1"], "t"), node("Mul", ["c2", "t"])], {"x": [2, 3]},
                      consts={"c1": weights(3), "c2": weights(1)}),
        lambda: graph([node("Mul", ["x", "c1"], "t"), node("Mul", ["c2", "t"], "u"), node("Add", ["t", "u"])],
                      {"x": [2, 3]}, consts={"c1": weights(3), "c2": weights(1)}),
        "read elsewhere too"),
    "constant-fold": (
        lambda: graph([node("Transpose", ["w"], "wt", perm=[1, 0]),
                       node("ConstantOfShape", ["s"], "z", value=numpy_helper.from_array(np.array([2.0], np.float32))),
                       node("Add", ["wt", "z"], "b"), node("MatMul", ["x", "b"])], {"x": [3, 4]},
                      consts={"w": weights(5, 4), "s": ints(4, 5)}),
        lambda: graph([node("MatMul", ["x", "w"])], {"x": [3, 4]}, consts={"w": weights(4, 5)}),
        "not every input is a constant"),
    "shape-dim-fold": (lambda: _reshape_by_dim(2), lambda: _reshape_by_dim(0), "follows the model's dynamic dimensions"),
}


def _reshape_by_dim(axis):
    """`Reshape(x, [-1, Shape(x)[axis]])` of a [b, 3, 4] x with a dynamic b."""
    return graph([node("Shape", ["x"], "s"), node("Gather", ["s", "i"], "d", axis=0),
                  node("Concat", ["m", "d"], "t", axis=0), node("Reshape", ["x", "t"])],
                 {"x": ["b", 3, 4]}, consts={"i": ints(axis), "m": ints(-1)}, opset=15)


def test_shape_dim_fold_keeps_a_scalar_index_scalar_and_reads_a_shape_slice():
    """A scalar index gives a scalar (Unsqueeze after it expects one); Shape's start and end shift the indices."""
    scalar = graph([node("Shape", ["x"], "s", start=1), node("Gather", ["s", "i"], "d", axis=0),
                    node("Unsqueeze", ["d", "a"], "u"), node("Concat", ["m", "u"], "t", axis=0),
                    node("Reshape", ["x", "t"])], {"x": ["b", 3, 4]},
                   consts={"i": np.array(-1, np.int64), "a": ints(0), "m": ints(-1)}, opset=15)
    folded = assert_rewrites(scalar, "shape-dim-fold", dynamic={"x": [5, 3, 4]})
    (dim,) = [n for n in folded.gs.nodes if n.op == "Unsqueeze"][0].inputs[:1]
    assert dim.values.shape == () and int(dim.values) == 4



def test_constant_fold_keeps_a_scalar_scalar():
    """A folded scalar stays 0-d: as [1], Unsqueeze would make it [1, 1] and the Concat after it would fail."""
    scalar = graph([node("Mul", ["a", "b"], "p"), node("Unsqueeze", ["p", "ax"], "u"),
                    node("Concat", ["m", "u"], "t", axis=0), node("Reshape", ["x", "t"])], {"x": [2, 3, 4]},
                   consts={"a": np.array(3, np.int64), "b": np.array(4, np.int64), "ax": ints(0), "m": ints(-1)},
                   opset=15)
    folded = assert_rewrites(scalar, "constant-fold")
    (value,) = [n for n in folded.gs.nodes if n.op == "Unsqueeze"][0].inputs[:1]
    assert value.values.shape == () and int(value.values) == 12

test_matches_and_keeps_numbers, test_refuses_with_reason = case_tests(CASES)


@pytest.mark.parametrize("op,rank", [("MatMul", 2), ("MatMul", 3), ("Gemm", 2)])
def test_scale_fold_variants(op, rank):
    new = assert_rewrites(_scaled("Mul", producer=op, const_shape=() if rank == 3 else (4,), rank=rank),
                          "matmul-scale-fold")
    assert len(new) == 1


def test_matmul_bn_fold_gives_one_gemm():
    assert assert_rewrites(_bn_after("MatMul"), "matmul-bn-fold").op_counts() == {"Gemm": 1}


def test_constant_fold_chain_reaches_a_single_matmul():
    from rlflow.rewrites import apply, rule

    g = CASES["constant-fold"][0]()
    while (matches := rule("constant-fold").find(g)):
        g = apply(g, matches[0])
    assert g.op_counts() == {"MatMul": 1}


def _token_type_lookup(width: int = 512, seq: int = 16):
    """Cut from BERT as `torch.onnx.export(dynamo=True)` writes it at static shapes (issue #50): the registered
    `token_type_ids` buffer (1, 512) gathered at positions 0..15 (`torch.gather` -> GatherElements; the positions, a
    Slice of the Shape of the attention mask, are a constant at static shapes), then the token-type embedding lookup."""
    buffer = np.random.default_rng(0).integers(0, 2, (1, width)).astype(np.int64)
    consts = {"buffer": buffer, "positions": np.arange(seq, dtype=np.int64).reshape(1, seq), "table": weights(2, 8)}
    return graph([node("GatherElements", ["buffer", "positions"], "types", axis=1), node("Gather", ["table", "types"], "e"),
                  node("Add", ["x", "e"])], {"x": [1, seq, 8]}, consts=consts, opset=18)


def test_constant_fold_gather_elements_of_a_dynamo_bert_export():
    from rlflow.rewrites import apply, rule

    g = _token_type_lookup()
    matches = rule("constant-fold").find(g)
    assert [g.node_map()[m.root].op for m in matches] == ["GatherElements"]
    folded = assert_rewrites(g, "constant-fold")
    values = folded.node_map()["Gather_1"].inputs[1].values
    np.testing.assert_array_equal(values, g.node_map()["GatherElements_0"].inputs[0].values[:, :16])
    while (matches := rule("constant-fold").find(folded)):  # then the lookup: all that is left is x + constant
        folded = apply(folded, matches[0])
    assert folded.op_counts() == {"Add": 1}
    assert verify(g.to_model(), folded.to_model()).ok


def test_constant_fold_runs_on_onnxruntime(monkeypatch):
    """The root cause of #50: the one-node model declared its outputs of type UNDEFINED, which onnxruntime refuses, so
    every fold fell back to onnx's reference evaluator (whose GatherElements fails past 32-64 entries on the axis)."""
    from rlflow.rewrites.substitutions import constant_eval

    def no_reference(model):
        raise AssertionError("fell back to the reference evaluator")

    monkeypatch.setattr(constant_eval, "_run_reference", no_reference)
    g = _token_type_lookup()
    (types,) = constant_eval.evaluate(g, g.node_map()["GatherElements_0"])
    assert types.dtype == np.int64 and types.shape == (1, 16)


@pytest.mark.parametrize("op,inputs,attrs", [
    ("GatherElements", [np.random.default_rng(1).integers(0, 9, (1, 512)), np.arange(16).reshape(1, 16)], {"axis": 1}),
    ("GatherElements", [weights(3, 100), np.random.default_rng(2).integers(-100, 100, (2, 7))], {"axis": -1}),
    ("LpNormalization", [weights(5, 70)], {"axis": 0, "p": 1}),
])
def test_reference_fallback_agrees_with_onnxruntime(op, inputs, attrs):
    """Where onnxruntime refuses a node the reference evaluator computes it, with onnx 1.23's wrong GatherElements
    (past np.choose's limit; indices smaller than the data) and LpNormalization (p=1) replaced."""
    from rlflow.rewrites.substitutions import constant_eval

    inputs = [x.astype(np.int64) if x.dtype.kind == "i" else x for x in inputs]
    names = [f"c{k}" for k in range(len(inputs))]
    out_type = TensorProto.INT64 if inputs[0].dtype == np.int64 else TensorProto.FLOAT
    g = graph([node(op, names, "t", **attrs), node("Identity", ["t"])], {}, outputs={"y": out_type},
              consts=dict(zip(names, inputs)), opset=18)
    model = constant_eval._fold_model(g, g.node_map()[f"{op}_0"])
    (want,), (got,) = constant_eval._run_onnxruntime(model), constant_eval._run_reference(model)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_constant_fold_reads_a_constant_passed_on_by_identity():
    """check takes an Identity of a constant as a constant (TorchScript exports route biases that way); so must apply."""
    g = graph([node("Identity", ["w"], "wi"), node("Transpose", ["wi"], "wt", perm=[1, 0]), node("MatMul", ["x", "wt"])],
              {"x": [3, 4]}, consts={"w": weights(5, 4)})
    assert assert_rewrites(g, "constant-fold", count=2)


def test_constant_fold_refuses_what_it_cannot_evaluate():
    """A node neither onnxruntime nor the reference evaluator computes is refused in check, with the reason, so that
    check and apply agree (an index out of range here)."""
    g = graph([node("Gather", ["table", "idx"], "e"), node("Add", ["x", "e"])], {"x": [3, 8]},
              consts={"table": weights(2, 8), "idx": ints(0, 1, 7)})
    assert_refuses(g, "constant-fold", "neither onnxruntime nor onnx's reference evaluator computes it")
