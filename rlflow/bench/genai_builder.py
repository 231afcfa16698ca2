"""onnxruntime-genai's model builder, run on a zoo decoder's weights (`rlflow.bench.builder_reference` measures what it
builds).

The builder (``python -m onnxruntime_genai.models.builder``) runs as a subprocess in a venv of its own (`make
genai-builder`: ``.venv-genai``; onnxruntime-genai pulls an onnxruntime that rlflow pins below), or, where
RLFLOW_GENAI_BUILDER names a copy of the package's ``models`` folder, as that folder's ``builder.py`` under this
Python (it needs torch, transformers and onnx-ir, not onnxruntime-genai's own libraries: the GPU kit carries it so).  The decoder's
transformers model (`rlflow.zoo.decoders`: the entry's configuration and the zoo's seed, so the weights are the
export's) is saved as a Hugging Face folder with a tokenizer made here: a word-level vocabulary of ``<i>`` tokens as long
as the model's, with bos/eos at the configuration's ids (the builder loads a tokenizer for its special tokens and
copies it; nothing is downloaded).  The builder's graph (``-p fp32 -e cpu``; ``fp16``/``cuda`` for the GPU; ``int4``
for `rlflow bench-precision`'s ``genai-int4`` peer, `rlflow.bench.builder_precision`) is kept in rlflow's cache
(``genai-builder/``) under a hash of the weights file, precision, provider and the venv's versions.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import onnx

from rlflow.errors import RlflowError
from rlflow.files import cache_dir, write_text_atomic

GENAI_VENV = Path(__file__).resolve().parents[2] / ".venv-genai"
"""Where `make genai-builder` puts the builder's venv (RLFLOW_GENAI_VENV names another)."""

BUILDER_SECONDS = 3600
PRECISIONS = ("fp32", "fp16", "int4")
"""The builder's -p values rlflow asks for: the export's own precision (the reference), int4 (a quantizer's peer)."""
_VERSIONS = """import importlib.metadata as m, json
versions = {}
for p in %r:
    try:
        versions[p] = m.version(p)
    except m.PackageNotFoundError:
        versions[p] = None
print(json.dumps(versions))"""
_PACKAGES = ("onnxruntime-genai", "onnxruntime", "torch", "transformers")


@dataclass(frozen=True)
class Decoder:
    """A zoo decoder entry as the reference needs it."""

    name: str
    arch: object  # rlflow.zoo.decoder_architectures.DecoderArchitecture
    kind: str  # prefill or decode
    dtype: str  # float32 or float16


def genai_python(venv: str | os.PathLike | None = None) -> Path | None:
    """The builder venv's python (`venv`, else RLFLOW_GENAI_VENV, else ``.venv-genai``); None when it is missing."""
    python = Path(venv or os.environ.get("RLFLOW_GENAI_VENV") or GENAI_VENV) / "bin" / "python"
    return python if python.is_file() else None


def builder_command(python: Path | None = None) -> list[str] | None:
    """How to start the builder: the copy of its source RLFLOW_GENAI_BUILDER names, run by this Python; else
    `python -m onnxruntime_genai.models.builder` in its venv (`python`, else `genai_python`); None when neither is
    there."""
    source = os.environ.get("RLFLOW_GENAI_BUILDER")
    if source and (Path(source) / "builder.py").is_file() and python is None:
        return [sys.executable, str(Path(source) / "builder.py")]
    python = python or genai_python()
    return [str(python), "-m", "onnxruntime_genai.models.builder"] if python is not None else None


def _required(python: Path | None) -> list[str]:
    command = builder_command(python)
    if command is None:
        raise RlflowError("onnxruntime-genai's builder is not installed: `make genai-builder` makes .venv-genai")
    return command


def decoder(entry) -> Decoder:
    """The decoder of a zoo entry: a `ZooEntry`, its name, its JSON (``rlflow zoo build`` writes NAME.json) as a dict
    or a path.  A JSON's configuration must be the one the zoo's table has now (else its weights are not these).

    Raises:
        RlflowError: not a decoder of the zoo, or a JSON built from another configuration.
    """
    from rlflow import zoo
    from rlflow.zoo import decoders

    if isinstance(entry, (str, os.PathLike)) and str(entry).endswith(".json"):
        entry = json.loads(Path(entry).read_text())
    recorded = None
    if isinstance(entry, dict):
        recorded, entry = entry.get("config"), entry["name"]
    if isinstance(entry, str):
        try:
            entry = zoo.get(entry)
        except ValueError as exc:
            raise RlflowError(str(exc)) from None
    if not decoders.owns(entry):
        raise RlflowError(f"{entry.name} is not one of the zoo's decoders: the builder reference is for those only")
    config = dict(entry.config)
    if recorded is not None and json.loads(json.dumps(config)) != recorded:
        raise RlflowError(f"{entry.name}'s JSON records another configuration than the zoo's: rebuild it")
    return Decoder(entry.name, decoders._BY_KEY[config["architecture"]], config["kind"], config["dtype"])


