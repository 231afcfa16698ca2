"""The model zoo: the architectures the graph-optimisation literature reports on, exported to ONNX on demand.

The PyTorch definitions live in the repository's top-level ``models/`` folder (written for this project, random
weights from a fixed seed, nothing downloaded); this module names them, gives their configurations, input shapes
and published size figures, and builds them.  torch is imported only when a model is actually built, so
``import rlflow`` stays light.

Every full-size model has a ``-tiny`` variant (fewer layers, narrower, smaller input) that builds in about a
second, for tests; ``demo-block`` is a two-layer transformer encoder for ``make demo``.

The deployment section (family ``deploy``, `rlflow.zoo.deploy`, its decoders `rlflow.zoo.decoders`, its encoders'
export-style variants `rlflow.zoo.deploy_styles`) adds Hugging Face
``transformers`` models exported as users export them; `names` leaves it out unless asked for by family, and its
GPU entries (``ZooEntry.gpu``: float16, or too large for the CPU bench) unless asked for too.

The trained section (family ``trained``, `rlflow.zoo.trained`, its data `rlflow.zoo.stdlib_text`) is a small
Llama-style decoder that the build trains on the Python standard library, with a held-out ``.npz`` beside it, for
quantisation accuracy; `names` leaves it out unless asked for by family (a full build trains for minutes).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from rlflow.torch_threads import torch_threads
from rlflow.zoo import decoders as zoo_decoders
from rlflow.zoo import deploy as zoo_deploy
from rlflow.zoo import deploy_styles as zoo_deploy_styles
from rlflow.zoo import trained as zoo_trained
from rlflow.zoo.base import _PACKAGE, MODELS_DIR, SEED, Export
from rlflow.zoo.base import models_package as _models
from rlflow.zoo.catalog import ZooEntry, literature_entries

# Bump when the build procedure in this file changes what ends up in the ONNX file: every model then rebuilds.
BUILD_VERSION = 1
DEPLOY = zoo_deploy.FAMILY  # the deployment section (rlflow/zoo/deploy.py): listed and built when asked for
TRAINED = zoo_trained.FAMILY  # the trained section (rlflow/zoo/trained.py): listed and built when asked for


@dataclass
class BuildResult:
    """What `build` did: where the model is, whether it was already up to date, and its size."""

    name: str
    path: Path
    skipped: bool
    seconds: float
    params: int
    flops: int
    nodes: int


_REGISTRY: dict[str, ZooEntry] = {e.name: e for e in [*literature_entries(), *zoo_deploy.entries(ZooEntry),
                                                         *zoo_decoders.entries(ZooEntry),
                                                         *zoo_deploy_styles.entries(ZooEntry),
                                                         *zoo_trained.entries(ZooEntry)]}


def names(include_tiny: bool = True, family: str | None = None, include_gpu: bool = False) -> list[str]:
    """Zoo model names in registry order; ``include_tiny=False`` keeps the full-size (published) models only.

    ``family=None`` gives the research zoo (every family but the deployment and trained sections, ``"deploy"`` and
    ``"trained"``); a family name gives that family's models only.  GPU entries (``ZooEntry.gpu``) only with
    ``include_gpu``, so that the CPU's lists and builds skip them; `get` and `build` take them by name.
    """
    return [n for n, e in _REGISTRY.items() if (include_tiny or not e.tiny) and (include_gpu or not e.gpu)
            and (e.family == family if family else e.family not in (DEPLOY, TRAINED))]


def get(name: str) -> ZooEntry:
    """The entry called ``name``.

    Raises:
        ValueError: no such model.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown zoo model '{name}'; choose from: {', '.join(_REGISTRY)}") from None


def _sources(module: str) -> list[Path]:
    """The builder module, the modules it imports relatively from ``models/``, and ``models/common.py``."""
    found, todo = [], [module, "common"]
    while todo:
        path = MODELS_DIR / f"{todo.pop()}.py"
        if path in found:
            continue
        found.append(path)
        todo += re.findall(r"^from \.(\w+) import", path.read_text(), flags=re.M)
    return sorted(found)


