"""`rlflow bench`: every output file, failures reported per row, settings recorded."""
from __future__ import annotations

import csv
import json
import os
import subprocess
from pathlib import Path

import pytest

import rlflow
from rlflow.bench.peers import PEERS
from rlflow.bench.results import _device_lines, _outcome_lines, markdown_table, outcome
from rlflow.bench.run import find_models
from rlflow.cli import main
from rlflow.errors import RlflowError
from tests.conftest import save, with_op


def test_bench_writes_every_report(tmp_path, matmul_model, cnn_opset9_ir3_path, capsys):
    models = tmp_path / "models"
    models.mkdir()
    save(matmul_model, models / "nasrnn.onnx")  # named after an architecture the shipped agent never trained on
    # named after an architecture it trained on (its -tiny version)
    (models / "resnet-18.onnx").write_bytes(open(cnn_opset9_ir3_path, "rb").read())
    (models / "broken.onnx").write_bytes(b"not a model")
    out = tmp_path / "results"
    from rlflow.search.agent import DEFAULT_AGENT

    code = main(["bench", str(models), "--methods", "greedy,agent", "--peers", "--time-limit", "2", "--rounds", "5",
                 "--agent", str(DEFAULT_AGENT), "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["results.csv", "results.json", "results.md", "speedup.png",
                                                     "time.png"]
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["threads"] == 1 and results["config"]["time_limit"] == 2
    assert results["config"]["agent"] == str(DEFAULT_AGENT)  # held out below: from the agent's own default.json
    import hashlib

    assert results["agent"] == {"path": "rlflow/checkpoints/default.pt",
                                "sha256": hashlib.sha256(DEFAULT_AGENT.read_bytes()).hexdigest()}
    assert results["heldout_from"] == "rlflow/checkpoints/default.json"  # the playing agent's, named in the page
    assert f"Method agent: `rlflow/checkpoints/default.pt` (SHA-256 {results['agent']['sha256'][:16]})" in (
        out / "results.md").read_text()
    assert results["peak"]["gflops"] > 0 and results["peak"]["gbs"] > 0 and results["environment"]["onnxruntime"]
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                          cwd=Path(rlflow.__file__).parent)
    if head.returncode == 0:  # a checkout: the results say which commit made them
        assert results["environment"]["commit"].split("-")[0] == head.stdout.strip()
    assert sorted(results["cost_table_warmup_seconds"]) == ["nasrnn", "resnet-18"]
    rows = {(r["model"], r["method"]): r for r in results["rows"]}
    assert len(rows) == 3 * 8  # 3 models x (greedy + agent + 6 peers)
    assert all(r["status"] == "failed" and "load" in r["error"] for (m, _), r in rows.items() if m == "broken")
    trained = {m.removesuffix("-tiny") for m in json.loads(DEFAULT_AGENT.with_suffix(".json").read_text())["trained_on"]}
    for model in ("nasrnn", "resnet-18"):
        for method in ("greedy", "agent"):
            row = rows[(model, method)]
            assert row["status"] == "ok" and row["verified"], row
            assert row["speedup_low"] <= row["speedup"] <= row["speedup_high"]
            assert row["bytes_read"] > 0 and 0 < row["memory_fraction"] < 10  # the second roof, beside `peak`
            assert row["flops"] > 0 and 0 < row["peak_fraction"] and row["search_seconds"] <= row["seconds"]
            assert row["heldout"] == (model not in trained)  # the shipped agent's own training list says
            assert row["outcome"] in ("rewritten", "gate rejected", "not verified", "out of time", "nothing found"), \
                row["reason"]
            assert row["search_stop"]  # why the search ended, also where a rewrite was kept
        for peer in ("onnxsim", "onnxoptimizer", "onnxslim", "onnxscript", "onnxscript-ort"):
            assert rows[(model, peer)]["status"] in ("ok", "failed", "wrong output")
        # zoo names: an rnn and a cnn, which onnxruntime's transformers optimizer is not for
        assert rows[(model, "ort-transformers")]["status"] == "not applicable"
    with open(out / "results.csv") as handle:
        assert len(list(csv.DictReader(handle))) == 24
    table = (out / "results.md").read_text()
    mark = {model: " †" if model not in trained else "" for model in ("nasrnn", "resnet-18")}  # † marks held out
    assert f"| nasrnn{mark['nasrnn']} | greedy | ok |" in table and "1 thread(s)" in table
    assert f"| resnet-18{mark['resnet-18']} | agent | ok |" in table
    summary = results["summary"]
    assert summary["agent"]["all"]["models"] == 2 and summary["agent"]["heldout"]["models"] == sum(
        model not in trained for model in ("nasrnn", "resnet-18"))
    assert summary["greedy"]["all"]["geomean_speedup"] > 0 and "## Per method" in table
    assert "## What each search's rewrite came to" in table and "| greedy |" in table.split("came to")[1]


