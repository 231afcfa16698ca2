"""onnxruntime-aware fusions: Gemm, LayerNormalization, and the contrib operators onnxruntime's CPU provider runs."""
from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import TensorProto, numpy_helper

from .helpers import F32, assert_refuses, assert_rewrites, case_tests, graph, ints, node, weights


def _layernorm(opset=17, square="Pow", axes=(-1,), gamma_shape=(8,)):
    rm = dict(axes=list(axes)) if opset < 18 else {}
    extra = ["ax"] if opset >= 18 else []
    sq = node("Pow", ["d", "two"], "p") if square == "Pow" else node("Mul", ["d", "d"], "p")
    return graph([node("ReduceMean", ["x", *extra], "m", **rm), node("Sub", ["x", "m"], "d"), sq,
                  node("ReduceMean", ["p", *extra], "v", **rm), node("Add", ["v", "eps"], "ve"), node("Sqrt", ["ve"], "s"),
                  node("Div", ["d", "s"], "n"), node("Mul", ["g", "n"], "gn"), node("Add", ["gn", "b"])],
                 {"x": ["batch", 4, 8]}, opset=opset,
                 consts={"two": np.array(2.0, np.float32), "eps": np.array(1e-5, np.float32),
                         "g": weights(*gamma_shape), "b": weights(8, seed=3), "ax": ints(*axes)})


def _gelu(variant="erf", half_first=False, scale=None, cube="pow"):
    """GELU's formula as exporters write it; `cube="mul"` writes the tanh form's x^3 as `x * (x * x)`."""
    if variant == "erf":
        inner = [node("Div", ["x", "r2"], "t"), node("Erf", ["t"], "e")]
        consts = {"r2": np.array(scale or math.sqrt(2), np.float32)}
    else:
        power = ([node("Pow", ["x", "three"], "c")] if cube == "pow"
                 else [node("Mul", ["x", "x"], "sq"), node("Mul", ["x", "sq"], "c")])
        inner = [*power, node("Mul", ["k", "c"], "kc"), node("Add", ["x", "kc"], "in"),
                 node("Mul", ["in", "s"], "t"), node("Tanh", ["t"], "e")]
        consts = {"three": np.array(3.0, np.float32), "k": np.array(0.044715, np.float32),
                  "s": np.array(scale or math.sqrt(2 / math.pi), np.float32)}
    consts.update(one=np.array(1.0, np.float32), half=np.array(0.5, np.float32))
    tail = ([node("Mul", ["x", "half"], "h"), node("Mul", ["h", "a"])] if half_first
            else [node("Mul", ["x", "a"], "h"), node("Mul", ["h", "half"])])
    return graph(inner + [node("Add", ["e", "one"], "a"), *tail], {"x": [2, 5]}, consts=consts)


def _activation_after(op, act, **attrs):
    if op == "Conv":
        first, x = node("Conv", ["x", "w", "b"], "h", kernel_shape=[3, 3]), {"x": [1, 3, 5, 5]}
        consts = {"w": weights(4, 3, 3, 3), "b": weights(4)}
    else:
        first, x = node("Gemm", ["x", "w", "b"], "h", transB=1, alpha=0.5), {"x": [3, 5]}
        consts = {"w": weights(4, 5), "b": weights(4)}
    inputs = ["h"]
    if act == "Clip":
        inputs += ["lo", "hi"]
        consts.update(lo=np.array(-0.5, np.float32), hi=np.array(0.7, np.float32))
    return graph([first, node(act, inputs, **attrs)], x, consts=consts)


def _bias_act(op, bias_input=False, bias_shape=(8,)):
    inputs = {"x": ["n", 3, 8]}
    consts = {}
    if bias_input:
        inputs["b"] = list(bias_shape)
    else:
        consts["b"] = weights(*bias_shape)
    return graph([node("Add", ["x", "b"], "s"), node(op, ["s"], domain="com.microsoft")], inputs,
                 {"y": (F32, ["n", 3, 8])}, consts=consts)