def decoder_of(model: onnx.ModelProto, path: str | os.PathLike | None = None) -> Decoder | None:
    """The zoo decoder a model is (its metadata's ``rlflow.zoo.name``, else its file stem), or None."""
    names = [p.value for p in model.metadata_props if p.key == "rlflow.zoo.name"] + ([Path(path).stem] if path else [])
    for name in names:
        try:
            return decoder(name)
        except RlflowError:
            continue
    return None


def write_tokenizer(folder: Path, config: Mapping) -> None:
    """A word-level tokenizer as long as the model's vocabulary (``<0>``, ``<1>``, ...), its bos and eos tokens at the
    configuration's ids: what the builder reads, made offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(config["vocab_size"])}, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=f"<{config['bos_token_id']}>",
                            eos_token=f"<{config['eos_token_id']}>", unk_token="<0>").save_pretrained(folder)


def write_hf_folder(dec: Decoder, folder: str | os.PathLike) -> Path:
    """The decoder's transformers model (the zoo's seed: the export's weights) and a tokenizer, as a Hugging Face
    folder."""
    from rlflow.zoo import decoders

    folder = Path(folder)
    decoders._model(dec.arch, dec.dtype).save_pretrained(folder)
    write_tokenizer(folder, dec.arch.config)
    return folder


def _weights_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")) + [folder / "config.json"]:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def run_builder(hf_folder: Path, out: Path, *, precision: str = "fp32", provider: str = "cpu",
                python: Path | None = None, timeout: float = BUILDER_SECONDS) -> Path:
    """The builder on a Hugging Face folder, offline; returns its model.onnx (its log is ``builder.log`` beside it).

    Raises:
        RlflowError: no builder venv, a precision not in PRECISIONS, or the builder failed (the log's last lines say
            why).
    """
    builder = _required(python)
    if precision not in PRECISIONS:
        raise RlflowError(f"the genai builder's precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with tempfile.TemporaryDirectory(prefix="rlflow-genai-cache-") as cache:
        command = builder + ["-i", str(hf_folder), "-o", str(out), "-p", precision, "-e", provider, "-c", cache]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    (out / "builder.log").write_text(" ".join(command) + "\n" + done.stdout + done.stderr)
    if done.returncode != 0 or not (out / "model.onnx").is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RlflowError(f"the genai builder failed ({done.returncode}): {' / '.join(tail)}")
    return out / "model.onnx"


def build_reference(dec: Decoder, *, precision: str = "fp32", provider: str = "cpu", python: Path | None = None,
                    cache: str | os.PathLike | None = None) -> tuple[Path, dict]:
    """(the builder's model.onnx for `dec`, its record: digest, precision, provider, versions, seconds), built once
    per weights, precision, provider and builder version (``genai-builder/`` in rlflow's cache)."""
    builder = _required(python)
    versions = json.loads(subprocess.run([builder[0], "-c", _VERSIONS % (_PACKAGES,)], capture_output=True,
                                         text=True, check=True).stdout)
    if builder[1] != "-m":  # a copy of the builder's source: its version is the one it was copied from
        versions["onnxruntime-genai"] = os.environ.get("RLFLOW_GENAI_BUILDER_VERSION", "source copy")
    root = Path(cache) if cache is not None else cache_dir("genai-builder")
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rlflow-hf-", dir=root) as tmp:
        start = time.monotonic()
        hf = write_hf_folder(dec, Path(tmp) / "hf")
        record = {"weights": _weights_digest(hf), "precision": precision, "provider": provider, "versions": versions}
        key = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]
        out = root / f"{dec.arch.key}-{dec.dtype}-{precision}-{provider}-{key}"
        if (out / "reference.json").is_file():
            return out / "model.onnx", {**json.loads((out / "reference.json").read_text()), "cached": True}
        run_builder(hf, Path(tmp) / "out", precision=precision, provider=provider, python=python)
        record["seconds"] = round(time.monotonic() - start, 2)
        shutil.rmtree(out, ignore_errors=True)
        (Path(tmp) / "out").rename(out)
    write_text_atomic(out / "reference.json", json.dumps(record, indent=1) + "\n")
    return out / "model.onnx", record
