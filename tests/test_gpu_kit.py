"""The GPU kit's pieces that run without network or GPU: parts, checksums, the call sequence and gpu/remote.sh."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
REMOTE = ROOT / "gpu" / "remote.sh"
spec = importlib.util.spec_from_file_location("gpu_kit", ROOT / "gpu" / "kit.py")
kit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kit)


def test_split_and_reassemble_are_byte_identical(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 3 * 2**20 + 12345, dtype=np.uint8).tobytes()
    archive = tmp_path / "kit.tar.xz"
    archive.write_bytes(data)
    dest = tmp_path / "parts"
    dest.mkdir()
    (dest / "part-99").write_bytes(b"left over from an earlier kit")
    parts = kit.split(archive, 2**20, dest)
    assert [p.name for p in parts] == ["part-01", "part-02", "part-03", "part-04"]
    assert sorted(dest.iterdir()) == parts  # the stale part is gone
    assert [p.stat().st_size for p in parts] == [2**20] * 3 + [12345]
    digest = kit.sha256(archive)
    assert digest == hashlib.sha256(data).hexdigest()
    kit.reassemble(parts, tmp_path / "joined", digest)
    assert (tmp_path / "joined").read_bytes() == data


def test_reassemble_rejects_a_missing_or_reordered_part(tmp_path):
    archive = tmp_path / "kit.tar.xz"
    archive.write_bytes(os.urandom(5000))
    parts = kit.split(archive, 2000, tmp_path)
    digest = kit.sha256(archive)
    for wrong in (parts[:-1], [parts[1], parts[0], parts[2]]):
        with pytest.raises(SystemExit, match="does not match its SHA-256"):
            kit.reassemble(wrong, tmp_path / "joined", digest)


def _calls(text: str) -> list[tuple[list[str], str]]:
    """(carry, command) of each numbered call in COMMANDS.md."""
    found = re.findall(r"^\d+\. carry `(.*)`, command: `(.*)`$", text, flags=re.M)
    return [(json.loads(carry), command) for carry, command in found]


def test_commands_carry_every_part_in_order_and_the_checksum_last(tmp_path):
    parts = [tmp_path / ".gpukit" / f"part-{i:02d}" for i in range(1, 5)]
    calls = _calls(kit.commands(parts, root=tmp_path))
    assert len(calls) == 4
    for i, (carry, command) in enumerate(calls, 1):
        assert carry[0] == f".gpukit/part-{i:02d}"
        assert command.startswith(f"bash gpu/remote.sh receive .gpukit/part-{i:02d}")
        assert (".gpukit/SHA256" in carry) == (i == 4)
        assert ("install" in command) == (i == 4) and ("measure" in command) == (i == 4)
    last = calls[-1][1].split(" && ")
    first = kit.plan.PLAN[0]
    assert last == ["bash gpu/remote.sh receive .gpukit/part-04", "bash gpu/remote.sh install",
                    f"{first.environment()} bash gpu/remote.sh measure --wait 540"]
    assert "GPU_STEPS=" in first.environment() and "GPU_ZOO=" in first.environment()


def test_the_plan_picks_up_at_its_first_step_without_results(tmp_path):
    plan = kit.plan
    assert [s.name for s in plan.pending(tmp_path)] == [s.name for s in plan.PLAN]
    (tmp_path / plan.PLAN[0].name).mkdir()
    rest = plan.pending(tmp_path)
    assert rest == list(plan.PLAN[1:])
    text = kit.commands([tmp_path / ".gpukit" / "part-01"], root=tmp_path, steps=rest)
    assert f"{rest[0].environment()} bash gpu/remote.sh measure" in _calls(text)[0][1]
    assert all(f"`{s.name}`" in text for s in rest)
    with pytest.raises(SystemExit, match="every step"):
        kit.commands([tmp_path / ".gpukit" / "part-01"], root=tmp_path, steps=[])


def test_every_plan_step_fits_a_lease_and_names_only_what_measure_sh_knows():
    plan = kit.plan
    script = (ROOT / "gpu" / "measure.sh").read_text()
    for step in plan.PLAN:
        assert step.minutes <= plan.LEASE_MINUTES - plan.START_MINUTES, step.name
        assert set(step.settings) <= set(re.findall(r"\b(GPU_[A-Z_]+)", script)), step.name
        assert all(f"    {s})" in script for s in step.settings["GPU_STEPS"].split()), step.name
        assert all(_in_zoo(m) for m in step.settings["GPU_ZOO"].split() + step.stand_ins.split()), step.name
    assert len({s.name for s in plan.PLAN}) == len(plan.PLAN)


def _in_zoo(name: str) -> bool:
    from rlflow import zoo

    try:
        return zoo.get(name) is not None
    except ValueError:
        return False


def test_one_part_is_one_call_that_does_everything(tmp_path):
    (carry, command), = _calls(kit.commands([tmp_path / ".gpukit" / "part-01"], root=tmp_path))
    assert carry == [".gpukit/part-01", ".gpukit/SHA256"]
    assert "remote.sh install" in command and "remote.sh measure" in command


@pytest.mark.parametrize("script", ["remote.sh", "measure.sh"])
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(ROOT / "gpu" / script)], check=True)


def test_remote_without_arguments_prints_usage_and_exits_2(tmp_path):
    run = subprocess.run(["bash", str(REMOTE)], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "RLFLOW_KIT": str(tmp_path / "kit")})
    assert run.returncode == 2
    assert run.stderr.startswith("usage: bash gpu/remote.sh receive PART | install")
    assert len(run.stderr.splitlines()) == 1


@pytest.fixture
def device(tmp_path):
    """A stand-in for the device: a repository copy (cwd) with a stub CUDA check, a kit folder and a tiny kit split
    into two parts that `remote.sh receive` has kept. Returns (run, repo, kit folder, archive digest)."""
    stub = tmp_path / "build" / "site" / "stub.py"
    stub.parent.mkdir(parents=True)
    stub.write_text("STUB = 1\n")
    archive = tmp_path / "build" / "kit.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(stub.parent, arcname="site")
    repo, kit_dir = tmp_path / "repo", tmp_path / "kit"
    for folder in ("rlflow", "models", "gpu", ".gpukit"):
        (repo / folder).mkdir(parents=True)
    (repo / "gpu" / "check_cuda.py").write_text("import stub; print('stub check', stub.STUB)\n")
    parts = kit.split(archive, archive.stat().st_size // 2 + 1, repo / ".gpukit")
    assert len(parts) == 2
    env = {**os.environ, "RLFLOW_KIT": str(kit_dir), "PYTHON": sys.executable}

    def run(*args):
        return subprocess.run(["bash", str(REMOTE), *args], capture_output=True, text=True, cwd=repo, env=env)

    for part in parts:
        assert run("receive", str(part.relative_to(repo))).returncode == 0
    assert sorted(p.name for p in (kit_dir / "parts").iterdir()) == ["part-01", "part-02"]
    return run, repo, kit_dir, kit.sha256(archive)


def test_install_rejects_a_wrong_checksum_in_one_line(device):
    run, repo, kit_dir, digest = device
    (repo / ".gpukit" / "SHA256").write_text(("0" if digest[0] != "0" else "1") + digest[1:] + "\n")
    result = run("install")
    assert result.returncode != 0
    assert result.stderr.splitlines() == ["kit: reassembled archive does not match its SHA-256 (parts missing?)"]
    assert not (kit_dir / "site").exists() and not (kit_dir / "src").exists()


def test_install_unpacks_a_matching_kit_and_runs_the_check(device):
    run, repo, kit_dir, digest = device
    (repo / ".gpukit" / "SHA256").write_text(digest + "\n")
    result = run("install")
    assert result.returncode == 0, result.stderr
    assert (kit_dir / "site" / "stub.py").read_text() == "STUB = 1\n"
    assert (kit_dir / "src" / "gpu" / "check_cuda.py").exists()
    assert "stub check 1" in result.stdout  # the check ran with the kit's site/ on PYTHONPATH


def test_measure_sets_an_earlier_runs_results_aside(device, tmp_path):
    """On a warm machine the last run's DONE would end `collect` at once and its files would mix with the new run's."""
    run, repo, kit_dir, digest = device
    (repo / ".gpukit" / "SHA256").write_text(digest + "\n")
    assert run("install").returncode == 0
    (kit_dir / "src" / "gpu" / "measure.sh").write_text(
        'sleep 1; echo new > "$RLFLOW_KIT/results/new.txt"; touch "$RLFLOW_KIT/results/DONE"\n')
    (kit_dir / "results").mkdir()
    (kit_dir / "results" / "DONE").touch()
    (kit_dir / "results" / "old.txt").write_text("old\n")
    out = tmp_path / "out"
    out.mkdir()
    result = subprocess.run(["bash", str(REMOTE), "measure", "--wait", "30"], capture_output=True, text=True, cwd=repo,
                            env={**os.environ, "RLFLOW_KIT": str(kit_dir), "PYTHON": sys.executable, "OUT": str(out)})
    assert result.returncode == 0, result.stderr
    assert "measurement finished" in result.stdout
    assert sorted(p.name for p in (kit_dir / "results").iterdir()) == ["DONE", "log.txt", "new.txt"]
    earlier = [p for p in kit_dir.iterdir() if p.name.startswith("results-")]
    assert len(earlier) == 1 and (earlier[0] / "old.txt").read_text() == "old\n"
    with tarfile.open(out / "results.tar.gz") as tar:
        assert "results/new.txt" in tar.getnames() and "results/old.txt" not in tar.getnames()


def test_the_optimize_step_rehearses_without_a_gpu(tmp_path):
    """`GPU_STEPS=optimize` with another provider: the model is built, optimized and its report written; the
    captured comparison, which needs CUDA, is skipped."""
    kit_dir = tmp_path / "kit"
    (kit_dir / "site").mkdir(parents=True)
    (kit_dir / "src").symlink_to(ROOT)
    env = {**os.environ, "RLFLOW_KIT": str(kit_dir), "PYTHON": sys.executable, "GPU_PROVIDER": "cpu",
           "GPU_STEPS": "optimize", "GPU_ZOO": "squeezenet-1.1-tiny", "GPU_TIME_LIMIT": "1"}
    env.pop("PYTHONPATH", None)
    result = subprocess.run(["bash", str(ROOT / "gpu" / "measure.sh")], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    results = kit_dir / "results"
    assert (results / "DONE").exists()
    assert sorted(p.name for p in (results / "optimize").iterdir()) == ["squeezenet-1.1-tiny.json"]
    report = json.loads((results / "optimize" / "squeezenet-1.1-tiny.json").read_text())
    assert report["settings"]["provider"] == "CPUExecutionProvider"
    assert (kit_dir / "models" / "squeezenet-1.1-tiny.rlflow.onnx").exists()


def _captured_row(model: str, status: str = "ok") -> dict:
    if status != "ok":
        return {"model": model, "status": status, "error": "Fail: [ONNXRuntimeError] : 1 : FAIL : This session "
                "cannot use the graph capture feature as requested by the user  as all compute graph nodes have not "
                "been partitioned to the CUDAExecutionProvider"}
    ratio = {"median": 1.5, "low": 1.4, "high": 1.6}
    return {"model": model, "status": "ok", "speedup": 2.0, "speedup_low": 1.9, "speedup_high": 2.1,
            "rewrite_plain": ratio, "rewrite_captured": {"median": 1.3, "low": 1.2, "high": 1.35},
            "both": {"median": 2.6, "low": 2.5, "high": 2.7}, "rewritten_max_rel_error": 3e-4}


def test_summarize_optimize_tables_each_model_and_says_why_capture_was_refused(tmp_path):
    spec = importlib.util.spec_from_file_location("summarize_optimize", ROOT / "gpu" / "summarize_optimize.py")
    summarize = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summarize)
    folder = tmp_path / "results"
    (folder / "optimize").mkdir(parents=True)
    for model, status in (("alpha", "ok"), ("beta", "not applicable")):
        report = {"speedup": {"median": 1.7, "low": 1.6, "high": 1.8},
                  "latency_ms": {"before": {"median_ms": 2.0}, "after": {"median_ms": 1.2}},
                  "seconds": {"search": 12.5}, "applied": ["attention-fusion@a", "attention-fusion@b", "bias-gelu@c"]}
        (folder / "optimize" / f"{model}.json").write_text(json.dumps(report))
        captured = {"rows": [_captured_row(model, status)]}
        (folder / "optimize" / f"{model}.captured.json").write_text(json.dumps(captured))
    (folder / "environment.json").write_text(json.dumps({"device": "Test GPU"}))
    assert summarize.main([str(folder)]) == 0
    lines = (folder / "optimize.md").read_text().splitlines()
    assert len(lines) == 4
    assert lines[2].startswith("| alpha | 1.700 [1.600, 1.800] | 2.000 -> 1.200 | 12.5 | "
                               "attention-fusion 2, bias-gelu 1 |")
    assert "| 1.300 [1.200, 1.350] | 2.600 [2.500, 2.700] | 3.0e-04 |" in lines[2]
    assert "capture refused: onnxruntime placed some nodes on the CPU" in lines[3]
    assert (folder / "optimize.png").stat().st_size > 0
    assert summarize.main([str(tmp_path / "empty")]) == 2


def test_split_only_without_an_archive_says_so(tmp_path):
    with pytest.raises(SystemExit, match="kit.tar.xz does not exist; run python gpu/kit.py first"):
        kit.main(["--split-only", "--work", str(tmp_path)])


def test_the_captured_comparison_times_a_rewrite_in_the_same_rounds(matmul_model, tmp_path, monkeypatch):
    """The bookkeeping of `cuda_graph_peer.measure --rewritten` on the CPU provider, the captured sessions standing
    in as plain ones (capture itself needs CUDA): four configurations per round, the three ratios, output errors."""
    import onnx

    from rlflow.measure.session import SessionSettings

    sys.path.insert(0, str(ROOT / "gpu"))
    try:
        import cuda_graph_peer as peer
    finally:
        sys.path.remove(str(ROOT / "gpu"))
    made = []

    def on_the_cpu(provider, cuda_graph=False):
        made.append((provider, cuda_graph))
        return SessionSettings()

    monkeypatch.setattr(peer, "SessionSettings", on_the_cpu)
    monkeypatch.setattr(peer, "PROVIDER", "CPUExecutionProvider")
    original, rewritten = tmp_path / "m.onnx", tmp_path / "m.rlflow.onnx"
    onnx.save(matmul_model, original)
    onnx.save(matmul_model, rewritten)
    row = peer.measure(original, rounds=4, blocks=2, seed=0, rewritten=rewritten)
    assert row["status"] == "ok" and row["rounds"] == 4 and row["rewritten"] == str(rewritten)
    for key in ("rewrite_plain", "rewrite_captured", "both"):
        assert row[key]["low"] <= row[key]["median"] <= row[key]["high"]
    assert row["max_rel_error"] == 0.0 and row["rewritten_max_rel_error"] == 0.0
    wrong = onnx.ModelProto()
    wrong.CopyFrom(matmul_model)
    wrong.graph.initializer[0].raw_data = (onnx.numpy_helper.to_array(wrong.graph.initializer[0]) * 2).tobytes()
    onnx.save(wrong, rewritten)
    assert peer.measure(original, rounds=2, blocks=1, seed=0, rewritten=rewritten)["rewritten_max_rel_error"] > 0.1
    assert made[:2] == [("CPUExecutionProvider", False), ("CPUExecutionProvider", True)]
    alone = peer.measure(original, rounds=4, blocks=2, seed=0)
    assert "rewrite_plain" not in alone and alone["rounds"] == 4