def attention(heads=2, size=4, k_form="0231", scale_form="div", mask=False, dynamic=True, mask_shape=(1, 1, 5, 5),
              guard=False, cast=False):
    """Self-attention as exporters write it: Q, K, V projections split into heads, scaled scores, Softmax, heads
    merged back; `k_form` "0231" transposes K once, "twice" like the dynamo exporter; `scale_form` "div" divides the
    scores, "qk" multiplies Q and K by sqrt(scale) each (scaled_dot_product_attention); `mask` adds a constant of
    `mask_shape` to the scores (-inf in one place), `guard` the exporters' `Where(IsNaN(p), 0, p)` after the Softmax,
    `cast` GPT-2's no-op Cast of the probabilities to the values' type."""
    d = heads * size
    consts = {f"w{k}": weights(d, d, seed=i) for i, k in enumerate("qkv")}
    consts.update({f"b{k}": weights(d, seed=10 + i) for i, k in enumerate("qkv")})
    consts.update(split=ints(0, 0, heads, size), merge=ints(0, 0, d), div=np.array(math.sqrt(size), np.float32),
                  root=np.array(size ** -0.25, np.float32), zero=np.array(0.0, np.float32))
    consts["mask"] = weights(*mask_shape, seed=20)
    consts["mask"].flat[1] = -np.inf
    nodes = []
    for k in "qkv":
        perm = [0, 2, 3, 1] if k == "k" and k_form == "0231" else [0, 2, 1, 3]
        nodes += [node("MatMul", ["x", f"w{k}"], f"{k}0"), node("Add", [f"{k}0", f"b{k}"], f"{k}1"),
                  node("Reshape", [f"{k}1", "split"], f"{k}2"), node("Transpose", [f"{k}2"], f"{k}3", perm=perm)]
    if k_form != "0231":
        nodes.append(node("Transpose", ["k3"], "k4", perm=[0, 1, 3, 2]))
    key = "k3" if k_form == "0231" else "k4"
    if scale_form == "qk":
        nodes += [node("Mul", ["q3", "root"], "qs"), node("Mul", [key, "root"], "ks"), node("MatMul", ["qs", "ks"], "s1")]
    else:
        nodes += [node("MatMul", ["q3", key], "s0"), node("Div", ["s0", "div"], "s1")]
    if mask:
        nodes.append(node("Add", ["s1", "mask"], "s2"))
    nodes.append(node("Softmax", ["s2" if mask else "s1"], "p0" if guard or cast else "p", axis=-1))
    if cast:
        nodes.append(node("Cast", ["p0"], "p", to=TensorProto.FLOAT))
    if guard:
        nodes += [node("IsNaN", ["p0"], "nan"), node("Where", ["nan", "zero", "p0"], "p")]
    nodes += [node("MatMul", ["p", "v3"], "a0"),
              node("Transpose", ["a0"], "a1", perm=[0, 2, 1, 3]), node("Reshape", ["a1", "merge"], "y")]
    return graph(nodes, {"x": ["batch" if dynamic else 2, 5, d]}, consts=consts)


def _mha(shared=True, mask=False, bias=True):
    """MultiHeadAttention on three projections `x.W + b` of one input (`shared`) or of two, as attention-fusion
    leaves them."""
    consts = {f"w{k}": weights(8, 8, seed=i) for i, k in enumerate("qkv")}
    consts.update({f"b{k}": weights(8, seed=10 + i) for i, k in enumerate("qkv")})
    consts["mask"] = weights(1, 1, 5, 5, seed=20)
    nodes, inputs = [], {"x": ["batch", 5, 8], "z": ["batch", 5, 8]}
    for k in "qkv":
        source = "x" if shared or k == "q" else "z"
        nodes.append(node("MatMul", [source, f"w{k}"], f"{k}0" if bias else k))
        if bias:
            nodes.append(node("Add", [f"b{k}", f"{k}0"] if k == "k" else [f"{k}0", f"b{k}"], k))
    extra = ["", "", "mask"] if mask else []
    nodes.append(node("MultiHeadAttention", ["q", "k", "v", *extra], domain="com.microsoft", num_heads=2, scale=0.3))
    return graph(nodes, inputs, outputs={"y": (F32, ["batch", 5, 8])}, consts=consts)


I64 = TensorProto.INT64


