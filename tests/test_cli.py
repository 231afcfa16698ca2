"""The command line: bad input gets one line and exit 2, never a traceback or a partial file."""
from __future__ import annotations

import subprocess
import sys

import onnx
import pytest
from onnx import TensorProto, helper

from rlflow.cli import main
from tests.conftest import save, tiny_model


def _bad_inputs(tmp_path, good_bytes):
    """The five kinds of bad input of the foundation issue, plus a directory and an empty file."""
    cases = {}
    cases["missing"] = tmp_path / "missing.onnx"
    (tmp_path / "text.onnx").write_text("this is not an onnx model\n" * 20)
    cases["not-onnx"] = tmp_path / "text.onnx"
    (tmp_path / "truncated.onnx").write_bytes(good_bytes[: len(good_bytes) // 2])
    cases["truncated"] = tmp_path / "truncated.onnx"
    rejected = onnx.ModelProto()
    rejected.ParseFromString(good_bytes)
    rejected.graph.node[0].input[0] = "no_such_tensor"
    cases["checker-rejects"] = save(rejected, tmp_path / "rejected.onnx")
    custom = tiny_model([helper.make_node("Frobnicate", ["x"], ["y"], domain="com.example")],
                        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    custom.opset_import.append(helper.make_opsetid("com.example", 1))
    cases["provider-cannot-run"] = save(custom, tmp_path / "custom.onnx")
    cases["directory"] = tmp_path / "a-directory.onnx"
    cases["directory"].mkdir()
    (tmp_path / "empty.onnx").write_bytes(b"")
    cases["empty"] = tmp_path / "empty.onnx"
    return cases


@pytest.mark.parametrize("kind", ["missing", "not-onnx", "truncated", "checker-rejects", "provider-cannot-run",
                                  "directory", "empty"])
def test_bad_input_exit_2_one_line_no_output(kind, tmp_path, matmul_model, capsys):
    case = _bad_inputs(tmp_path, matmul_model.SerializeToString())[kind]
    out = tmp_path / "out.onnx"
    code = main(["optimize", str(case), "-o", str(out), "--time-limit", "2"])
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.err
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")], "no temporary file left behind"


def test_traceback_only_with_debug(tmp_path):
    missing = str(tmp_path / "missing.onnx")
    plain = subprocess.run([sys.executable, "-m", "rlflow.cli", "optimize", missing], capture_output=True, text=True)
    assert plain.returncode == 2 and plain.stderr.strip() == f"error: {missing}: no such file"
    debug = subprocess.run([sys.executable, "-m", "rlflow.cli", "optimize", missing, "--debug"], capture_output=True,
                           text=True)
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_never_overwrites_input(tmp_path, matmul_model, capsys):
    path = save(matmul_model, tmp_path / "m.onnx")
    assert main(["optimize", path, "-o", path]) == 2
    assert "never overwrites" in capsys.readouterr().err


@pytest.mark.parametrize("checkpoint", ["missing", "not-a-checkpoint"])
def test_bad_agent_checkpoint_exit_2_one_line(checkpoint, tmp_path, matmul_model, capsys):
    path = save(matmul_model, tmp_path / "m.onnx")
    agent = tmp_path / "agent.pt"
    if checkpoint == "not-a-checkpoint":
        agent.write_bytes(b"not torch")
    out = tmp_path / "out.onnx"
    assert main(["optimize", path, "-o", str(out), "--method", "agent", "--agent", str(agent)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "agent.pt" in lines[0]
    assert not out.exists()


def test_default_output_name(tmp_path, matmul_model, capsys):
    path = save(matmul_model, tmp_path / "m.onnx")
    assert main(["optimize", path, "--time-limit", "1", "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "m.rlflow.onnx")
    assert (tmp_path / "m.rlflow.onnx").exists()


def test_out_names_the_output_as_in_the_other_commands(tmp_path, matmul_model, capsys):
    path = save(matmul_model, tmp_path / "m.onnx")
    assert main(["optimize", path, "--time-limit", "1", "--quiet", "--out", str(tmp_path / "x.onnx")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "x.onnx")
    assert (tmp_path / "x.onnx").exists() and not (tmp_path / "m.rlflow.onnx").exists()


def test_rules_listing(tmp_path, cnn_opset9_ir3_path, capsys):
    assert main(["rules"]) == 0
    listing = capsys.readouterr().out
    assert "conv-bn-fold" in listing and "transpose-transpose" in listing
    assert main(["rules", "--model", cnn_opset9_ir3_path]) == 0
    counted = capsys.readouterr().out
    assert "matches of" in counted
    line = next(text for text in counted.splitlines() if "conv-bn-fold" in text)
    assert " 2  " in line


@pytest.mark.parametrize("algo", ["ppo", "worldmodel"])
def test_train_passes_options_to_the_trainer(algo, capsys):
    assert main(["train", "--algo", algo, "--help"]) == 0
    assert "--seed" in capsys.readouterr().out
