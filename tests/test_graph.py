"""The graph layer: loading models as found in the wild, shapes, fingerprints, saving."""
from __future__ import annotations

import logging

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import rlflow
from rlflow.errors import InputError
from rlflow.graph import model_file
from rlflow.graph.core import Graph, load
from rlflow.graph.input_repairs import MIN_OPSET
from rlflow.graph.input_shapes import DEPLOYED_SHAPES_KEY, parse_input_shapes
from rlflow.graph.model_file import max_ir_version
from rlflow.measure.verify import verify
from tests.conftest import save, tiny_model


def test_dynamic_dimension_defaults_to_one_with_warning(tmp_path, matmul_model, caplog):
    path = save(matmul_model, tmp_path / "m.onnx")
    with caplog.at_level(logging.WARNING, logger="rlflow"):
        graph = load(path)
    assert graph.input_shapes == {"x": (1, 8)}
    assert "dynamic" in caplog.text and "--input-shape x:" in caplog.text
    assert all(graph.shape(t) is not None for t in graph.gs.tensors().values())


def test_deployed_shapes_in_the_metadata_fix_dynamic_dimensions(tmp_path, matmul_model, caplog):
    """The zoo's deployment exports say their shape in metadata; --input-shape still wins, bad metadata is ignored."""
    for value, given, expected in (("x:4,8", None, (4, 8)), ("x:4,8", {"x": (2, 8)}, (2, 8)),
                                   ("x:four", None, (1, 8)), ("y:3,3;x:6,8", None, (6, 8))):
        model = onnx.ModelProto()
        model.CopyFrom(matmul_model)
        helper.set_model_props(model, {DEPLOYED_SHAPES_KEY: value})
        with caplog.at_level(logging.WARNING, logger="rlflow"):
            graph = load(save(model, tmp_path / "m.onnx"), given)
        assert graph.input_shapes == {"x": expected}, value
        written = graph.to_model(static=False)
        assert written.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"  # still dynamic
    assert "ignoring metadata rlflow.input_shapes='x:four'" in caplog.text