def _embeddings(lookups=3, shared=False, shape_reader=False, table_input=False):
    """BERT's embeddings: token, position and segment tables looked up and summed, then LayerNormalization.  With
    `shape_reader`, the position ids come from Shape of the token lookup (TorchScript's DistilBERT); with `shared`,
    the sum also feeds a residual Add (GPT-2)."""
    nodes = [node("Gather", ["W", "ids"], "we"), node("Gather", ["P", "pos"], "pe"), node("Add", ["we", "pe"], "s2")]
    inputs = {"ids": (["batch", 5], I64), "pos": ([1, 5], I64)}
    if shape_reader:
        del inputs["pos"]
        nodes[1:1] = [node("Shape", ["we"], "shp"), node("Gather", ["shp", "one"], "n", axis=0),
                      node("Range", ["zero", "n", "one"], "r"), node("Unsqueeze", ["r", "axis0"], "pos")]
    total = "s2"
    if lookups == 3:
        inputs["seg"] = (["batch", 5], I64)
        nodes += [node("Gather", ["T", "seg"], "te"), node("Add", ["s2", "te"], "s3")]
        total = "s3"
    nodes.append(node("LayerNormalization", [total, "g", "b"], "n" if shared else "y", epsilon=1e-12))
    if shared:
        nodes.append(node("Add", [total, "n"], "y"))
    consts = {"P": weights(7, 8, seed=1), "T": weights(2, 8, seed=2), "g": weights(8, seed=3),
              "b": weights(8, seed=4), "one": np.array(1, np.int64), "zero": np.array(0, np.int64), "axis0": ints(0)}
    if table_input:
        inputs["W"] = [11, 8]
    else:
        consts["W"] = weights(11, 8)
    return graph(nodes, inputs, opset=17, consts=consts)


def _tied_head(hidden: list, untied: bool = False):
    """An embedding table read by a Gather, and a head over its transpose kept as a second constant, as the
    TorchScript exporter writes a tied language-model head (`untied`: the head's table differs in one element)."""
    table = weights(7, 4)
    head = np.ascontiguousarray(table.T)
    if untied:
        head[0, 0] += 1.0
    nodes = [node("Gather", ["table", "ids"], "e"), node("MatMul", ["h", "head"], "y")]
    return graph(nodes, {"ids": ([1, 2], TensorProto.INT64), "h": hidden}, outputs=("e", "y"),
                 consts={"table": table, "head": head})


CASES = {
    "matmul-add-to-gemm": (
        lambda: graph([node("MatMul", ["x", "w"], "m"), node("Add", ["c", "m"])], {"x": ["n", 4]},
                      consts={"w": weights(4, 5), "c": weights(5)}),
        lambda: graph([node("MatMul", ["x", "w"], "m"), node("Add", ["c", "m"])], {"x": [2, 3, 4]},
                      consts={"w": weights(4, 5), "c": weights(5)}),
        "not a float product of 2-D operands"),
    "gemm-to-matmul-add": (
        lambda: graph([node("Gemm", ["x", "w", "c"], transB=1, alpha=0.5, beta=2.0)], {"x": [3, 4]},
                      consts={"w": weights(5, 4), "c": weights(5)}),
        lambda: graph([node("Gemm", ["x", "z"], transB=1)], {"x": [3, 4], "z": [5, 4]}),
        "B is not constant but transposed or scaled"),
    "layernorm-fusion": (lambda: _layernorm(), lambda: _layernorm(opset=13), "needs opset 17"),
    "skip-layernorm-fusion": (
        lambda: graph([node("Add", ["x", "z"], "s"), node("LayerNormalization", ["s", "g", "b"], epsilon=1e-3)],
                      {"x": [2, 4, 8], "z": [2, 4, 8]}, opset=17, consts={"g": weights(8), "b": weights(8, seed=1)}),
        lambda: graph([node("Add", ["x", "z"], "s"), node("LayerNormalization", ["s", "g", "b"])],
                      {"x": [2, 4, 8], "z": [8]}, opset=17, consts={"g": weights(8), "b": weights(8, seed=1)}),
        "not two 2-D or 3-D tensors of one shape"),
    "gelu-fusion": (lambda: _gelu(), lambda: _gelu(scale=2.0), "not the expected function of x"),
    "fast-gelu-fusion": (lambda: _gelu("tanh", half_first=True), lambda: _gelu("tanh", scale=1.0),
                         "not the expected function of x"),
    "conv-activation-fusion": (lambda: _activation_after("Conv", "Clip"),
                               lambda: _activation_after("Gemm", "Relu"), "not a private Conv"),
    "gemm-activation-fusion": (lambda: _activation_after("Gemm", "LeakyRelu", alpha=0.2),
                               lambda: _activation_after("Conv", "Relu"), "not a private Gemm"),
    "matmul-transpose-fusion": (
        lambda: graph([node("Transpose", ["k"], "kt", perm=[0, 2, 1]), node("MatMul", ["q", "kt"])],
                      {"q": [2, 3, 4], "k": [2, 5, 4]}),
        lambda: graph([node("Transpose", ["k"], "kt", perm=[1, 0, 2]), node("MatMul", ["q", "kt"])],
                      {"q": [2, 3, 4], "k": [4, 2, 5]}),
        "no operand is a private Transpose of its last two axes"),
    "bias-gelu-fusion": (
        lambda: _bias_act("Gelu"), lambda: _bias_act("Gelu", bias_input=True), "not of a float32 constant vector"),
    "bias-fast-gelu-fusion": (
        lambda: _bias_act("FastGelu"), lambda: _bias_act("FastGelu", bias_shape=(3, 8)),
        "not of a float32 constant vector"),
    "attention-pack-qkv": (lambda: _mha(), lambda: _mha(shared=False), "not projections of one input"),
    "embed-layernorm-fusion": (lambda: _embeddings(), lambda: _embeddings(table_input=True),
                               "two or three embedding lookups"),
    "attention-fusion": (lambda: attention(), lambda: attention(mask=True, mask_shape=(5,)),
                         "the mask added to the scores is not float32 [B or 1, H or 1, S or 1, T]"),
    "tied-head-fusion": (lambda: _tied_head([1, 32, 4]), lambda: _tied_head([1, 32, 4], untied=True),
                         "not the transpose of an embedding table a Gather reads"),
}


