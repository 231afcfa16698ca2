"""The model zoo: the architectures the graph-optimisation literature reports on, exported to ONNX on demand.

The PyTorch definitions live in the repository's top-level ``models/`` folder (written for this project, random
weights from a fixed seed, nothing downloaded); this module names them, gives their configurations, input shapes
and published size figures, and builds them.  torch is imported only when a model is actually built, so
``import rlflow`` stays light.

Every full-size model has a ``-tiny`` variant (fewer layers, narrower, smaller input) that builds in about a
second, for tests; ``demo-block`` is a two-layer transformer encoder for ``make demo``.

The deployment section (family ``deploy``, `rlflow.zoo_deploy`) adds Hugging Face ``transformers`` models exported
as users export them; `names` leaves it out unless asked for by family.
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
from dataclasses import dataclass, field
from pathlib import Path

from rlflow import zoo_deploy
from rlflow.torch_threads import torch_threads
from rlflow.zoo_base import _PACKAGE, MODELS_DIR, SEED, Export
from rlflow.zoo_base import models_package as _models

# Bump when the build procedure in this file changes what ends up in the ONNX file: every model then rebuilds.
BUILD_VERSION = 1
DEPLOY = zoo_deploy.FAMILY  # the deployment section (rlflow/zoo_deploy.py): listed and built when asked for


@dataclass(frozen=True)
class ZooEntry:
    """One zoo model.

    Attributes:
        name: kebab-case name, also the file stem of the built model.
        family: "cnn", "transformer" or "rnn".
        input_shapes: graph input name -> static shape (batch 1).
        published: for full models, {"params", "flops", "source"}: the published parameter count and FLOPs
            (2 x multiply-accumulates) with where they come from; None for tiny variants and the demo block.
        module: the builder module in ``models/`` (``build(config) -> torch.nn.Module``).
        config: keyword arguments of the builder.
        input_dtypes: graph input name -> numpy dtype name (float32 when absent).
        input_ranges: integer inputs -> [low, high) of their values (token ids index a vocabulary).
        output_names: names of the graph outputs.
        description: one line for listings.
        transformer: for onnxruntime's transformers optimizer (deployment entries): {"model_type", "num_heads",
            "hidden_size"}, model_type as its ``optimizer.MODEL_TYPES`` names it; None elsewhere.
    """

    name: str
    family: str
    input_shapes: dict[str, tuple[int, ...]]
    published: dict | None
    module: str
    config: dict = field(default_factory=dict)
    input_dtypes: dict[str, str] = field(default_factory=dict)
    input_ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    output_names: tuple[str, ...] = ("logits",)
    description: str = ""
    transformer: dict | None = None

    @property
    def tiny(self) -> bool:
        """True for test-sized entries (the ``-tiny`` variants and the demo block)."""
        return self.published is None and self.family != DEPLOY

    def dtype(self, input_name: str) -> str:
        return self.input_dtypes.get(input_name, "float32")

    def __hash__(self) -> int:  # the dict fields are not hashable; names are unique
        return hash(self.name)


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


def _published(params: float, gmacs: float, source: str) -> dict:
    return {"params": float(params), "flops": 2.0 * gmacs * 1e9, "source": source}


_TV = "torchvision {} weights documentation (num_params; its 'GFLOPS' figure counts multiply-accumulates)"
_IMAGE = {"x": (1, 3, 224, 224)}


def _entries() -> list[ZooEntry]:
    def cnn(name, module, config, published, tiny_config, shape=_IMAGE, tiny_shape={"x": (1, 3, 64, 64)}, text=""):
        return [
            ZooEntry(name, "cnn", shape, published, module, config, description=text),
            ZooEntry(f"{name}-tiny", "cnn", tiny_shape, None, module, tiny_config, description=f"{text} (tiny)"),
        ]

    def tokens(seq: int, vocab: int) -> dict:
        return dict(input_shapes={"input_ids": (1, seq)}, input_dtypes={"input_ids": "int64"},
                    input_ranges={"input_ids": (0, vocab)})

    bert_tiny = dict(seq=32, vocab=1000, hidden=64, layers=2, heads=4, intermediate=256, max_positions=64)
    gpt_tiny = dict(seq=32, vocab=1000, hidden=64, layers=2, heads=4, max_positions=64)
    vit_tiny = dict(image_size=32, patch=8, hidden=64, layers=2, heads=4, intermediate=256, num_classes=10)
    return [
        *cnn("squeezenet-1.1", "squeezenet", {}, _published(1_235_496, 0.35, _TV.format("SqueezeNet1_1")),
             dict(width=0.25, num_classes=10), text="SqueezeNet 1.1, 224x224"),
        *cnn("resnet-18", "resnet", dict(block="basic", layers=[2, 2, 2, 2]),
             _published(11_689_512, 1.81, _TV.format("ResNet18")),
             dict(block="basic", layers=[1, 1, 1, 1], width=8, num_classes=10), text="ResNet-18, 224x224"),
        *cnn("resnet-50", "resnet", dict(block="bottleneck", layers=[3, 4, 6, 3]),
             _published(25_557_032, 4.09, _TV.format("ResNet50")),
             dict(block="bottleneck", layers=[1, 1, 1, 1], width=8, num_classes=10), text="ResNet-50, 224x224"),
        *cnn("resnext-50-32x4d", "resnet", dict(block="bottleneck", layers=[3, 4, 6, 3], groups=32, base_width=4),
             _published(25_028_904, 4.23, _TV.format("ResNeXt50_32X4D")),
             dict(block="bottleneck", layers=[1, 1, 1, 1], width=16, groups=4, base_width=8, num_classes=10),
             text="ResNeXt-50 (32x4d), 224x224"),
        *cnn("inception-v3", "inception", {},
             {"params": 23.9e6, "flops": 2 * 5.71e9,
              "source": "params: Keras Applications table (InceptionV3, 23.9M; torchvision's 27.2M includes the "
                        "training-only auxiliary classifier); FLOPs: " + _TV.format("Inception_V3") + ", 5.71"},
             dict(width=0.125, blocks=(1, 1, 1), num_classes=10), shape={"x": (1, 3, 299, 299)},
             tiny_shape={"x": (1, 3, 75, 75)}, text="Inception-v3, 299x299, no auxiliary head"),
        *cnn("mobilenet-v2", "mobilenet", {}, _published(3_504_872, 0.30, _TV.format("MobileNet_V2")),
             dict(width=0.25, repeats=0.34, num_classes=10), text="MobileNet-v2 1.0, 224x224"),
        *cnn("densenet-121", "densenet", dict(blocks=[6, 12, 24, 16]),
             _published(7_978_856, 2.83, _TV.format("DenseNet121")),
             dict(blocks=[2, 2, 2, 2], growth=8, init_features=16, num_classes=10), text="DenseNet-121, 224x224"),
        *cnn("nasnet-a-mobile", "nasnet", {},
             _published(5.3e6, 0.564, "Zoph et al. 2018, Learning Transferable Architectures, Table 2: "
                                      "NASNet-A (4 @ 1056), 5.3M parameters, 564M mult-adds"),
             dict(cells_per_stack=1, filters=8, stem_filters=8, image_size=64, num_classes=10),
             text="NASNet-A mobile (4 @ 1056), 224x224"),
        ZooEntry("nasrnn", "rnn", {f"x{i}": (1, 512) for i in range(5)},
                 {"params": 5.0 * 16 * 512 * 512 + 512, "flops": 2.0 * 5 * 16 * 512 * 512,
                  "source": "derived from TASO's definition (jiazhihao/TASO examples/nasrnn.py): 5 steps x 16 "
                            "(512x512) weights + a 512 initial state; 16 [1,512]x[512,512] MatMuls per step"},
                 "nasrnn", dict(hidden=512, steps=5), output_names=("h",), description="NasRNN (TASO), hidden 512, 5 steps"),
        ZooEntry("nasrnn-tiny", "rnn", {f"x{i}": (1, 64) for i in range(2)}, None, "nasrnn", dict(hidden=64, steps=2),
                 output_names=("h",), description="NasRNN (tiny)"),
        ZooEntry("bert-base", "transformer", published={"params": 110e6, "flops": 22.5e9, "source": (
            "params: Devlin et al. 2019 (BERT-base, 110M); FLOPs: Jiao et al. 2020, TinyBERT, Table 1 "
            "(BERT-base, 22.5B at sequence 128)")}, module="bert", config=dict(seq=128),
                 output_names=("last_hidden_state", "pooler_output"), description="BERT-base, sequence 128",
                 **tokens(128, 30522)),
        ZooEntry("bert-base-tiny", "transformer", published=None, module="bert", config=bert_tiny,
                 output_names=("last_hidden_state", "pooler_output"), description="BERT (tiny)", **tokens(32, 1000)),
        ZooEntry("vit-b-16", "transformer", _IMAGE, _published(86_567_656, 17.56, _TV.format("ViT_B_16")), "vit",
                 {}, description="ViT-B/16, 224x224"),
        ZooEntry("vit-b-16-tiny", "transformer", {"x": (1, 3, 32, 32)}, None, "vit", vit_tiny,
                 description="ViT (tiny)"),
        ZooEntry("gpt2-small", "transformer", published={"params": 124e6, "flops": 128 * (
            2 * 12 * 12 * 768**2 + 2 * 12 * 128 * 768 + 2 * 768 * 50257), "source": (
            "params: openai/gpt-2 README, 124M (it retracts the paper's 117M as an error); FLOPs: Kaplan et al. "
            "2020, Table 1, forward FLOPs per token 2N + 2 n_layer n_ctx d_attn + 2 d_model n_vocab (de-embedding), "
            "N = 12 n_layer d_model^2, times 128 tokens")}, module="gpt2", config=dict(seq=128),
                 description="GPT-2 small style decoder with tied LM head, sequence 128", **tokens(128, 50257)),
        ZooEntry("gpt2-small-tiny", "transformer", published=None, module="gpt2", config=gpt_tiny,
                 description="GPT-2 style decoder (tiny)", **tokens(32, 1000)),
        ZooEntry("demo-block", "transformer", {"x": (1, 32, 64)}, None, "transformer",
                 dict(layers=2, hidden=64, heads=4, seq=32), output_names=("y",),
                 description="2-layer transformer encoder, hidden 64, 4 heads, sequence 32"),
    ]


_REGISTRY: dict[str, ZooEntry] = {e.name: e for e in [*_entries(), *zoo_deploy.entries(ZooEntry)]}


def names(include_tiny: bool = True, family: str | None = None) -> list[str]:
    """Zoo model names in registry order; ``include_tiny=False`` keeps the full-size (published) models only.

    ``family=None`` gives the research zoo (every family but the deployment section, ``"deploy"``); a family name
    gives that family's models only.
    """
    return [n for n, e in _REGISTRY.items() if (include_tiny or not e.tiny)
            and (e.family == family if family else e.family != DEPLOY)]


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
    sources = _sources("common") + [Path(zoo_deploy.__file__)] if entry.family == DEPLOY else _sources(entry.module)
    for path in sources:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    recipe = dict(name=entry.name, module=entry.module, config=entry.config, inputs=entry.input_shapes,
                  dtypes=entry.input_dtypes, ranges=entry.input_ranges, outputs=entry.output_names, seed=SEED,
                  build=BUILD_VERSION, torch=importlib.metadata.version("torch"))
    if entry.family == DEPLOY:
        recipe.update(transformer=entry.transformer, transformers=_version("transformers"))
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
    if meta and meta.get("definition_hash") == definition_hash(name) and (out_dir / f"{name}.onnx").is_file():
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
    exported by `rlflow.zoo_deploy` (needs ``transformers``), the others from ``models/``.

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

    from rlflow.measure.flops import count_params

    name, proto = entry.name, exported.proto
    proto.ir_version = min(proto.ir_version, 10)  # onnxruntime 1.31 refuses IR 14, which onnx 1.23 writes
    digest = definition_hash(name)
    props = {p.key: p.value for p in proto.metadata_props}
    props.update(exported.props, **{"rlflow.zoo.name": name, "rlflow.zoo.definition_hash": digest})
    onnx.helper.set_model_props(proto, props)
    data = proto.SerializeToString()
    check = _check(data, exported.feeds, exported.expected, name)
    params, flops, nodes = count_params(proto), _flops_at(proto, entry.input_shapes), len(proto.graph.node)
    out_dir.mkdir(parents=True, exist_ok=True)
    onnx_path = out_dir / f"{name}.onnx"
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
    _write_atomic(out_dir / f"{name}.json", (json.dumps(metadata, indent=1, default=list) + "\n").encode())
    return BuildResult(name, onnx_path, False, seconds, params, flops, nodes)


def _flops_at(proto, shapes: dict) -> int:
    """FLOPs with the graph inputs fixed to ``shapes`` (a file with dynamic axes counts at its deployed shape)."""
    from rlflow.measure.flops import count_flops

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


def _check(data: bytes, feeds: dict, expected: list, name: str) -> dict:
    """Runs the model in an onnxruntime CPU session and compares with PyTorch's outputs."""
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
    if worst > 1e-3:
        raise RuntimeError(f"zoo model '{name}': onnxruntime differs from PyTorch by {worst:.2e} (relative)")
    return {"provider": "CPUExecutionProvider", "onnxruntime": ort.__version__, "max_rel_diff": worst}


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
