"""The cost-table audit: it finds a corrupted entry, leaves the table alone unless asked to refresh it, and refuses bad
input in one line."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from rlflow.cli import main
from rlflow.graph.core import Graph
from rlflow.measure.costmodel.audit import GroupAudit, audit_graphs, refresh, summary
from rlflow.measure.costmodel.model import CostModel


def _graph() -> Graph:
    """x @ W -> Relu -> Transpose: a couple of fusion groups to measure."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32), "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"), helper.make_node("Relu", ["m"], ["r"]),
             helper.make_node("Transpose", ["r"], ["y"], perm=[1, 0])]
    graph = helper.make_graph(nodes, "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 16])], initializer=[w])
    return Graph.from_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))


def test_a_corrupted_entry_is_flagged_and_the_table_is_left_alone(tmp_path):
    """An entry set a thousand times too high disagrees with its new measurements; the table on disk and in memory
    keeps every cost it had."""
    cost_model, graph = CostModel(cache_dir=tmp_path), _graph()
    cost_model.graph_cost(graph)
    key = max(cost_model.table["costs"], key=lambda k: cost_model.table["costs"][k] if k.startswith("o:") else 0)
    cost_model.table["costs"][key] = 1000.0
    cost_model.save()
    before, on_disk = dict(cost_model.table["costs"]), cost_model.path.read_text()
    audits = audit_graphs(cost_model, [graph, graph], repeats=2)
    assert len({a.key for a in audits}) == len(audits)  # each entry once, however many graphs use it
    flagged = summary(audits)["disagreeing_entries"]
    assert [row["key"] for row in flagged][:1] == [key] and all(len(a.fresh_ms) == 2 for a in audits)
    assert cost_model.table["costs"] == before and cost_model.path.read_text() == on_disk


def test_refresh_puts_the_new_measurements_in_place_of_a_corrupted_entry(tmp_path):
    """The corrupted entry (1000 ms) is replaced, on disk too, by the median of its new measurements; every audited
    entry is rewritten, and a cost key the table lacks is refused."""
    cost_model, graph = CostModel(cache_dir=tmp_path), _graph()
    cost_model.graph_cost(graph)
    key = max(cost_model.table["costs"], key=lambda k: cost_model.table["costs"][k] if k.startswith("o:") else 0)
    cost_model.table["costs"][key] = 1000.0
    cost_model.save()
    audits = audit_graphs(cost_model, [graph], repeats=2)
    assert refresh(cost_model, audits) == len(audits) >= 1
    fresh = {a.key: a.fresh_median_ms for a in audits}
    on_disk = json.loads(cost_model.path.read_text())["costs"]
    assert on_disk[key] == pytest.approx(fresh[key]) and on_disk[key] < 1.0
    assert CostModel(cache_dir=tmp_path).graph_cost(graph) < 1.0
    with pytest.raises(KeyError):
        cost_model.set_cost("no such key", 1.0)


def test_disagreement_needs_both_the_factor_and_the_floor():
    assert GroupAudit("k", "Relu", 0.030, [0.007, 0.008, 0.0081]).disagrees()
    assert not GroupAudit("k", "Relu", 0.003, [0.001, 0.001, 0.001]).disagrees()  # 3x, but 2 us apart
    assert not GroupAudit("k", "Relu", 0.030, [0.020, 0.021, 0.019]).disagrees()  # 10 us apart, but 1.5x
    assert not GroupAudit("k", "Relu", None, [0.02]).disagrees()  # never cached


def test_the_summary_gives_how_far_cached_and_new_costs_are_apart():
    audits = [GroupAudit("a", "Relu", 0.010, [0.010]), GroupAudit("b", "Relu", 0.010, [0.020, 0.020]),
              GroupAudit("c", "Relu", 0.040, [0.010]), GroupAudit("d", "Relu", None, [0.5])]
    result = summary(audits)
    assert result["cached"] == 3 and result["ratio_median"] == 2.0
    assert 2.0 < result["ratio_p90"] <= 4.0
    assert result["cached_over_new_geomean"] == pytest.approx(2 ** (1 / 3))  # (1 * 0.5 * 4) ** (1 / 3)
    assert result["cached_above_new"] == pytest.approx(1 / 3)


def test_a_missing_model_is_one_line_and_exit_2(tmp_path, capsys):
    code = main(["costmodel", "audit", str(tmp_path / "missing.onnx"), "--cache-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ")


def test_the_command_writes_its_report(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(_graph().to_model(), str(path))
    out = tmp_path / "audit.json"
    assert main(["costmodel", "audit", str(path), "--sequences", "2", "--length", "2", "--repeats", "1",
                 "--cache-dir", str(tmp_path), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["command"] == (f"rlflow costmodel audit {path} --sequences 2 --length 2 --repeats 1 --cache-dir "
                                 f"{tmp_path} --out {out}")
    assert report["models"]["m"]["graphs"] >= 1 and report["models"]["m"]["disagreeing"] >= 0
    assert "| m |" in out.with_suffix(".md").read_text()
