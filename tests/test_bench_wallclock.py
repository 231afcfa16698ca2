"""The wall-clock command: a fresh `rlflow optimize` process per model, its exit status and outcome recorded."""
from __future__ import annotations

import json

import onnx

from rlflow.cli import main


def test_records_each_model_and_a_failure(tmp_path, matmul_model):
    folder = tmp_path / "models"
    folder.mkdir()
    onnx.save(matmul_model, str(folder / "good.onnx"))
    (folder / "broken.onnx").write_bytes(b"not a model")
    out = tmp_path / "results"
    code = main(["wallclock", str(folder), "--out", str(out), "--optimize-args", "--method greedy --time-limit 2"])
    assert code == 1  # one model failed, so the command says so
    results = json.loads((out / "optimize-wallclock.json").read_text())
    rows = {row["model"]: row for row in results["rows"]}
    assert results["invocation"] == (f"rlflow wallclock {folder} --out {out} "
                                     "--optimize-args '--method greedy --time-limit 2'")  # the line as typed
    assert rows["good"]["exit"] == 0 and rows["good"]["rewritten"] is not None and rows["good"]["seconds"] > 0
    assert rows["good"]["settings"]["method"] == "greedy"  # the options reached `rlflow optimize`
    assert rows["broken"]["exit"] == 2 and "broken.onnx" in rows["broken"]["reason"]
    table = (out / "optimize-wallclock.md").read_text()
    assert "| good | 0 |" in table and "failed:" in table


def test_missing_folder_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["wallclock", str(tmp_path / "nowhere"), "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert not (tmp_path / "optimize-wallclock.json").exists()