test_matches_and_keeps_numbers, test_refuses_with_reason = case_tests(CASES)


@pytest.mark.parametrize("opset,square,axes", [(17, "Mul", (-1,)), (18, "Pow", (-2, -1))])
def test_layernorm_variants(opset, square, axes):
    new = assert_rewrites(_layernorm(opset, square, axes), "layernorm-fusion")
    assert new.op_counts() == {"LayerNormalization": 1}


def test_layernorm_refuses_gamma_over_leading_axes():
    assert_refuses(_layernorm(gamma_shape=(4, 1)), "layernorm-fusion", "vary along leading axes")


@pytest.mark.parametrize("variant,half_first,cube", [("erf", True, "pow"), ("tanh", False, "pow"),
                                                     ("tanh", True, "mul")])
def test_gelu_variants_fuse_to_one_node(variant, half_first, cube):
    name = "gelu-fusion" if variant == "erf" else "fast-gelu-fusion"
    assert len(assert_rewrites(_gelu(variant, half_first, cube=cube), name)) == 1


def test_fast_gelu_refuses_a_cube_that_is_not_of_x():
    g = _gelu("tanh", cube="mul")
    proto = g.to_model()
    for n in proto.graph.node:  # x * (x * x) becomes x * (x * z)
        if n.output[0] == "sq":
            n.input[:] = ["x", "z"]
    consts = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    assert_refuses(graph(list(proto.graph.node), {"x": [2, 5], "z": [2, 5]}, consts=consts), "fast-gelu-fusion",
                   "not the expected function of x")


@pytest.mark.parametrize("act,attrs", [("Relu", {}), ("HardSigmoid", {"alpha": 0.3}), ("Tanh", {})])
def test_activation_fusions(act, attrs):
    assert_rewrites(_activation_after("Conv", act, **attrs), "conv-activation-fusion")
    assert_rewrites(_activation_after("Gemm", act, **attrs), "gemm-activation-fusion")


def test_gemm_round_trip_keeps_numbers():
    from rlflow.rewrites import apply, rule

    g = CASES["gemm-to-matmul-add"][0]()
    unfused = assert_rewrites(g, "gemm-to-matmul-add")
    assert unfused.op_counts() == {"Add": 1, "MatMul": 1}
    assert apply(unfused, rule("matmul-add-to-gemm").find(unfused)[0]).op_counts() == {"Gemm": 1}