def test_input_shape_fixes_dimensions_and_output_stays_dynamic(tmp_path, matmul_model):
    graph = load(save(matmul_model, tmp_path / "m.onnx"), {"x": (5, 8)})
    assert graph.input_shapes == {"x": (5, 8)}
    assert graph.shape(graph.tensor_map()["h"]) == (5, 4)
    written = graph.to_model(static=False)
    dims = written.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "batch" and dims[1].dim_value == 8
    assert written.graph.output[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    session = ort.InferenceSession(written.SerializeToString(), providers=["CPUExecutionProvider"])
    assert session.run(None, {"x": np.ones((3, 8), np.float32)})[0].shape == (3, 4)


@pytest.mark.parametrize("shapes, message", [
    ({"nope": (1, 8)}, "unknown input"),
    ({"x": (1, 8, 1)}, "has 3 dimensions"),
    ({"x": (1, 9)}, "fixed to 8"),
])
def test_bad_input_shapes(tmp_path, matmul_model, shapes, message):
    with pytest.raises(InputError, match=message):
        load(save(matmul_model, tmp_path / "m.onnx"), shapes)


def test_parse_input_shapes():
    assert parse_input_shapes(["x:1,3,224,224", "ids:1,128"]) == {"x": (1, 3, 224, 224), "ids": (1, 128)}
    for bad in ["x", "x:1,a", ":1", "x:0,2"]:
        with pytest.raises(InputError, match="bad --input-shape"):
            parse_input_shapes([bad])


def test_constant_nodes_become_constants_and_unused_inputs_are_kept(tmp_path):
    rng = np.random.default_rng(1)
    weight = helper.make_tensor("wv", TensorProto.FLOAT, [4, 4], rng.standard_normal(16).astype(np.float32))
    model = tiny_model(
        [helper.make_node("Constant", [], ["w"], value=weight), helper.make_node("MatMul", ["x", "w"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
         helper.make_tensor_value_info("unused", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    graph = load(save(model, tmp_path / "c.onnx"))
    assert graph.op_counts() == {"MatMul": 1}
    assert [t.name for t in graph.gs.inputs] == ["x", "unused"]
    assert verify(model, graph.to_model(static=False)).ok


def test_ir3_opset9_model_with_initializers_as_inputs(cnn_opset9_ir3_path):
    raw = onnx.load(cnn_opset9_ir3_path)
    assert raw.ir_version == 3 and len(raw.graph.input) > 1
    graph = load(cnn_opset9_ir3_path)
    assert graph.opset >= MIN_OPSET
    written = graph.to_model(static=False)
    assert [i.name for i in written.graph.input] == ["image"]
    assert written.ir_version == max_ir_version()
    assert verify(raw, written).ok


def test_fingerprint_ignores_names_and_sees_structure(tmp_path, matmul_model):
    graph = load(save(matmul_model, tmp_path / "m.onnx"))
    renamed = onnx.ModelProto()
    renamed.CopyFrom(matmul_model)
    mapping = {"h": "hidden", "a": "act", "W": "weight"}
    for node in renamed.graph.node:
        node.name = "n_" + node.name
        node.input[:] = [mapping.get(i, i) for i in node.input]
        node.output[:] = [mapping.get(o, o) for o in node.output]
    for init in renamed.graph.initializer:
        init.name = mapping.get(init.name, init.name)
    other = Graph.from_model(renamed)
    assert graph.fingerprint() == other.fingerprint()
    changed = onnx.ModelProto()
    changed.CopyFrom(matmul_model)
    changed.graph.node[2].op_type = "Sigmoid"
    assert Graph.from_model(changed).fingerprint() != graph.fingerprint()
    swapped = onnx.ModelProto()
    swapped.CopyFrom(matmul_model)
    swapped.graph.node[1].input[:] = ["b", "h"]  # Add is commutative
    assert Graph.from_model(swapped).fingerprint() == graph.fingerprint()


def test_clone_is_independent(tmp_path, matmul_model):
    graph = load(save(matmul_model, tmp_path / "m.onnx"))
    before = graph.fingerprint()
    clone = graph.clone()
    clone.gs.nodes[-1].op = "Sigmoid"
    assert graph.fingerprint() == before != clone.fingerprint()


@pytest.mark.parametrize("export", ["bert-tiny-dynamo.onnx", "gpt2-tiny-decode-ts.onnx"])
def test_copy_graph_copies_what_gs_copies_and_shares_only_arrays(export):
    """`copy_graph` (the clone every rewrite starts from) must be `gs.Graph.copy`'s copy, only quicker: the same model
    when exported, no node or tensor shared with the original, both ends of every edge linked, arrays shared."""
    import onnx_graphsurgeon as gs

    from rlflow.graph.copy_and_sort import copy_graph

    graph = load(f"tests/fixtures/exports/{export}")
    original = graph.gs
    copy = copy_graph(original)
    assert (gs.export_onnx(copy, do_type_check=False).graph.SerializeToString()
            == gs.export_onnx(original.copy(), do_type_check=False).graph.SerializeToString())
    old = {id(n) for n in original.nodes} | {id(t) for t in original.tensors().values()}
    assert not old & ({id(n) for n in copy.nodes} | {id(t) for t in copy.tensors().values()})
    for node in copy.nodes:
        assert all(any(c is node for c in t.outputs) for t in node.inputs)
        assert all(any(p is node for p in t.inputs) for t in node.outputs)
    for tensor in copy.tensors().values():
        assert all(any(t is tensor for t in n.inputs) for n in tensor.outputs)
    constants = {n: t for n, t in original.tensors().items() if isinstance(t, gs.Constant)}
    assert constants and all(copy.tensors()[n].values is t.values for n, t in constants.items())
    assert copy.functions is not original.functions  # gs's setter edits the list in place: the copy owns its own
    copy.nodes[0].inputs[0] = gs.Variable("elsewhere")  # editing the copy leaves the original as it was
    assert graph.fingerprint() == load(f"tests/fixtures/exports/{export}").fingerprint()


@pytest.mark.parametrize("export", ["bert-tiny-torchscript.onnx", "gpt2-tiny-prefill-dynamo.onnx"])
def test_toposort_orders_nodes_as_gs_does(export):
    """The agent's observations list nodes in sorted order, so `toposort` must give gs's order, not just a valid one:
    from the same shuffled order, on the export and on graphs a few rewrites away from it."""
    import random

    from rlflow.graph.copy_and_sort import toposort
    from rlflow.rewrites import apply, find_matches

    rng = random.Random(0)
    graphs = [load(f"tests/fixtures/exports/{export}")]
    for _ in range(4):
        graphs.append(apply(graphs[-1], rng.choice(find_matches(graphs[-1]))))
    for graph in graphs:
        ours, theirs = graph.clone(), graph.clone()
        rng.shuffle(ours.gs.nodes)
        theirs.gs.nodes = list(ours.gs.nodes)
        shuffled = [n.name for n in ours.gs.nodes]
        toposort(ours.gs)
        theirs.gs.toposort()
        assert [n.name for n in ours.gs.nodes] == [n.name for n in theirs.gs.nodes] != shuffled


def test_copy_graph_leaves_subgraphs_to_gs():
    """If, Loop and Scan bodies read tensors from the graph around them, which gs's own copy maps."""
    import onnx_graphsurgeon as gs

    from rlflow.graph.copy_and_sort import copy_graph

    then_g = helper.make_graph([helper.make_node("Relu", ["x"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2])])
    else_g = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2])])
    model = tiny_model([helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)],
                       [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                        helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    original = gs.import_onnx(model)
    copy = copy_graph(original)
    body = copy.nodes[0].attrs["then_branch"]
    assert body is not original.nodes[0].attrs["then_branch"]
    assert body.nodes[0].inputs[0] is copy.inputs[1]  # the body reads the copy's x, not the original's


def test_save_is_atomic_and_uses_accepted_ir(tmp_path, matmul_model):
    graph = load(save(matmul_model, tmp_path / "m.onnx"))
    out = graph.save(tmp_path / "out" / "m2.onnx")
    assert sorted(p.name for p in out.parent.iterdir()) == ["m2.onnx"]
    assert onnx.load(str(out)).ir_version == max_ir_version()
    ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])


def test_external_data_load_and_save(tmp_path, monkeypatch):
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32), "W")
    matmul_model = tiny_model([helper.make_node("MatMul", ["x", "W"], ["y"])],
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])], [weight])
    path = tmp_path / "ext.onnx"
    external = onnx.ModelProto()
    external.CopyFrom(matmul_model)  # save_model moves the weights of the proto it is given out of it
    onnx.save_model(external, str(path), save_as_external_data=True, location="ext.onnx.data", size_threshold=0)
    graph = load(path)
    assert graph.op_counts()["MatMul"] == 1
    monkeypatch.setattr(model_file, "EXTERNAL_DATA_THRESHOLD", 10)  # as if the weights exceeded 2 GB
    out = graph.save(tmp_path / "out" / "big.onnx")
    assert sorted(p.name for p in out.parent.iterdir()) == ["big.onnx", "big.onnx.data"]
    reloaded = onnx.load(str(out))
    assert verify(matmul_model, reloaded).ok


