"""GroupQueryAttention absorptions (`rlflow/rewrites/fusions/attention/gqa_absorb.py`): the rotary embedding taken in
(`group-query-attention-rotary`) and the Q, K, V projections packed (`group-query-attention-pack-qkv`) on synthetic
forms of what group-query-attention-fusion and rotary-fusion leave, with refusals; then the exporters' real decode
steps and prefills after every fusion, verified through onnxruntime with random 0/1 masks and position ids that are
not past + i (random per row, and explicit left padding), at batch 2 and 1, past lengths 3, 16 and 40.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

from rlflow.graph.core import Graph
from rlflow.graph.model_file import check_model
from rlflow.measure.inputs import random_inputs
from rlflow.measure.verify import compare_arrays, verify
from rlflow.rewrites import apply, rule
from rlflow.search.candidates import Candidate, all_fusions

from .helpers import assert_refuses, graph, ints, node, weights
from .test_decoder_attention import _prefill, _step, _step_sizes, monkeypatch_module, steps  # noqa: F401 - fixtures

F16, I64 = TensorProto.FLOAT16, TensorProto.INT64
ROTARY, PACK = "group-query-attention-rotary", "group-query-attention-pack-qkv"
TABLE = 64
MS = "com.microsoft"


# ------------------------------------------------------------------------------------------ synthetic patterns
def gqa(batch="b", seq=1, past="p", shared=False, norm=False, bias=False, elem=TensorProto.FLOAT, size=16, heads=4,
        kv_heads=2, interleaved=0, hidden=32):
    """GroupQueryAttention as group-query-attention-fusion leaves it after rotary-fusion: Q and K projected from x
    [batch, seq, hidden], split into heads (Reshape, [Qwen3's per-head norm,] Transpose), rotated by RotaryEmbedding
    (ids [batch, seq], or [1, seq] expanded to the batch where `shared`), brought back to [B, S, heads * size]; V
    through two Reshapes; the sequence lengths read off the rotated heads' Shapes; a cache [batch, kv, past, size] and
    a mask from attention_mask [batch, past + seq]."""
    dtype = onnx.helper.tensor_dtype_to_np_dtype(elem)
    total = past + seq if isinstance(past, int) and isinstance(seq, int) else "t"
    inputs = {"x": ([batch, seq, hidden], elem), "attention_mask": ([batch, total], I64),
              "position_ids": ([1 if shared else batch, seq], I64),
              "pk": ([batch, kv_heads, past, size], elem), "pv": ([batch, kv_heads, past, size], elem)}
    angles = np.arange(TABLE)[:, None] / 10000 ** (np.arange(0, size, 2) / size)
    consts = {"cos": np.cos(angles).astype(dtype), "sin": np.sin(angles).astype(dtype), "zero": np.zeros((), dtype),
              "low": np.array(np.finfo(dtype).min, dtype), "ax12": ints(1, 2), "one": np.ones(1, np.int32),
              "scalar": np.zeros(0, np.int64), "flat1": ints(0, 1, -1), "flat": ints(0, 0, -1),
              "nw": weights(size, seed=5, dtype=dtype) + np.array(1, dtype)}
    nodes = [node("Shape", ["x"], "sizes", start=0, end=2), node("Expand", ["position_ids", "sizes"], "ids")] if (
        shared) else [node("Identity", ["position_ids"], "ids")]
    for name, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
        consts[f"w{name}"] = weights(hidden, n * size, seed=ord(name), scale=0.3, dtype=dtype)
        consts[f"split_{name}"] = ints(0, 0, n, size)
        nodes.append(node("MatMul", ["x", f"w{name}"], f"{name}_mm"))
        out = f"{name}_mm"
        if bias:
            consts[f"b{name}"] = weights(n * size, seed=ord(name) + 1, dtype=dtype)
            nodes.append(node("Add", [out, f"b{name}"], f"{name}_b"))
            out = f"{name}_b"
        nodes.append(node("Reshape", [out, f"split_{name}"], f"{name}4"))
        if name == "v":
            nodes.append(node("Reshape", ["v4", "flat"], "v_flat"))
            continue
        heads4 = f"{name}4"
        if norm:
            nodes.append(node("SimplifiedLayerNormalization", [heads4, "nw"], f"{name}_n", axis=-1, epsilon=1e-6))
            heads4 = f"{name}_n"
        nodes += [node("Transpose", [heads4], f"{name}t", perm=[0, 2, 1, 3]),
                  node("RotaryEmbedding", [f"{name}t", "ids", "cos", "sin"], f"{name}r", domain=MS,
                       interleaved=interleaved)]
        if seq == 1:
            nodes.append(node("Reshape", [f"{name}r", "flat1"], f"{name}_flat"))
        else:
            nodes += [node("Transpose", [f"{name}r"], f"{name}rt", perm=[0, 2, 1, 3]),
                      node("Reshape", [f"{name}rt", "flat"], f"{name}_flat")]
    nodes += [node("Shape", ["kr"], "new_len", start=2, end=3), node("Shape", ["pk"], "past_len", start=2, end=3),
              node("Add", ["past_len", "new_len"], "len64"), node("Cast", ["len64"], "len", to=TensorProto.INT32),
              node("Shape", ["qr"], "batch", start=0, end=1), node("Sub", ["len", "one"], "last"),
              node("Expand", ["last", "batch"], "seqlens"), node("Reshape", ["len", "scalar"], "total"),
              node("Cast", ["attention_mask"], "keep", to=TensorProto.BOOL), node("Unsqueeze", ["keep", "ax12"], "keep4"),
              node("Where", ["keep4", "zero", "low"], "bias4")]
    if seq == 1:
        nodes.append(node("Identity", ["bias4"], "bias"))
    else:
        consts["rows"] = ints(1, 1, seq, 1)
        nodes.append(node("Expand", ["bias4", "rows"], "bias"))
    nodes += [node("GroupQueryAttention", ["q_flat", "k_flat", "v_flat", "pk", "pv", "seqlens", "total", "", "", "",
                                           "bias"], ["y", "present_k", "present_v"], domain=MS, num_heads=heads,
                   kv_num_heads=kv_heads, scale=float(size ** -0.5), causal=0)]
    shapes = {n: [{"b": 2, "p": 3, "t": 3 + (seq if isinstance(seq, int) else 1)}.get(d, d) if isinstance(d, str)
                  else d for d in spec[0]] for n, spec in inputs.items()}
    present = (elem, [batch, kv_heads, total, size])
    outputs = {"y": (elem, [batch, seq, heads * size]), "present_k": present, "present_v": present}
    return graph(nodes, inputs, outputs, consts=consts, opset=18,
                 input_shapes=shapes)


def _sizes(g: Graph, batch: int, past: int) -> dict[str, list[int]]:
    """The synthetic inputs' shapes at a batch and past length (a static batch or past given as it is)."""
    dims = {vi.name: [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
            for vi in g.interface[0]}
    seq = dims["x"][1]
    out = {"x": [batch, seq, dims["x"][2]], "position_ids": [dims["position_ids"][0] or batch, seq],
           "attention_mask": [batch, past + seq], "pk": [batch, dims["pk"][1], past, dims["pk"][3]]}
    out["pv"] = out["pk"]
    return out


def _agree(g: Graph, out: Graph, sizes, ids=None) -> None:
    """The outputs agree at `sizes` with each row's ids set (`ids`: a function of (batch, past) giving [B, S] ids)
    and the second row left-padded."""
    sessions = [ort.InferenceSession(m.to_model(static=False).SerializeToString(), providers=["CPUExecutionProvider"])
                for m in (g, out)]
    names = [o.name for o in sessions[0].get_outputs()]
    for shape in sizes:
        feeds = random_inputs(g.to_model(static=False), 3, shape)
        mask = feeds["attention_mask"]
        mask[:] = 1
        mask[1:, :2] = 0
        if ids is not None:
            feeds["position_ids"] = ids(*feeds["position_ids"].shape, mask.shape[1]).astype(np.int64)
        for name, a, b in zip(names, *(s.run(names, feeds) for s in sessions)):
            check = compare_arrays(name, a, b)
            assert check.ok, (shape, check)


def _left_padded(batch: int, seq: int, total: int) -> np.ndarray:
    """Row 0 at its end of the cache, row 1 two positions back (its first two keys padding), ..."""
    return np.stack([np.maximum(np.arange(total - seq, total) - 2 * min(r, 1), 0) for r in range(batch)])


def absorbed(g: Graph, sizes, names=(ROTARY, PACK), packed=True) -> Graph:
    """`g` with each of `names` applied at its match, checked and verified at `sizes`."""
    out = g
    for name in names:
        matches = rule(name).find(out)
        assert len(matches) == 1, (name, [m.reason for m in rule(name).reasons(out)])
        out = apply(out, matches[0])
    check_model(out.to_model(static=False))
    counts = out.op_counts()
    assert "RotaryEmbedding" not in counts and "Transpose" not in counts, counts
    assert counts["MatMul"] == (1 if packed else 3), counts
    gqa_node = next(n for n in out.gs.nodes if n.op == "GroupQueryAttention")
    assert gqa_node.attrs["do_rotary"] == 1 and (not packed or not gqa_node.inputs[1].name)
    result = verify(g.to_model(static=False), out.to_model(static=False), shapes=sizes)
    assert result.ok, result.message
    _agree(g, out, sizes, _left_padded)
    return out


CASES = {
    ROTARY: (lambda: gqa(batch=1), lambda: gqa(), "the cache may be empty with ids that differ between rows"),
    PACK: (lambda: apply(gqa(batch=1), rule(ROTARY).find(gqa(batch=1))[0]), lambda: gqa(batch=1),
           "not a private MatMul"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_refuses_with_reason(name):
    _, negative, reason = CASES[name]
    assert_refuses(negative(), name, reason)


@pytest.mark.parametrize("kwargs, batches", [
    (dict(batch=1), (1,)), (dict(batch=1, elem=F16), (1,)), (dict(shared=True), (2, 1)),
    (dict(shared=True, elem=F16, bias=True), (2, 1)), (dict(past=16), (2, 1)), (dict(past=16, elem=F16), (2,)),
    (dict(batch=1, past=5, seq=4), (1,)), (dict(batch=1, bias=True), (1,))])
def test_rotary_absorbed_and_packed(kwargs, batches):
    """One position at batch 1 (any past, 0 included), ids shared by the rows (any batch and past), a static cache
    (any batch, and several positions at batch 1); float16; biases."""
    g = gqa(**kwargs)
    pasts = [kwargs["past"]] if "past" in kwargs else [3, 16, 40, 0]
    absorbed(g, [_sizes(g, b, p) for b in batches for p in pasts])


def test_qwen3_norms_stay_and_the_query_is_not_packed():
    """onnxruntime's CPU kernel refuses q_norm_weight / k_norm_weight: the per-head norms stay, a Reshape brings the
    normalised heads to [B, S, heads * Dh], and packing is refused (the query is no projection)."""
    g = gqa(past=16, norm=True)
    out = absorbed(g, [_sizes(g, 2, 16), _sizes(g, 1, 16)], names=(ROTARY,), packed=False)
    assert out.op_counts()["SimplifiedLayerNormalization"] == 2
    assert any("not a private MatMul" in m.reason for m in rule(PACK).reasons(out))


@pytest.mark.parametrize("kwargs, reason", [
    (dict(), "the cache may be empty with ids that differ between rows"),
    (dict(batch=1, seq=4), "the cache may be empty"),
    (dict(batch=1, size=8, hidden=16), "a multiple of 8"),
    (dict(batch=1, interleaved=1), "interleaved")])
def test_rotary_refusals(kwargs, reason):
    """Per-row ids over a cache that may be empty (onnxruntime rotates a first prompt's keys at row 0's ids), several
    positions over such a cache, a table 4 wide (the kernel wants multiples of 8), an interleaved rotation."""
    g = gqa(**kwargs)
    assert not rule(ROTARY).find(g)
    assert any(reason in m.reason for m in rule(ROTARY).reasons(g)), [m.reason for m in rule(ROTARY).reasons(g)]


def test_pack_refuses_projections_of_two_inputs():
    g = apply(gqa(batch=1), rule(ROTARY).find(gqa(batch=1))[0])
    proto = g.to_model(static=False)
    proto.graph.input.append(onnx.helper.make_tensor_value_info("x2", TensorProto.FLOAT, [1, 1, 32]))
    next(n for n in proto.graph.node if n.output[0] == "v_mm").input[0] = "x2"
    g = Graph.from_model(proto, {**dict(g.input_shapes), "x2": [1, 1, 32]})
    assert not rule(PACK).find(g)
    assert any("not projections of one input" in m.reason for m in rule(PACK).reasons(g))


# ------------------------------------------------------------------------------------------ the exporters' forms
def _fixed(g: Graph, batch: int | None = None, past: int | None = None) -> Graph:
    """`g` with its dynamic batch or cache length made static at the given size (the mask and the presents follow)."""
    proto, shapes = g.to_model(static=False), {k: list(v) for k, v in g.input_shapes.items()}
    for vi in [*proto.graph.input, *proto.graph.output]:
        fixed = {0: batch}
        if past is not None and vi.name.startswith(("past", "present")):
            fixed[2] = past + vi.name.startswith("present")
        elif past is not None and vi.name == "attention_mask":
            fixed[1] = past + 1
        dims = vi.type.tensor_type.shape.dim
        for axis, size in fixed.items():
            if size is not None and axis < len(dims) and dims[axis].dim_param:
                dims[axis].ClearField("dim_param")
                dims[axis].dim_value = size
                if vi.name in shapes:
                    shapes[vi.name][axis] = size
    return Graph.from_model(proto, shapes)


def _all_fusions(g: Graph) -> Graph:
    return all_fusions(Candidate(g, (), g.fingerprint())).graph


def _check_step(g: Graph, llama: bool) -> None:
    """A decode step refused as exported (dynamic batch, cache maybe empty); at batch 1 the rotary goes into
    GroupQueryAttention (and Llama's projections into one MatMul), verified at past 3, 16 and 40; with a cache of static
    length 16, at batch 2 and 1 with per-row and left-padded ids."""
    fused = _all_fusions(g)
    assert fused.op_counts()["RotaryEmbedding"] == 4
    assert any("cache may be empty" in m.reason for m in rule(ROTARY).reasons(fused))
    for static, sizes in ((dict(batch=1), [_step_sizes(1, p) for p in (3, 16, 40)]),
                          (dict(past=16), [_step_sizes(2, 16), _step_sizes(1, 16)])):
        h = _fixed(g, **static)
        out = _all_fusions(h)
        counts = out.op_counts()
        assert "RotaryEmbedding" not in counts and counts["GroupQueryAttention"] == 2, counts
        assert counts["MatMul"] == fused.op_counts()["MatMul"] - (4 if llama else 0), counts
        assert sum(not n.inputs[1].name for n in out.gs.nodes if n.op == "GroupQueryAttention") == (2 if llama else 0)
        result = verify(h.to_model(static=False), out.to_model(static=False), shapes=sizes)
        assert result.ok, (static, result.message)
        _agree(h, out, sizes, _left_padded)


@pytest.mark.parametrize("name", ["llama-tiny-decode-p16-ts", "qwen3-tiny-decode-p16-ts",
                                  "qwen3-tiny-decode-p16-ts-fp16"])
def test_decode_steps_after_every_fusion(steps, name):  # noqa: F811 - the fixture
    """TorchScript's decode steps: Llama; Qwen3 with its per-head norms, float32 and float16 (`_check_step`)."""
    _check_step(_step(steps[name]), name.startswith("llama"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-tiny-decode-p16-dynamo", "qwen3-tiny-decode-p16-dynamo"])
def test_dynamo_decode_steps_after_every_fusion(tmp_path_factory, name):
    """The dynamo exporter's decode steps (about 30 s each to export), as `_check_step`."""
    pytest.importorskip("transformers")
    from rlflow import zoo

    _check_step(_step(zoo.build(name, tmp_path_factory.mktemp("dynamo")).path), name.startswith("llama"))


@pytest.mark.parametrize("name", ["llama-fp32-ts", "qwen3-fp16-ts", "decoders-dynamo"])
def test_one_token_prefills_of_both_exporters(decoder_exports, name):
    """The prefills of both exporters (no cache, ids computed from the sequence) at batch 1 and sequence 1: every
    rotary goes in; at a dynamic sequence, refused (a first prompt is rotated from position_ids[0, 0] + i)."""
    g, _ = _prefill(decoder_exports, name)
    assert not rule(ROTARY).find(_all_fusions(g))
    proto = g.to_model(static=False)
    for vi in [*proto.graph.input, *proto.graph.output]:
        for d in vi.type.tensor_type.shape.dim[:2]:
            d.ClearField("dim_param")
            d.dim_value = 1
    h = Graph.from_model(proto, {i.name: [1, 1] for i in proto.graph.input})
    out = _all_fusions(h)
    counts = out.op_counts()
    assert "RotaryEmbedding" not in counts and counts["GroupQueryAttention"] == 2, counts
    assert sum(n.attrs.get("do_rotary", 0) for n in out.gs.nodes if n.op == "GroupQueryAttention") == 2
    result = verify(h.to_model(static=True), out.to_model(static=True))
    assert result.ok, result.message