def test_gemm_to_matmul_reads_a_plain_weight_as_it_is():
    """A Gemm neither transposed nor scaled hands its own weight and bias to the MatMul and Add: a copy of each was
    2.4 GB more per candidate on GPT-2 large."""
    g = graph([node("Gemm", ["x", "w", "c"])], {"x": [3, 4]}, consts={"w": weights(4, 5), "c": weights(5)})
    w, c = (g.gs.tensors()[name] for name in ("w", "c"))
    unfused = assert_rewrites(g, "gemm-to-matmul-add")
    (matmul,), (add,) = ([n for n in unfused.gs.nodes if n.op == op] for op in ("MatMul", "Add"))
    assert matmul.inputs[1].values is w.values and add.inputs[1].values is c.values
    scaled = assert_rewrites(CASES["gemm-to-matmul-add"][0](), "gemm-to-matmul-add")  # transB, alpha, beta folded
    (matmul,) = [n for n in scaled.gs.nodes if n.op == "MatMul"]
    assert matmul.inputs[1].values.shape == (4, 5)


@pytest.mark.parametrize("k_form,scale_form", [("twice", "div"), ("0231", "qk"), ("twice", "qk")])
def test_attention_fusion_variants(k_form, scale_form):
    new = assert_rewrites(attention(heads=4, size=2, k_form=k_form, scale_form=scale_form), "attention-fusion")
    assert new.op_counts()["MultiHeadAttention"] == 1 and "Softmax" not in new.op_counts()


def test_attention_round_trip():
    fused = assert_rewrites(attention(dynamic=False), "attention-fusion")
    unfused = assert_rewrites(fused, "attention-unfuse")
    assert "MultiHeadAttention" not in unfused.op_counts()
    assert len(assert_rewrites(unfused, "attention-fusion").gs.nodes) == len(fused.gs.nodes)


@pytest.mark.parametrize("mask_shape,guard", [((1, 1, 5, 5), True), ((1, 2, 5, 5), False)])
def test_attention_with_mask_and_nan_guard(mask_shape, guard):
    """The additive mask becomes MultiHeadAttention's attention_bias; the NaN guard stays on the fused output."""
    g = attention(mask=True, mask_shape=mask_shape, guard=guard, dynamic=False)
    new = assert_rewrites(g, "attention-fusion")
    ops = new.op_counts()
    assert ops["MultiHeadAttention"] == 1 and "Softmax" not in ops and ops.get("IsNaN", 0) == int(guard)
    mha = next(n for n in new.gs.nodes if n.op == "MultiHeadAttention")
    assert [t.name for t in mha.inputs][3:5] == ["", ""] and mha.inputs[5].name == "mask"
    unfused = assert_rewrites(new, "attention-unfuse")
    assert "MultiHeadAttention" not in unfused.op_counts()


def test_attention_refuses_a_tensor_read_outside():
    g = attention(mask=True)
    g.gs.outputs.append(next(t for t in g.gs.tensors().values() if t.name == "p"))  # the probabilities are an output
    assert_refuses(g, "attention-fusion", "")


@pytest.mark.parametrize("variant,half_first,bias_first,cube", [
    ("erf", False, True, "pow"), ("erf", True, False, "pow"), ("tanh", False, False, "pow"), ("tanh", True, True, "mul")])
def test_bias_gelu_from_the_formula(variant, half_first, bias_first, cube):
    """Exporters write `0.5 * h * (1 + erf(h / sqrt(2)))` on `h = MatMul + bias`: one step to BiasGelu/FastGelu."""
    g = _gelu(variant, half_first, cube=cube)
    proto = g.to_model()
    for n in proto.graph.node:  # x becomes h = Add(m, c) with m = MatMul(x, w)
        n.input[:] = ["xb" if i == "x" else i for i in n.input]
    add = node("Add", ["bl", "ml"] if bias_first else ["ml", "bl"], "xb")
    nodes = [node("MatMul", ["x", "wl"], "ml"), add, *proto.graph.node]
    consts = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    consts.update(wl=weights(5, 5), bl=weights(5, seed=4))
    name = "bias-gelu-fusion" if variant == "erf" else "bias-fast-gelu-fusion"
    new = assert_rewrites(graph(nodes, {"x": [2, 5]}, consts=consts), name)
    assert new.op_counts() == {"MatMul": 1, "BiasGelu" if variant == "erf" else "FastGelu": 1}