def _row(method, result_outcome, gate=float("nan"), kind="rlflow"):
    return {"model": "m", "method": method, "kind": kind, "outcome": result_outcome, "gate_speedup": gate}


def test_outcomes_say_why_an_input_was_kept():
    rows = [_row("taso", "rewritten", gate=1.05), _row("taso", "gate rejected", gate=0.998),
            _row("taso", "not verified"), _row("agent", "nothing found"), _row("agent", "out of time"),
            _row("random", "not verified"), _row("onnxsim", "", kind="peer")]
    assert [outcome(r) for r in rows] == ["rewritten", "gate rejected", "not verified", "nothing found",
                                          "out of time", "not verified", ""]
    lines = _outcome_lines(rows)
    assert "| taso | 1 | 1: m (0.998) | 1 | 0 | 0 |" in lines and "| agent | 0 | 0 | 0 | 1 | 1 |" in lines
    assert "| random | 0 | 0 | 1 | 0 | 0 |" in lines
    assert not any("onnxsim" in line for line in lines)
    assert _outcome_lines([{k: v for k, v in r.items() if k != "outcome"} for r in rows]) == []  # older results


def test_find_models(tmp_path, matmul_model):
    save(matmul_model, tmp_path / "a.onnx")
    save(matmul_model, tmp_path / "a.rlflow.onnx")
    assert [p.name for p in find_models([tmp_path])] == ["a.onnx"]
    with pytest.raises(RlflowError, match="no such file"):
        find_models([tmp_path / "nope"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(RlflowError, match="no .onnx models"):
        find_models([tmp_path / "empty"])


def test_the_cost_table_is_filled_before_any_method_runs(tmp_path, matmul_model, monkeypatch):
    """The first method on a model must not pay, inside its time limit, for table entries later methods read free."""
    from rlflow.bench.run import warm_cost_table
    from rlflow.graph.core import Graph
    from rlflow.measure.costmodel.model import CostModel
    from rlflow.measure.session import SessionSettings

    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path))
    graph, settings = Graph.from_model(matmul_model), SessionSettings()
    assert warm_cost_table(graph, settings) > 0
    fresh = CostModel(settings)  # what a method's optimize() creates: it reads the table from disk
    fresh.graph_cost(graph)
    assert fresh.stats.misses == 0 and fresh.stats.hits > 0


def test_a_failed_warm_up_leaves_the_run_going(matmul_model, monkeypatch):
    """The cost model failing on a graph is the methods' rows to report, not a reason to stop the whole bench."""
    from rlflow.bench.run import warm_cost_table
    from rlflow.graph.core import Graph
    from rlflow.measure.costmodel.model import CostModel
    from rlflow.measure.session import SessionSettings

    def broken(self, graph):
        raise ValueError("shape inference failed\nsecond line")

    monkeypatch.setattr(CostModel, "graph_cost", broken)
    assert warm_cost_table(Graph.from_model(matmul_model), SessionSettings()) is None


