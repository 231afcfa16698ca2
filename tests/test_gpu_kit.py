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
    assert last == ["bash gpu/remote.sh receive .gpukit/part-04", "bash gpu/remote.sh install",
                    "bash gpu/remote.sh measure --wait 420"]


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