@pytest.mark.parametrize("approximate,name,fused", [("none", "bias-gelu-fusion", "BiasGelu"),
                                                    ("tanh", "bias-fast-gelu-fusion", "FastGelu")])
def test_bias_gelu_from_opset_20_gelu(approximate, name, fused):
    g = graph([node("Add", ["x", "b"], "s"), node("Gelu", ["s"], approximate=approximate)], {"x": ["n", 3, 8]},
              consts={"b": weights(8)}, opset=20)
    assert assert_rewrites(g, name).op_counts() == {fused: 1}
    other = "bias-fast-gelu-fusion" if name == "bias-gelu-fusion" else "bias-gelu-fusion"
    assert_refuses(g, other, "approximation is not")


def test_bias_gelu_refuses_an_argument_read_elsewhere():
    g = _gelu()
    proto = g.to_model()
    for n in proto.graph.node:
        n.input[:] = ["xb" if i == "x" else i for i in n.input]
    consts = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    consts["c"] = weights(5, seed=4)
    g = graph([node("Add", ["x", "c"], "xb"), *proto.graph.node], {"x": [2, 5]}, outputs=("y", "xb"), consts=consts)
    assert_refuses(g, "bias-gelu-fusion", "read elsewhere")


@pytest.mark.parametrize("operand,bias_first,beta", [(0, True, True), (1, False, True), (0, False, False)])
def test_skip_layernorm_absorbs_the_linear_bias(operand, bias_first, beta):
    """`LayerNormalization(Add(Add(MatMul, bias), residual))` in either order becomes one SkipLayerNormalization."""
    linear = [node("MatMul", ["x", "w"], "m"), node("Add", ["c", "m"] if bias_first else ["m", "c"], "h")]
    add = node("Add", ["h", "z"] if operand == 0 else ["z", "h"], "s")
    ln = node("LayerNormalization", ["s", "g", "b"] if beta else ["s", "g"], epsilon=1e-3)
    g = graph([*linear, add, ln], {"x": [2, 4, 8], "z": [2, 4, 8]}, opset=17,
              consts={"w": weights(8, 8), "c": weights(8, seed=2), "g": weights(8), "b": weights(8, seed=1)})
    new = assert_rewrites(g, "skip-layernorm-fusion")
    assert new.op_counts() == {"MatMul": 1, "SkipLayerNormalization": 1}
    skip = next(n for n in new.gs.nodes if n.op == "SkipLayerNormalization")
    assert skip.inputs[4].name == "c" and {t.name for t in skip.inputs[:2]} == {"m", "z"}
    assert "Add" in assert_rewrites(new, "skip-layernorm-unfuse").op_counts()


@pytest.mark.parametrize("mask,bias", [(True, True), (False, False)])
def test_attention_pack_qkv_variants(mask, bias):
    new = assert_rewrites(_mha(mask=mask, bias=bias), "attention-pack-qkv")
    assert new.op_counts() == {"Attention": 1}
    packed = next(n for n in new.gs.nodes if n.op == "Attention")
    assert packed.attrs["num_heads"] == 2 and packed.inputs[1].shape == (8, 24)
    assert (packed.inputs[5].name == "mask") if mask else len(packed.inputs) == 3


def test_skip_layernorm_keeps_a_shared_sum_as_its_fourth_output():
    """Pre-norm blocks read the residual sum again (`x + attn` feeds the LayerNorm and the next residual Add)."""
    g = graph([node("Add", ["x", "z"], "s"), node("LayerNormalization", ["s", "g", "b"], "n"),
               node("Add", ["s", "n"], "y")], {"x": ["batch", 4, 8], "z": ["batch", 4, 8]}, opset=17,
              consts={"g": weights(8), "b": weights(8, seed=1)})
    new = assert_rewrites(g, "skip-layernorm-fusion")
    skip = next(n for n in new.gs.nodes if n.op == "SkipLayerNormalization")
    assert new.op_counts() == {"SkipLayerNormalization": 1, "Add": 1} and skip.outputs[3].outputs
    assert "LayerNormalization" in assert_rewrites(new, "skip-layernorm-unfuse").op_counts()


