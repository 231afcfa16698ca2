"""Cost tables that travel (`rlflow.measure.costmodel.merge`, `rlflow.cluster.travel`): one measurement per group,
gains read back from a cache, models packed with their external data.  No Ray needed."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from rlflow.cluster.travel import TableMerger, check_fits, pack_model, travel_size
from rlflow.errors import RlflowError
from rlflow.measure.costmodel.merge import added_since, merge_file, merge_into, snapshot
from rlflow.measure.costmodel.table import empty_table, table_file_name, write_table

KEY = {"machine": "test x2", "version": 4}


def _table(costs: dict) -> dict:
    table = empty_table(KEY)
    table["costs"] = dict(costs)
    table["groups"] = {f"g{k}": k for k in costs}
    return table


def test_a_merge_keeps_the_measurement_the_table_has_and_adds_what_it_lacks():
    table = _table({"a": 1.0})
    count = merge_into(table, _table({"a": 9.0, "b": 2.0}))
    assert table["costs"] == {"a": 1.0, "b": 2.0} and table["groups"]["gb"] == "b"
    assert (count.added, count.measured_again) == (1, 1)


def test_a_cache_gives_back_what_was_added_since_its_snapshot(tmp_path):
    name = table_file_name(KEY)
    write_table(tmp_path / name, _table({"a": 1.0}))
    before = snapshot(tmp_path)
    assert added_since(tmp_path, before) == {}
    merge_file(tmp_path, name, _table({"b": 2.0}))
    gained = added_since(tmp_path, before)
    assert list(gained) == [name] and gained[name]["costs"] == {"b": 2.0} and gained[name]["key"] == KEY


def test_merge_file_creates_the_table_and_starts_over_under_another_key(tmp_path):
    name = table_file_name(KEY)
    merge_file(tmp_path, name, _table({"a": 1.0}))
    assert json.loads((tmp_path / name).read_text())["costs"] == {"a": 1.0}
    newer = {**_table({"b": 2.0}), "key": {**KEY, "version": 5}}
    merge_file(tmp_path, name, newer)
    assert json.loads((tmp_path / name).read_text())["costs"] == {"b": 2.0}


def test_the_driver_counts_per_node_even_where_it_shares_the_nodes_cache(tmp_path):
    name = table_file_name(KEY)
    write_table(tmp_path / name, _table({"old": 1.0}))
    merger = TableMerger(tmp_path)
    merge_file(tmp_path, name, _table({"new": 2.0}))  # a node on this machine wrote straight into the same cache
    first = merger.merge("n1", {"installed": 1, "added": {name: _table({"new": 2.0})}})
    second = merger.merge("n2", {"added": {name: _table({"new": 2.5, "old": 1.1})}})
    assert first == {"installed": 1, "added": 1, "known_before": 0, "measured_twice": 0}
    assert second == {"installed": 0, "added": 0, "known_before": 1, "measured_twice": 1}
    assert json.loads((tmp_path / name).read_text())["costs"] == {"old": 1.0, "new": 2.0}
    assert merger.summary()["per_node"]["n1"]["tasks"] == 1


def _with_external_data(folder, location="weights/w.bin"):
    w = numpy_helper.from_array(np.ones((64, 64), np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    path = folder / "m.onnx"
    (folder / location).parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path), save_as_external_data=True, location=location, size_threshold=0)
    (folder / "m.json").write_text("{}")
    return path


def test_a_model_travels_with_its_external_data_and_its_json(tmp_path):
    parcel = pack_model(_with_external_data(tmp_path))
    assert sorted(parcel.files) == ["m.json", "m.onnx", "weights/w.bin"]
    copy = parcel.unpack(tmp_path / "there")
    loaded = onnx.load(str(copy))
    assert numpy_helper.to_array(loaded.graph.initializer[0]).sum() == 64 * 64


def test_external_data_outside_the_models_folder_cannot_travel(tmp_path):
    (tmp_path / "sub").mkdir()
    path = _with_external_data(tmp_path / "sub")
    model = onnx.load(str(path), load_external_data=False)
    for entry in model.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = "../w.bin"
    onnx.save(model, str(path))
    with pytest.raises(RlflowError, match="outside the model's folder"):
        pack_model(path)


def test_a_model_larger_than_the_object_store_is_refused_naming_the_limit(tmp_path):
    path = _with_external_data(tmp_path)
    assert travel_size(path) == sum(len(d) for d in pack_model(path).files.values())
    with pytest.raises(RlflowError, match=r"big\.onnx: 2 MiB .* \(1 MiB on this node\)"):
        check_fits({"big.onnx": 2 * 2**20}, 2**20)
    check_fits({"big.onnx": 2 * 2**20}, None)


def test_a_file_that_is_no_model_travels_as_it_is_to_fail_there_as_here(tmp_path):
    (tmp_path / "notes.onnx").write_text("not a model")
    assert pack_model(tmp_path / "notes.onnx").files == {"notes.onnx": b"not a model"}
