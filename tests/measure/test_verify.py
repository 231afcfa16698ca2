"""Verification: equal models pass, different ones fail, integer inputs stay in range."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from rlflow.measure.inputs import index_bound, random_inputs
from rlflow.measure.verify import compare_arrays, default_tolerance, verify
from tests.conftest import tiny_model


def test_identical_models_verify(matmul_model):
    result = verify(matmul_model, matmul_model, shapes=[{"x": (1, 8)}, {"x": (3, 8)}])
    assert result.ok and result.max_rel_norm == 0.0 and len(result.shapes) == 2


def test_changed_weight_fails(matmul_model):
    changed = onnx.ModelProto()
    changed.CopyFrom(matmul_model)
    w = numpy_helper.to_array(changed.graph.initializer[0]).copy()
    w[0, 0] += 0.5
    changed.graph.initializer[0].CopyFrom(numpy_helper.from_array(w, "W"))
    result = verify(matmul_model, changed)
    assert not result.ok and "relative error" in result.message
    assert result.outputs[0].max_abs > 0


def test_missing_output_fails(matmul_model):
    renamed = onnx.ModelProto()
    renamed.CopyFrom(matmul_model)
    renamed.graph.node[-1].output[0] = "z"
    renamed.graph.output[0].name = "z"
    result = verify(matmul_model, renamed)
    assert not result.ok and "lacks output" in result.message


def test_token_ids_stay_below_the_table_size():
    table = numpy_helper.from_array(np.zeros((7, 4), np.float32), "emb")
    model = tiny_model([helper.make_node("Cast", ["ids"], ["ids64"], to=TensorProto.INT64),
                        helper.make_node("Gather", ["emb", "ids64"], ["y"])],
                       [helper.make_tensor_value_info("ids", TensorProto.INT32, [1, 50])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 50, 4])], [table])
    assert index_bound(model, "ids") == 7
    feeds = random_inputs(model, seed=3)
    assert feeds["ids"].dtype == np.int32 and 0 <= feeds["ids"].min() and feeds["ids"].max() < 7
    assert verify(model, model).ok


def test_ids_of_a_fused_embedding_stay_below_their_own_tables():
    """EmbedLayerNormalization's ids index its word, segment and position tables (RoBERTa's segment table has one
    row: ids of 1 made the cost model's group measurement fail)."""
    tables = [numpy_helper.from_array(np.zeros((rows, 4), np.float32), name)
              for name, rows in (("word", 50), ("position", 9), ("segment", 1))]
    norm = [numpy_helper.from_array(np.ones(4, np.float32), "gamma"), numpy_helper.from_array(np.zeros(4, np.float32),
                                                                                              "beta")]
    node = helper.make_node("EmbedLayerNormalization", ["ids", "segments", "word", "position", "segment", "gamma",
                                                        "beta", "", "positions"], ["y", "mask_index"],
                            domain="com.microsoft")
    ints = [helper.make_tensor_value_info(n, TensorProto.INT32, [1, 8]) for n in ("ids", "segments", "positions")]
    model = tiny_model([node], ints, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 4])],
                       tables + norm)
    assert [index_bound(model, n) for n in ("ids", "segments", "positions")] == [50, 1, 9]


def test_tolerances_and_comparisons():
    assert default_tolerance(np.float32) == 1e-4 and default_tolerance(np.float16) == 1e-2
    assert default_tolerance(np.int64) == 0.0
    a = np.array([1.0, np.nan, 3.0], np.float32)
    assert compare_arrays("a", a, a.copy()).ok
    assert not compare_arrays("a", a, np.array([1.0, 2.0, 3.0], np.float32)).ok
    assert not compare_arrays("i", np.array([1, 2]), np.array([1, 3])).ok
    assert not compare_arrays("s", np.zeros(3), np.zeros(4)).ok


def _cached_step() -> onnx.ModelProto:
    """A decode step's binding: the mask spans the cache and the new tokens, so its length is theirs summed."""
    f = TensorProto.FLOAT
    return tiny_model([helper.make_node("Concat", ["past", "new"], ["all"], axis=1),
                       helper.make_node("Add", ["all", "mask"], ["y"])],
                      [helper.make_tensor_value_info("past", f, ["batch", "past_sequence"]),
                       helper.make_tensor_value_info("new", f, ["batch", "sequence"]),
                       helper.make_tensor_value_info("mask", f, ["batch", "total_sequence"])],
                      [helper.make_tensor_value_info("y", f, ["batch", "total_sequence"])])


def test_shapes_the_reference_cannot_run_fall_back_or_are_skipped():
    """Every dynamic dimension changed apart gives a decode step inputs it cannot run (a cache of 4, 2 new tokens, a
    mask of 5): verification then checks the fallback (batch changed alone), or records the set as skipped; the
    first set must run, since a reference that fails at its own shapes is the input's failure."""
    step = _cached_step()
    fixed = {"past": (1, 3), "new": (1, 1), "mask": (1, 4)}
    apart = {"past": (2, 4), "new": (2, 2), "mask": (2, 5)}
    batch = {"past": (2, 3), "new": (2, 1), "mask": (2, 4)}
    checked = verify(step, step, shapes=[fixed, apart], fallback=batch)
    assert checked.ok and checked.shapes == [fixed, batch] and "skipped_shapes" not in checked.extra
    skipped = verify(step, step, shapes=[fixed, apart])
    assert skipped.ok and skipped.shapes == [fixed] and skipped.extra["skipped_shapes"] == [apart]
    with pytest.raises(Exception, match="Concat|Add|shape|dimension"):
        verify(step, step, shapes=[apart, fixed], fallback=batch)


def test_the_fallback_changes_the_leading_dynamic_dimensions_only():
    from rlflow.graph.core import Graph
    from rlflow.optimize.pipeline import batch_changed_shapes, verification_shapes

    graph = Graph.from_model(_cached_step(), {"past": (1, 3), "new": (1, 1), "mask": (1, 4)})
    assert verification_shapes(graph)[1] == {"past": (2, 4), "new": (2, 2), "mask": (2, 5)}
    assert batch_changed_shapes(graph) == {"past": (2, 3), "new": (2, 1), "mask": (2, 4)}