def definition_hash(name: str) -> str:
    """Hash of everything that determines the built file: sources, entry config, seed, torch (and transformers)
    version."""
    entry = get(name)
    digest = hashlib.sha256()
    if zoo_trained.owns(entry):  # its training, data and export code (its config records the exporter's opset)
        sources = [Path(zoo_trained.__file__), Path(zoo_trained.__file__).with_name("stdlib_text.py")]
    elif entry.family == DEPLOY:
        sources = _sources("common") + [Path(zoo_deploy.__file__)]
    else:
        sources = _sources(entry.module)
    if zoo_decoders.owns(entry):  # the decoders' export code: the encoders' builds do not depend on it
        sources.append(Path(zoo_decoders.__file__))
    if zoo_deploy_styles.owns(entry):  # the export-style variants' code: the section's own builds do not depend on it
        sources.append(Path(zoo_deploy_styles.__file__))
    for path in sources:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    recipe = dict(name=entry.name, module=entry.module, config=entry.config, inputs=entry.input_shapes,
                  dtypes=entry.input_dtypes, ranges=entry.input_ranges, outputs=entry.output_names, seed=SEED,
                  build=BUILD_VERSION, torch=importlib.metadata.version("torch"))
    if entry.family in (DEPLOY, TRAINED):
        recipe.update(transformer=entry.transformer, transformers=_version("transformers"))
    if zoo_trained.owns(entry):  # the Python whose stdlib it reads
        recipe.update(zoo_trained.data_recipe())
    digest.update(json.dumps(recipe, sort_keys=True, default=list).encode())
    return digest.hexdigest()[:16]


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _read_metadata(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _up_to_date(name: str, out_dir: Path) -> dict | None:
    meta = _read_metadata(out_dir / f"{name}.json")
    if meta and meta.get("definition_hash") == definition_hash(name) and (out_dir / f"{name}.onnx").is_file() \
            and all((out_dir / f"{name}{suffix}").is_file() for suffix in meta.get("sidecars", [])):
        return meta
    return None


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def build(name: str, out_dir, *, force: bool = False) -> BuildResult:
    """Builds ``out_dir/<name>.onnx`` and its metadata ``out_dir/<name>.json``.

    Skipped (``skipped=True``) when the existing metadata records the same definition hash, unless ``force``.
    The model is checked by an onnxruntime CPU session (outputs finite and equal to PyTorch's within tolerance)
    before anything is written; both files are replaced atomically.  Deployment entries (family ``deploy``) are
    exported by `rlflow.zoo.deploy` (needs ``transformers``), the others from ``models/``.

    Raises:
        ValueError: unknown name.
        RuntimeError: the exported model fails the onnxruntime check.
    """
    entry = get(name)
    out_dir = Path(out_dir)
    start = time.perf_counter()
    meta = None if force else _up_to_date(name, out_dir)
    if meta is not None:
        return BuildResult(name, out_dir / f"{name}.onnx", True, time.perf_counter() - start, meta["params"],
                           meta["flops"], meta["nodes"])
    if zoo_trained.owns(entry):
        exported = zoo_trained.export(entry)
    elif zoo_decoders.owns(entry):
        exported = zoo_decoders.export(entry)
    elif zoo_deploy_styles.owns(entry):
        exported = zoo_deploy_styles.export(entry)
    else:
        exported = zoo_deploy.export(entry) if entry.family == DEPLOY else _export_zoo_model(entry)
    return _write(entry, exported, out_dir, start)


def _export_zoo_model(entry: ZooEntry) -> Export:
    """A ``models/`` builder's model, seeded, batch-norm calibrated, exported with ``models/common.py``'s settings."""
    import onnx
    import torch

    common = importlib.import_module(f"{_models().__name__}.common")
    builder = importlib.import_module(f"{_PACKAGE}.{entry.module}")
    with torch_threads(1):  # bit-identical batch-norm calibration, and polite on shared machines
        torch.manual_seed(SEED)
        model = builder.build(dict(entry.config))
        common.init_weights(model, SEED, "transformer" if entry.family == "transformer" else "cnn")
        common.calibrate_batchnorm(model, tuple(_example_inputs(entry, batch=2).values()))
        model.eval()
        inputs = _example_inputs(entry)
        with torch.no_grad():
            expected = model(*inputs.values())
        expected = [t.numpy() for t in (expected if isinstance(expected, tuple) else (expected,))]
        data = common.export(model, inputs, list(entry.output_names))
    return Export(onnx.load_from_string(data), {k: v.numpy() for k, v in inputs.items()}, expected,
                  common.EXPORTER, common.OPSET)


def _write(entry: ZooEntry, exported: Export, out_dir: Path, start: float) -> BuildResult:
    """Stamps, checks against PyTorch, counts and writes the model and its sidecar JSON (both atomically)."""
    import onnx
    import torch

    from rlflow.graph.flops import count_params

    name, proto = entry.name, exported.proto
    proto.ir_version = min(proto.ir_version, 10)  # onnxruntime 1.31 refuses IR 14, which onnx 1.23 writes
    digest = definition_hash(name)
    props = {p.key: p.value for p in proto.metadata_props}
    props.update(exported.props, **{"rlflow.zoo.name": name, "rlflow.zoo.definition_hash": digest})
    onnx.helper.set_model_props(proto, props)
    data = proto.SerializeToString()
    check = _check(data, exported.feeds, exported.expected, name, exported.tolerance)
    params, flops, nodes = count_params(proto), _flops_at(proto, entry.input_shapes), len(proto.graph.node)
    out_dir.mkdir(parents=True, exist_ok=True)
    onnx_path = out_dir / f"{name}.onnx"
    for suffix, content in exported.sidecars.items():
        _write_atomic(out_dir / f"{name}{suffix}", content)
    _write_atomic(onnx_path, data)
    seconds = time.perf_counter() - start
    metadata = dict(
        name=name, family=entry.family, definition_hash=digest, exporter=exported.exporter,
        torch=torch.__version__, onnx=onnx.__version__, opset=exported.opset, ir_version=proto.ir_version, seed=SEED,
        input_shapes={k: list(v) for k, v in entry.input_shapes.items()},
        input_dtypes={k: entry.dtype(k) for k in entry.input_shapes},
        input_ranges={k: list(v) for k, v in entry.input_ranges.items()}, output_names=list(entry.output_names),
        config=entry.config, params=params, flops=flops, nodes=nodes,
        ops=dict(sorted(_op_counts(proto).items())), bytes=len(data), sha256=hashlib.sha256(data).hexdigest(),
        check=check, build_seconds=round(seconds, 2), published=entry.published, **exported.metadata,
    )
    if exported.sidecars:
        metadata["sidecars"] = sorted(exported.sidecars)
    _write_atomic(out_dir / f"{name}.json", (json.dumps(metadata, indent=1, default=list) + "\n").encode())
    return BuildResult(name, onnx_path, False, seconds, params, flops, nodes)


def _flops_at(proto, shapes: dict) -> int:
    """FLOPs with the graph inputs fixed to ``shapes`` (a file with dynamic axes counts at its deployed shape)."""
    from rlflow.graph.flops import count_flops

    saved = [value.SerializeToString() for value in proto.graph.input]
    try:
        for value in proto.graph.input:
            if value.name in shapes:
                dims = value.type.tensor_type.shape.dim
                for dim, size in zip(dims, shapes[value.name]):
                    dim.Clear()
                    dim.dim_value = size
        return count_flops(proto)
    finally:
        for value, data in zip(proto.graph.input, saved):
            value.ParseFromString(data)


def _example_inputs(entry: ZooEntry, batch: int = 1) -> dict:
    """Seeded inputs: N(0, 1) floats, integers uniform in their range; ``batch`` replaces the first dimension."""
    import torch

    gen = torch.Generator().manual_seed(SEED + batch)
    inputs = {}
    for name, shape in entry.input_shapes.items():
        shape = (batch, *shape[1:])
        if entry.dtype(name).startswith("int"):
            low, high = entry.input_ranges.get(name, (0, 2))
            inputs[name] = torch.randint(low, high, shape, generator=gen, dtype=getattr(torch, entry.dtype(name)))
        else:
            inputs[name] = torch.randn(shape, generator=gen)
    return inputs


def _check(data: bytes, feeds: dict, expected: list, name: str, tolerance: float = 1e-3) -> dict:
    """Runs the model in an onnxruntime CPU session and compares with PyTorch's outputs (the largest difference,
    relative to each output's largest magnitude, within `tolerance`)."""
    import numpy as np
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    outputs = session.run(None, feeds)
    worst = 0.0
    for got, want in zip(outputs, expected):
        scale = float(np.abs(want).max()) or 1.0
        if got.shape != want.shape or not np.isfinite(got).all():
            raise RuntimeError(f"zoo model '{name}': onnxruntime output has shape {got.shape} or non-finite values")
        worst = max(worst, float(np.abs(got - want).max()) / scale)
    if worst > tolerance:
        raise RuntimeError(f"zoo model '{name}': onnxruntime differs from PyTorch by {worst:.2e} (relative)")
    return {"provider": "CPUExecutionProvider", "onnxruntime": ort.__version__, "max_rel_diff": worst,
            "tolerance": tolerance}


def _op_counts(proto) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in proto.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def default_cache_dir() -> Path:
    """``$RLFLOW_CACHE/zoo`` when RLFLOW_CACHE is set, else ``~/.cache/rlflow/zoo``."""
    from rlflow.files import cache_dir

    return cache_dir("zoo")


def summary(name: str, cache_dir=None, *, build_missing: bool = True) -> dict:
    """Name, family, parameters, FLOPs, node count and input shapes of a zoo model.

    Reads the metadata of an up-to-date build in ``cache_dir`` (default `default_cache_dir`) or in the
    repository's ``models/`` folder; otherwise builds the model into ``cache_dir`` first (with ``build_missing=False``:
    None for the figures instead).
    """
    entry = get(name)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    meta = _up_to_date(name, cache) or _up_to_date(name, MODELS_DIR)
    if meta is None and build_missing:
        build(name, cache)
        meta = _up_to_date(name, cache)
    meta = meta or {}
    return {"name": name, "family": entry.family, "params": meta.get("params"), "flops": meta.get("flops"),
            "nodes": meta.get("nodes"), "input_shapes": dict(entry.input_shapes)}
