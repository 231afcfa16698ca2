"""Prepares what the GPU machine lacks, as chunks small enough to travel, and writes the commands that carry them.

The GPU machine (docs/gpu.md) has Python 3.12, torch with CUDA 13, onnx, the nvidia cuDNN 9 and
cuBLAS packages and onnxruntime *without* CUDA, and no network.  Each device call carries a copy of the working tree
plus at most 64 MiB in all, so the kit:

1. downloads (for cp312, manylinux x86-64) the `onnxruntime-gpu` wheel and the wheels of rlflow's dependencies the
   image lacks (onnx-graphsurgeon, gymnasium and the peer tools);
2. unpacks them into one `site/` tree, leaving out what the Python binding never loads (`libonnxruntime.so`, the C
   API library, and the TensorRT provider), and packs it as one xz archive (xz is about 17% smaller than the wheel's
   deflate on the 284 MB CUDA provider);
3. splits the archive into parts that fit beside the working tree (`.gpukit/part-NN`, git-ignored) and writes their
   SHA-256 and the sequence of device calls to `.gpukit/COMMANDS.md`.

    python gpu/kit.py                # downloads into build/gpukit/, writes .gpukit/
    python gpu/kit.py --rehearse     # also reassembles the parts here and checks the archive, as the device will
    python gpu/kit.py --split-only   # re-split the archive already in build/gpukit/ for the working tree as it is now

The parts must fit beside the working tree, which grows between leases (25 MiB when the first kit was made, 35 MiB a
day later): split again before a lease (`--split-only` takes seconds; packing takes minutes).

The project itself travels with the working tree (PYTHONPATH), so it needs no wheel of its own.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ORT_GPU = "onnxruntime-gpu==1.31.1"
"""CUDA 13 and cuDNN 9 build; onnxruntime-gpu 1.31 wheels on PyPI are built for CUDA 13."""

DEPENDENCIES = ("onnx-graphsurgeon==0.6.1", "gymnasium==1.4.0", "farama-notifications==0.0.6",
                "onnxsim==0.8.1", "onnxoptimizer==0.4.2", "onnxslim==0.1.98")
"""What rlflow (and `rlflow bench --peers`) imports that the device image lacks; everything else is there."""

GENAI_BUILDER = "onnxruntime-genai==0.18.0"
"""onnxruntime-genai, for its model builder's Python source alone (`models/`, run as `builder.py` under the image's
torch, transformers and onnx-ir: RLFLOW_GENAI_BUILDER in gpu/measure.sh); its own libraries stay behind."""

LEFT_OUT = ("onnxruntime/capi/libonnxruntime.so", "onnxruntime/capi/libonnxruntime_providers_tensorrt.so",
            "onnxruntime_genai/libonnxruntime-genai.so", "onnxruntime_genai/onnxruntime_genai.")
"""Prefixes of wheel members never loaded there: onnxruntime's C API library and TensorRT provider, and
onnxruntime-genai's libraries (only its builder's source is used)."""

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")

CALL_LIMIT = 64 * 2**20
"""Bytes one device call may carry: the working tree and the carried paths together."""

MARGIN = 3 * 2**20
"""Room left in every call for files that change between preparing the kit and the calls."""

ROOT = Path(__file__).resolve().parent.parent
KIT_DIR = ROOT / ".gpukit"


def _plan():
    """gpu/plan.py, the lease plan (loaded by path: gpu/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("gpu_plan", Path(__file__).resolve().parent / "plan.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


plan = _plan()


def download(dest: Path) -> list[Path]:
    """The cp312 wheels of onnxruntime-gpu and the missing dependencies (cached in `dest`)."""
    dest.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "-d", str(dest)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    specs = (ORT_GPU, GENAI_BUILDER, *DEPENDENCIES)
    subprocess.run(command + list(specs), check=True)
    wanted = [spec.split("==")[0].replace("-", "_").lower() for spec in specs]
    wheels = [w for w in sorted(dest.glob("*.whl")) if w.name.split("-")[0].lower() in wanted]
    missing = set(wanted) - {w.name.split("-")[0].lower() for w in wheels}
    if missing:
        raise SystemExit(f"gpu kit: pip left out {', '.join(sorted(missing))}")
    return wheels


def unpack(wheels: list[Path], site: Path) -> int:
    """Unpacks the wheels into one importable tree (what `pip install --target` makes); returns bytes left out."""
    if site.exists():
        shutil.rmtree(site)
    site.mkdir(parents=True)
    skipped = 0
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.infolist():
                if member.filename.startswith(LEFT_OUT):
                    skipped += member.file_size
                    continue
                archive.extract(member, site)
    return skipped


def tree_bytes() -> int:
    """Bytes of the working tree that every device call carries: tracked and untracked-not-ignored files."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.split(b"\0")
    return sum((ROOT / name.decode()).stat().st_size for name in listed if name and (ROOT / name.decode()).is_file())


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def split(archive: Path, part_bytes: int, dest: Path = KIT_DIR) -> list[Path]:
    """Splits the archive into `dest/part-NN` files of at most `part_bytes` (old parts there are removed first)."""
    for old in dest.glob("part-*"):
        old.unlink()
    parts = []
    with open(archive, "rb") as f:
        while block := f.read(part_bytes):
            part = dest / f"part-{len(parts) + 1:02d}"
            part.write_bytes(block)
            parts.append(part)
    return parts


def reassemble(parts: list[Path], joined: Path, digest: str) -> None:
    """Joins the parts into `joined` and checks its SHA-256 against `digest`, as `gpu/remote.sh install` does."""
    with open(joined, "wb") as out:
        for part in parts:
            out.write(part.read_bytes())
    if sha256(joined) != digest:
        raise SystemExit("gpu kit: reassembled archive does not match its SHA-256")


def commands(parts: list[Path], root: Path = ROOT, steps: list | None = None) -> str:
    """The device calls, in order, as markdown: each carries one part; the last also installs and starts measuring
    the first of `steps` (the plan's pending steps, `plan.pending()`, where None); the rest follow it, in order.

    Part paths are written relative to `root`, the repository root the calls run in.
    """
    steps = plan.pending() if steps is None else steps
    if not steps:
        raise SystemExit("gpu kit: every step of gpu/plan.py has its results; add the next measurement there first")
    lines = ["# GPU kit: the device calls, in order", "",
             "Each call must follow the last within 30 s (the machine is given back when idle longer, and the parts",
             "already sent are lost with it). `carry` names the part the call takes along.", ""]
    for i, part in enumerate(parts, 1):
        rel = part.relative_to(root)
        carry = [str(rel)]
        command = f"bash gpu/remote.sh receive {rel}"
        if i == len(parts):
            carry.append(".gpukit/SHA256")
            command += (f" && bash gpu/remote.sh install && {steps[0].environment()} bash gpu/remote.sh measure"
                        " --wait 540")
        lines += [f"{i}. carry `{json.dumps(carry)}`, command: `{command}`"]
    lines += ["", f"That measures `{steps[0].name}` ({steps[0].issue}, about {steps[0].minutes:g} device-minutes).",
              "Then, until it reports `measurement finished`, each within 30 s of the last:",
              "`bash gpu/remote.sh collect --wait 540` (no carry). Every call leaves the results so far in $OUT;",
              f"commit them as docs/results/gpu/plan/{steps[0].name}/ with the device and versions.", ""]
    if steps[1:]:
        lines += ["Where the lease has time left, the plan's next steps, in order (gpu/plan.py), each started when the",
                  "last has finished:", ""]
        lines += [f"- `{s.name}` ({s.issue}, about {s.minutes:g} minutes): `{s.environment()} bash gpu/remote.sh "
                  "measure --wait 540`" for s in steps[1:]]
        lines.append("")
    return "\n".join(lines)


def rehearse(parts: list[Path], digest: str, work: Path) -> None:
    """Reassembles the parts and unpacks the archive here, as gpu/remote.sh does there."""
    joined = work / "rehearsal.tar.xz"
    reassemble(parts, joined, digest)
    target = work / "rehearsal-site"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    subprocess.run(["tar", "-xJf", str(joined), "-C", str(target)], check=True)
    binding = next(target.glob("site/onnxruntime/capi/onnxruntime_pybind11_state*.so"), None)
    provider = target / "site/onnxruntime/capi/libonnxruntime_providers_cuda.so"
    if binding is None or not provider.exists():
        raise SystemExit("gpu kit rehearsal: the archive lacks onnxruntime's binding or its CUDA provider")
    print(f"rehearsal: {len(parts)} parts reassembled, SHA-256 matches, unpacked to {target}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python gpu/kit.py", description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "gpukit", help="downloads and the archive")
    parser.add_argument("--rehearse", action="store_true", help="reassemble and unpack the parts here afterwards")
    parser.add_argument("--split-only", action="store_true",
                        help="skip downloading and packing: split the archive already in --work for the current tree")
    args = parser.parse_args(argv)
    work: Path = args.work
    archive = work / "kit.tar.xz"
    if args.split_only:
        if not archive.exists():
            raise SystemExit(f"gpu kit: {archive} does not exist; run python gpu/kit.py first")
        wheels = sorted((work / "wheels").glob("*.whl"))
    else:
        wheels = download(work / "wheels")
        skipped = unpack(wheels, work / "site")
        print(f"packing {len(wheels)} wheels ({skipped / 2**20:.0f} MiB of unused libraries left out); "
              "xz takes a minute or two")
        subprocess.run(["tar", "-cf", str(archive), "-I", "xz -6 -T0", "-C", str(work), "site"], check=True)
    KIT_DIR.mkdir(exist_ok=True)
    tree = tree_bytes()
    part_bytes = CALL_LIMIT - tree - MARGIN
    if part_bytes < 8 * 2**20:
        raise SystemExit(f"gpu kit: the working tree ({tree / 2**20:.1f} MiB) leaves too little room for parts")
    parts = split(archive, part_bytes)
    digest = sha256(archive)
    (KIT_DIR / "SHA256").write_text(digest + "\n")
    manifest = {"archive_sha256": digest, "archive_bytes": archive.stat().st_size, "tree_bytes": tree,
                "part_bytes": part_bytes, "parts": [p.name for p in parts], "wheels": [w.name for w in wheels]}
    (KIT_DIR / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (KIT_DIR / "COMMANDS.md").write_text(commands(parts))
    print(f"{archive.stat().st_size / 2**20:.0f} MiB in {len(parts)} parts of at most {part_bytes / 2**20:.1f} MiB "
          f"(working tree {tree / 2**20:.1f} MiB); calls in {(KIT_DIR / 'COMMANDS.md').relative_to(ROOT)}")
    if args.rehearse:
        rehearse(parts, digest, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