def test_cuda_graph_without_cuda_is_one_clear_error_and_writes_nothing(tmp_path, matmul_model, capsys):
    save(matmul_model, tmp_path / "m.onnx")
    out = tmp_path / "out"
    assert main(["bench", str(tmp_path), "--provider", "cpu", "--cuda-graph", "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --cuda-graph needs the CUDA provider; this run's is CPUExecutionProvider"]
    assert not out.exists()


def test_peer_runs_the_peers_named_and_no_other(tmp_path, matmul_model, monkeypatch, capsys):
    from rlflow.bench import run

    seen = []
    monkeypatch.setattr(run, "run_bench", lambda models, config, out: seen.append(config) or {"rows": [], "seconds": 0})
    save(matmul_model, tmp_path / "m.onnx")
    assert main(["bench", str(tmp_path), "--peer", "onnxscript-ort", "--peer", "onnxsim", "--peer", "onnxscript-ort",
                 "--out", str(tmp_path / "out")]) == 0
    assert seen[0].peers == ("onnxscript-ort", "onnxsim") and not seen[0].references
    assert main(["bench", str(tmp_path), "--peers", "--out", str(tmp_path / "out")]) == 0
    assert seen[1].peers == PEERS and seen[1].references
    capsys.readouterr()
    assert main(["bench", str(tmp_path), "--peers", "--peer", "onnxsim", "--out", str(tmp_path / "out")]) == 2
    assert "--peers runs every peer" in capsys.readouterr().err
    assert main(["bench", str(tmp_path), "--peer", "onnxruntime", "--out", str(tmp_path / "out")]) == 2


def test_the_table_says_when_it_was_measured_with_cuda_graph_capture():
    """A captured bench (`--cuda-graph`) is not comparable with a plain one: its header must say which it is."""
    results = json.loads((Path(__file__).parent.parent / "docs/results/gpu/h200-1126-cg/bench-cg/results.json")
                         .read_text())
    assert "CUDAExecutionProvider, CUDA graph capture, 1 thread(s)" in markdown_table(results)
    results["settings"]["cuda_graph"] = False
    assert "CUDA graph capture" not in markdown_table(results).split("\n")[2]


def test_rows_are_held_out_against_the_agent_the_bench_would_play():
    """On CUDA the shipped CUDA agent's training list says what is held out, not the CPU agent's."""
    from rlflow.bench.run import BenchConfig, _heldout_from
    from rlflow.measure.session import SessionSettings
    from rlflow.search.agent import CUDA_AGENT

    cpu = SessionSettings(provider="CPUExecutionProvider")
    cuda = SessionSettings(provider="CUDAExecutionProvider")
    assert _heldout_from(BenchConfig(methods=("greedy",)), cpu) == "rlflow/checkpoints/default.json"
    expected = "rlflow/checkpoints/cuda.json" if CUDA_AGENT.is_file() else "rlflow/checkpoints/default.json"
    assert _heldout_from(BenchConfig(methods=("greedy",)), cuda) == expected


def test_on_cuda_each_output_is_also_run_on_the_device_beside_its_input(matmul_model, monkeypatch):
    """`device_errors` (the CPU standing in for the device: no CUDA here): an output that computes something else
    stands out against its input's own error, and the page says so."""
    import onnx

    import rlflow.bench.method_rows as run
    from rlflow.graph.core import Graph
    from rlflow.measure.session import SessionSettings

    real = run.verify
    monkeypatch.setattr(run, "verify", lambda *a, candidate_provider, **k: real(*a, **k))
    graph = Graph.from_model(matmul_model, {"x": (2, 8)})
    other = onnx.ModelProto()
    other.CopyFrom(matmul_model)
    other.graph.node[2].op_type = "Sigmoid"  # not the same function
    assert run.device_errors(matmul_model, other, SessionSettings(), graph) == {}  # the CPU: nothing to add
    errors = run.device_errors(matmul_model, other, SessionSettings(provider="CUDAExecutionProvider"), graph)
    assert errors["input_device_error"] == 0.0 and errors["device_error"] > 0.1
    page = "\n".join(_device_lines([{**_row("greedy", "rewritten"), **errors}, _row("onnxsim", "", kind="peer")]))
    assert "## On the device" in page and f"| {errors['device_error']:.1e} | 0.0e+00 |" in page
    assert "onnxsim" not in page  # a row not run on the device


def _methods_writing(graphs: dict, monkeypatch):
    """method_rows with optimize() replaced by one that hands each method the graph `graphs` names, as rewritten;
    returns how many graphs each comparison took."""
    from types import SimpleNamespace

    import rlflow.bench.method_rows as module

    def optimize(graph, *, method, **options):
        return SimpleNamespace(graph=graphs[method], rewritten=True, applied=[method], search_seconds=0.1, gate=None,
                               verification=SimpleNamespace(ok=True, max_rel_norm=0.0), reason="", outcome="rewritten",
                               search_stop="", candidates_measured=1)

    calls, real = [], module.compare_profiled
    monkeypatch.setattr(module, "optimize", optimize)
    monkeypatch.setattr(module, "compare_profiled", lambda graphs, *a, **k: calls.append(len(graphs)) or
                        real(graphs, *a, **k))
    return calls


def _page(*rows) -> str:
    """results.md of a run of `rows` (method_rows' Rows, all of model `m`)."""
    return markdown_table({"environment": {"date": "d", "cpu": "c", "cores": 2, "provider": "CPU", "onnxruntime": "1",
                                           "onnx": "1", "rlflow": "0"},
                           "config": {"time_limit": None, "rounds": 3, "seed": 0}, "peak": {"gflops": 1.0},
                           "settings": {"threads": 1, "opt_level": "all"},
                           "rows": [{**vars(r), "model": "m"} for r in rows]})


def test_methods_that_write_the_same_graph_share_one_measurement(matmul_model, monkeypatch):
    """The methods' outputs are measured in one comparison, each distinct graph once: two methods that reached the same
    graph (other objects, the same fingerprint) get the same figures, and the page says whose graph it was."""
    from rlflow.bench.method_rows import method_rows
    from rlflow.bench.run import BenchConfig
    from rlflow.graph.core import Graph
    from rlflow.measure.session import SessionSettings

    shapes = {"x": (2, 8)}
    graph = Graph.from_model(matmul_model, shapes)
    calls = _methods_writing({"greedy": Graph.from_model(matmul_model, shapes), "taso": Graph.from_model(
        matmul_model, shapes), "random": Graph.from_model(with_op(matmul_model, "Sigmoid"), shapes)}, monkeypatch)
    greedy, taso, random = method_rows(graph, ("greedy", "taso", "random"), SessionSettings(), BenchConfig(rounds=3))
    assert calls == [3]  # the input and the two distinct outputs, in the same rounds
    assert (greedy.same_output_as, taso.same_output_as, random.same_output_as) == ("", "greedy", "")
    figures = ("speedup", "speedup_low", "speedup_high", "baseline_ms", "latency_ms")
    assert [getattr(taso, f) for f in figures] == [getattr(greedy, f) for f in figures]
    assert random.latency_ms != greedy.latency_ms and random.baseline_ms == greedy.baseline_ms  # one input timing
    assert taso.rewrites == ["taso"] and taso.status == "ok"
    page = _page(greedy, taso)
    assert "| m | taso (= greedy) | ok |" in page and "| m | greedy | ok |" in page


def test_outputs_onnxruntime_runs_the_same_share_one_measurement(matmul_model, matmul_with_identity, monkeypatch):
    """Two outputs that differ only by a node onnxruntime removes (an Identity) are measured once, and the page says
    they are the same as run; an output that differs as run is measured beside them."""
    from rlflow.bench.method_rows import method_rows
    from rlflow.bench.run import BenchConfig
    from rlflow.graph.core import Graph
    from rlflow.measure.session import SessionSettings

    shapes = {"x": (2, 8)}
    calls = _methods_writing({"greedy": Graph.from_model(matmul_model, shapes),
                              "agent": Graph.from_model(matmul_with_identity, shapes),
                              "random": Graph.from_model(with_op(matmul_model, "Sigmoid"), shapes)}, monkeypatch)
    greedy, agent, random = method_rows(Graph.from_model(matmul_model, shapes), ("greedy", "agent", "random"),
                                        SessionSettings(), BenchConfig(rounds=3))
    assert calls == [3]  # the input, greedy's output (agent's as run) and random's
    assert (agent.same_output_as, agent.same_as_run) == ("greedy", True)
    assert (greedy.same_output_as, greedy.same_as_run, random.same_output_as) == ("", False, "")
    assert agent.speedup == greedy.speedup and random.latency_ms != greedy.latency_ms
    page = _page(greedy, agent)
    assert "| m | agent (= greedy as run) | ok |" in page


def test_an_output_that_cannot_run_costs_only_its_own_rows(matmul_model, monkeypatch):
    """Where the joint comparison fails (an output onnxruntime cannot build), each output is measured alone: the others
    keep their figures, and the one that fails, with every method that wrote it, gets a failed row."""
    from rlflow.bench.method_rows import method_rows
    from rlflow.bench.run import BenchConfig
    from rlflow.graph.core import Graph
    from rlflow.measure.session import SessionSettings

    shapes = {"x": (2, 8)}
    broken = Graph.from_model(with_op(matmul_model, "NoSuchOperator", "rlflow.test"), shapes)
    calls = _methods_writing({"greedy": Graph.from_model(matmul_model, shapes), "taso": broken, "random": broken},
                             monkeypatch)
    greedy, taso, random = method_rows(Graph.from_model(matmul_model, shapes), ("greedy", "taso", "random"),
                                       SessionSettings(), BenchConfig(rounds=3))
    assert calls == [3, 2, 2]  # together, then each alone
    assert greedy.status == "ok" and greedy.speedup_low <= greedy.speedup <= greedy.speedup_high
    assert taso.status == random.status == "failed" and "NoSuchOperator" in taso.error
    assert random.method == "random" and random.error == taso.error


def test_the_control_is_a_copy_of_the_input_measured_with_the_outputs(matmul_model, monkeypatch):
    """`--control`: a copy of the input joins the methods' outputs in their comparison, and its row, a speedup near 1
    by construction, says how far the measurement alone moves a figure; a bench with no method still measures it."""
    from rlflow.bench.method_rows import CONTROL, method_rows
    from rlflow.bench.run import BenchConfig
    from rlflow.graph.core import Graph
    from rlflow.measure.session import SessionSettings

    shapes = {"x": (2, 8)}
    graph = Graph.from_model(matmul_model, shapes)
    calls = _methods_writing({"greedy": Graph.from_model(with_op(matmul_model, "Sigmoid"), shapes)}, monkeypatch)
    greedy, control = method_rows(graph, ("greedy",), SessionSettings(), BenchConfig(rounds=5, control=True))
    assert calls == [3]  # the input, greedy's output and the control, in the same rounds
    assert (control.method, control.kind, control.status, control.rewritten) == (CONTROL, CONTROL, "ok", False)
    assert control.baseline_ms == greedy.baseline_ms and control.speedup_low <= control.speedup <= control.speedup_high
    assert 0.5 < control.speedup < 2  # the same graph: only the measurement parts it from the input
    (alone,) = method_rows(graph, (), SessionSettings(), BenchConfig(rounds=3, control=True))
    assert alone.method == CONTROL and alone.status == "ok" and calls[-1] == 2
    assert method_rows(graph, (), SessionSettings(), BenchConfig(rounds=3)) == []
    page = _page(greedy, control)
    assert "| m | control | ok |" in page and "Row `control` (`--control`)" in page


def test_control_reaches_the_bench_from_the_command_line(tmp_path, matmul_model, monkeypatch):
    import rlflow.bench.run as run

    seen = []
    monkeypatch.setattr(run, "run_bench", lambda models, config, out: seen.append(config) or {"rows": [], "seconds": 0})
    save(matmul_model, tmp_path / "m.onnx")
    assert main(["bench", str(tmp_path / "m.onnx"), "--methods", "", "--control", "--out", str(tmp_path / "r")]) == 0
    assert seen[0].control and seen[0].methods == ()


def test_each_model_of_a_run_is_measured_with_a_seed_of_its_own():
    """One seed for every model made an effect of the measuring order fall alike on all of them, and it did not
    average out over a run; the seed stays the same for the same run seed and model, so a run can be repeated."""
    from rlflow.bench.method_rows import measurement_seed

    seeds = {measurement_seed(0, f"model-{i}") for i in range(20)}
    assert len(seeds) == 20 and measurement_seed(0, "model-1") == measurement_seed(0, "model-1")
    assert measurement_seed(0, "model-1") != measurement_seed(1, "model-1")


def test_a_cuda_results_file_names_its_gpu(tmp_path, monkeypatch):
    """Issue #80: a GPU results.json says which card it is about (it said so only in the kit's environment.json)."""
    from rlflow.bench.machine import gpu_name

    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA H200'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert gpu_name("CUDAExecutionProvider") == "NVIDIA H200"
    assert gpu_name("CPUExecutionProvider") is None
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert gpu_name("CUDAExecutionProvider") is None