def test_checker_rejection_is_an_input_error(tmp_path, matmul_model):
    bad = onnx.ModelProto()
    bad.CopyFrom(matmul_model)
    bad.graph.node[0].input[1] = "missing_tensor"
    with pytest.raises(InputError, match="onnx checker rejects"):
        load(save(bad, tmp_path / "bad.onnx"))


@pytest.mark.parametrize("content, message", [
    (None, "no such file"), (b"", "empty file"), (b"hello, I am not a model" * 10, "not an ONNX model"),
])
def test_unreadable_files(tmp_path, content, message):
    path = tmp_path / "x.onnx"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(InputError, match=message):
        load(path)


def test_directory_is_rejected(tmp_path):
    with pytest.raises(InputError, match="is a directory"):
        load(tmp_path)


def test_public_api():
    assert callable(rlflow.optimize) and callable(rlflow.load) and rlflow.Options().method is None
    assert max_ir_version() >= 7


def test_shapes_computed_from_the_inputs_shape_are_known_at_the_fixed_shape():
    """Exporters slice position tables by `Shape` of the inputs; onnx's inference loses that, the symbolic pass not."""
    from onnx import TensorProto, helper, numpy_helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s"])
    weights = [numpy_helper.from_array(np.arange(512, dtype=np.int64).reshape(1, 512), "positions"),
               numpy_helper.from_array(np.array(1, dtype=np.int64), "one"),
               numpy_helper.from_array(np.array([0], dtype=np.int64), "zero"),
               numpy_helper.from_array(np.array([1], dtype=np.int64), "axis")]
    nodes = [helper.make_node("Shape", ["x"], ["shape"]), helper.make_node("Gather", ["shape", "one"], ["s"]),
             helper.make_node("Unsqueeze", ["s", "zero"], ["end"]),
             helper.make_node("Slice", ["positions", "zero", "end", "axis"], ["pos"]),
             helper.make_node("Cast", ["pos"], ["posf"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["x", "posf"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "positions", [x], [y], initializer=weights),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    graph = Graph.from_model(model, {"x": (1, 16)})
    tensors = graph.gs.tensors()
    assert [graph.shape(tensors[n]) for n in ("pos", "posf", "y")] == [(1, 16)] * 3
    assert graph.to_model(static=False).graph.output[0].type.tensor_type.shape.dim[1].dim_param == "s"  # still dynamic


def test_symbolic_shape_inference_does_not_import_torch():
    """onnxruntime's `tools` package imports torch where it is installed (a second of every greedy run); rlflow loads
    the one module it needs without it."""
    import subprocess
    import sys

    code = ("import sys; from rlflow.graph.shape_inference import symbolic_shapes\n"
            "from onnx import TensorProto, helper\n"
            "x = helper.make_tensor_value_info('x', TensorProto.FLOAT, ['b', 4])\n"
            "g = helper.make_graph([helper.make_node('Relu', ['x'], ['y'])], 'g', [x], "
            "[helper.make_empty_tensor_value_info('y')])\n"
            "m = symbolic_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid('', 17)], ir_version=8))\n"
            "print([d.dim_param or d.dim_value for d in m.graph.output[0].type.tensor_type.shape.dim], "
            "'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["['b',", "4]", "False"]


def test_shape_inference_that_cannot_finish_writes_nothing_and_keeps_what_it_found(tmp_path, monkeypatch):
    """onnxruntime's symbolic inference saves `sym_shape_infer_temp.onnx` in the working directory when it cannot
    finish; loading a model must never write there."""
    from onnx import TensorProto, helper

    monkeypatch.chdir(tmp_path)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Mystery", ["r"], ["q"], domain="com.example"),
             helper.make_node("Relu", ["q"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), ir_version=8,
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    graph = Graph.from_model(model, {"x": (2, 4)}, checked=True)
    tensors = graph.gs.tensors()
    assert graph.shape(tensors["r"]) == (2, 4) and graph.shape(tensors["q"]) is None
    assert list(tmp_path.iterdir()) == []


def test_a_model_holding_onnxruntimes_default_domain_rmsnorm_loads_and_keeps_its_shapes(tmp_path):
    """rlflow's rmsnorm-fusion (and onnxruntime's transformers optimizer) write `SimplifiedLayerNormalization` in the
    default domain, where onnxruntime registers it and the onnx checker knows no such operator: such a model loads,
    is labelled onnxruntime-only, and the cost model's shape inference sees through it."""
    from onnx import TensorProto, helper

    from rlflow.measure.costmodel.group_shapes import complete_shapes
    from rlflow.optimize.result import runtimes

    norm = helper.make_node("SimplifiedLayerNormalization", ["x", "w"], ["n"], axis=-1, epsilon=1e-5)
    graph = helper.make_graph([norm, helper.make_node("Relu", ["n"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8])],
                              [numpy_helper.from_array(np.ones(8, np.float32), "w")])
    path = tmp_path / "rms.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), str(path))
    loaded = rlflow.load(path)
    assert loaded.op_counts() == {"SimplifiedLayerNormalization": 1, "Relu": 1}
    assert runtimes(loaded).startswith("onnxruntime only")
    assert complete_shapes(loaded)["n"][0] == (1, 4, 8)