@pytest.mark.parametrize("shape", [[2, 4, 8], ["batch", 3, 8], [5, 8]])
def test_skip_layernorm_keeps_a_sum_that_is_a_graph_output(shape):
    """Older Hugging Face exports return the residual sum too (issue #78): the fourth output writes it, by its name."""
    g = graph([node("Add", ["x", "z"], "s"), node("LayerNormalization", ["s", "g", "b"])],
              {"x": shape, "z": shape}, outputs=("y", "s"), opset=17,
              consts={"g": weights(8), "b": weights(8, seed=1)})
    new = assert_rewrites(g, "skip-layernorm-fusion")
    skip = next(n for n in new.gs.nodes if n.op == "SkipLayerNormalization")
    assert new.op_counts() == {"SkipLayerNormalization": 1} and skip.outputs[3].name == "s"
    assert [t.name for t in new.gs.outputs] == ["y", "s"]


@pytest.mark.parametrize("lookups", [2, 3])
def test_embed_layernorm_fusion(lookups):
    new = assert_rewrites(_embeddings(lookups), "embed-layernorm-fusion")
    fused = next(n for n in new.gs.nodes if n.op == "EmbedLayerNormalization")
    assert fused.inputs[8].name != "" and fused.inputs[3].name == "P"  # the [1, S] lookup is the position one
    assert new.op_counts()["Cast"] == lookups  # 64-bit ids cast to the operator's 32


def test_embed_layernorm_keeps_a_shared_sum_as_its_third_output():
    new = assert_rewrites(_embeddings(shared=True), "embed-layernorm-fusion")
    fused = next(n for n in new.gs.nodes if n.op == "EmbedLayerNormalization")
    assert len(fused.outputs) == 3 and fused.outputs[2].outputs and "LayerNormalization" not in new.op_counts()


def test_embed_layernorm_takes_a_shape_of_a_lookup_from_its_ids():
    """The position ids computed from Shape of the token lookup: the Shape reads the ids instead (no cycle)."""
    new = assert_rewrites(_embeddings(lookups=2, shape_reader=True), "embed-layernorm-fusion")
    assert "Gather" in new.op_counts() and all(n.inputs[0].name != "we" for n in new.gs.nodes if n.op == "Shape")


def test_matmul_transpose_fusion_fuses_a_transposed_constant_only_for_several_rows():
    """A tied language-model head transposes its embedding table, a constant that onnxruntime folds at load: for the
    one row of a batch-1 decode step FusedMatMul measured slower on the CPU, from two rows faster; the same head over
    a transposed activation always fuses."""
    table = {"table": weights(7, 4)}
    head = [node("Transpose", ["table"], "t", perm=[1, 0]), node("MatMul", ["h", "t"])]
    assert_refuses(graph(head, {"h": [1, 1, 4]}, consts=table), "matmul-transpose-fusion", "is a constant")
    assert_rewrites(graph(head, {"h": [2, 1, 4]}, consts=table), "matmul-transpose-fusion")  # a batch-2 step
    assert_rewrites(graph(head, {"h": [1, 128, 4]}, consts=table), "matmul-transpose-fusion")  # a prefill
    activation = [node("Transpose", ["k"], "t", perm=[1, 0]), node("MatMul", ["h", "t"])]
    assert_rewrites(graph(activation, {"h": [2, 3, 4], "k": [7, 4]}), "matmul-transpose-fusion")


@pytest.mark.parametrize("hidden", [[1, 128, 4], [2, 1, 4], [64, 4]])
def test_tied_head_fusion_reads_the_table_once_over_more_than_one_row(hidden):
    """The head reads the Gather's table through FusedMatMul(transB), its transposed copy gone, at several shapes."""
    fused_graph = assert_rewrites(_tied_head(hidden), "tied-head-fusion")
    assert "FusedMatMul" in fused_graph.op_counts() and "head" not in {t.name for t in fused_graph.to_model(
        ).graph.initializer}


def test_tied_head_fusion_refuses_a_decode_steps_row_and_a_table_of_another_shape():
    assert_refuses(_tied_head([1, 1, 4]), "tied-head-fusion", "one row of A")
    other = graph([node("Gather", ["table", "ids"], "e"), node("MatMul", ["h", "head"], "y")],
                  {"ids": ([1, 2], TensorProto.INT64), "h": [1, 32, 4]}, outputs=("e", "y"),
                  consts={"table": weights(4, 7), "head": weights(4, 7)})
    assert_refuses(other, "tied-head-fusion", "not the transpose of an embedding table")
