"""The zoo's deployment section: Hugging Face ``transformers`` architectures exported the way users export them.

Each architecture is built from its configuration (random weights from the zoo's seed, nothing downloaded) and
exported by both torch exporters, with the batch and sequence axes dynamic:

* ``-ts``: ``torch.onnx.export(..., dynamo=False)`` (TorchScript), opset 17, ``dynamic_axes``;
* ``-dynamo``: ``torch.onnx.export(..., dynamo=True)``, opset 18, ``dynamic_shapes`` (its default optimisation on).

One entry per (architecture, deployed shape, exporter).  The entries of one (architecture, exporter) share one
export (made once per process) and differ in the deployed shape, which each file records in its
``metadata_props`` under ``rlflow.graph.input_shapes`` (``name:d0,d1;name:d0,...``, the ``--input-shape`` syntax) and at
which its build is checked against PyTorch.  ``transformers`` (the ``deploy`` extra) is imported only by a build.
"""

from __future__ import annotations

import functools
import inspect
import io
import warnings

from rlflow.graph.input_shapes import DEPLOYED_SHAPES_KEY, format_input_shapes
from rlflow.torch_threads import torch_threads
from rlflow.zoo.deploy_architectures import ARCHITECTURES, Architecture

FAMILY = "deploy"
# exporter suffix -> (opset, description recorded in the metadata)
EXPORTERS = {
    "ts": (17, "torch.onnx.export (TorchScript, dynamo=False), opset 17, dynamic_axes"),
    "dynamo": (18, "torch.onnx.export (dynamo=True, default optimize), opset 18, dynamic_shapes"),
}
_BY_KEY = {a.key: a for a in ARCHITECTURES}


def _output_names(arch: Architecture) -> tuple[str, ...]:
    if arch.kind in ("prefill", "decode"):
        layers = arch.config["n_layer"]
        return arch.outputs + tuple(f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value"))
    return arch.outputs


def entries(entry_type) -> list:
    """The section's zoo entries (``entry_type`` is ``rlflow.zoo.ZooEntry``), by architecture, exporter, shape."""
    out = []
    for arch in ARCHITECTURES:
        for exporter, (opset, _) in EXPORTERS.items():  # shapes innermost: consecutive builds share the export
            for suffix, shapes in arch.shapes.items():
                ints = [n for n in shapes if n in ("input_ids", "attention_mask")]
                ranges = {n: (0, arch.vocab if n == "input_ids" else 2) for n in ints}
                out.append(entry_type(
                    f"{arch.key}-{suffix}-{exporter}", FAMILY, dict(shapes), None, "transformers",
                    dict(architecture=arch.key, model=arch.model, kind=arch.kind, config=arch.config,
                         exporter=exporter, opset=opset),
                    input_dtypes={n: "int64" for n in ints}, input_ranges=ranges, output_names=_output_names(arch),
                    description=f"{arch.description}, {suffix}, {exporter} exporter", transformer=arch.transformer))
    return out


def _model(arch: Architecture):
    """The transformers model of ``arch`` in eval mode, weights from the zoo's seed (``models/common.py``)."""
    import torch
    import transformers

    from rlflow.zoo import base as zoo
    common = __import__(f"{zoo.models_package().__name__}.common", fromlist=["init_weights"])
    torch.manual_seed(zoo.SEED)
    if arch.model == "WhisperEncoder":
        from transformers.models.whisper.modeling_whisper import WhisperEncoder

        model = WhisperEncoder(transformers.WhisperConfig(**arch.config))
    else:
        cls = getattr(transformers, arch.model)
        model = cls(cls.config_class(**arch.config))
    # N(0, 0.02) weights and non-trivial norms, as for the zoo's own transformers (no two weights equal)
    common.init_weights(model, zoo.SEED, "transformer")
    return model.eval()


def _wrap(model, arch: Architecture):
    """The module the exporters see: positional tensors in (``*inputs``, or ``input_ids, attention_mask, *past``
    for a decode step, which rebuilds the ``DynamicCache`` from flat tensors), a tuple of tensors out."""
    import torch

    input_names = list(next(iter(arch.shapes.values())))

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *inputs):
            if arch.kind == "prefill":
                out = self.model(**dict(zip(input_names, inputs)), use_cache=True, return_dict=True)
                return (out.logits, *flat_cache(out))
            out = self.model(**dict(zip(input_names, inputs)), return_dict=True)
            return tuple(out[k] for k in arch.outputs)

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, *past):
            from transformers import DynamicCache

            cache = DynamicCache(config=self.model.config)
            for layer in range(len(past) // 2):
                cache.update(past[2 * layer], past[2 * layer + 1], layer)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, return_dict=True,
                             **{keyword: cache})
            return (out.logits, *flat_cache(out))

    keyword = cache_keyword(model)
    return (Decoder if arch.kind == "decode" else Encoder)().eval()


def cache_keyword(model) -> str:
    """The name the model's forward takes its cache by: transformers 5.24 renamed ``past_key_values`` to ``cache``, and
    an earlier 5.x takes an unknown name into ``**kwargs`` and ignores it (a decode step that never reads its cache)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def flat_cache(out) -> list:
    """The output's cache as flat tensors: layer 0's keys, its values, layer 1's keys, ..."""
    cache = out.get("cache", None) or out.get("past_key_values")  # transformers 5.x renamed it
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def check_cache(name: str, cached: int, expected: int) -> None:
    """Refuses a step whose reference returned a cache of `cached` tokens where `expected` were due: its model ignored
    the cache it was given, and the export would agree with it.

    Raises:
        RlflowError: they differ.
    """
    if cached != expected:
        import transformers

        from rlflow.errors import RlflowError

        raise RlflowError(f"zoo model '{name}': transformers {transformers.__version__} returned a cache of {cached} "
                          f"tokens for {expected - 1} given and 1 new: the step would not use its cache")


def _trace_inputs(arch: Architecture) -> dict:
    """Inputs for tracing: batch 2 and sequence/cache lengths of 8 so that no dynamic axis is 0, 1 or deployed."""
    import torch

    from rlflow.zoo import base as zoo
    gen = torch.Generator().manual_seed(zoo.SEED)
    inputs = {}
    for name, shape in next(iter(arch.shapes.values())).items():
        shape = list(shape)
        shape[0] = 2
        if arch.kind == "decode":
            shape[-2 if name.startswith("past") else -1] = 9 if name == "attention_mask" else \
                (8 if name.startswith("past") else 1)
        elif arch.kind in ("text", "prefill"):
            shape[1] = 8
        inputs[name] = _tensor(name, tuple(shape), arch, gen)
    return inputs


def _tensor(name: str, shape: tuple, arch: Architecture, gen):
    import torch

    if name == "input_ids":
        return torch.randint(0, arch.vocab, shape, generator=gen)
    if name == "attention_mask":  # right padding (a quarter of the positions) for encoders, none for GPT-2
        mask = torch.ones(shape, dtype=torch.int64)
        if arch.kind == "text":
            mask[..., shape[-1] - shape[-1] // 4:] = 0
        return mask
    return torch.randn(shape, generator=gen)


def _dynamic_axes(arch: Architecture, names: list, outputs: tuple) -> dict:
    """TorchScript's dynamic_axes: name -> {axis: symbol}."""
    axes = {}
    for name in names:
        if name.startswith("past"):
            axes[name] = {0: "batch", 2: "past_sequence"}
        elif arch.kind == "decode" and name == "attention_mask":
            axes[name] = {0: "batch", 1: "total_sequence"}
        elif arch.kind in ("text", "prefill", "decode"):
            axes[name] = {0: "batch", 1: "sequence"}
        else:
            axes[name] = {0: "batch"}
    for name in outputs:
        if name.startswith("present"):
            axes[name] = {0: "batch", 2: "total_sequence"}
        elif arch.kind in ("text", "prefill", "decode") and name != "pooler_output":
            axes[name] = {0: "batch", 1: "sequence"}
        else:
            axes[name] = {0: "batch"}
    return axes


def _dynamic_shapes(arch: Architecture, names: list):
    """dynamo's dynamic_shapes, matching the wrapper's signature (``*inputs`` or ``input_ids, mask, *past``)."""
    from torch.export import Dim

    batch = Dim("batch")
    if arch.kind == "decode":  # the mask covers past + 1 tokens: a derived dimension, so input_ids keeps length 1
        past = Dim("past_sequence", min=1, max=arch.config["n_positions"] - 1)
        return ({0: batch}, {0: batch, 1: past + 1}, tuple({0: batch, 2: past} for _ in names[2:]))
    if arch.kind in ("text", "prefill"):
        limit = arch.config.get("max_position_embeddings", arch.config.get("n_positions", 512))
        if arch.model == "RobertaModel":
            limit -= 2  # positions start after the padding index
        seq = Dim("sequence", min=1, max=limit)
        return (tuple({0: batch, 1: seq} for _ in names),)
    return (tuple({0: batch} for _ in names),)


@functools.lru_cache(maxsize=1)
def _exported(key: str, exporter: str):
    """(ONNX bytes, wrapped torch module) of one (architecture, exporter): made once, shared by its shapes."""
    return export_architecture(_BY_KEY[key], exporter)


def export_architecture(arch: Architecture, exporter: str):
    """(ONNX bytes, wrapped torch module) of `arch` exported by `exporter` (``ts`` or ``dynamo``) as users export it,
    dynamic axes included; the test fixtures' small cuts are made this way too (tests/fixtures/exports/make.py)."""
    import torch

    opset = EXPORTERS[exporter][0]
    wrapper = _wrap(_model(arch), arch)
    inputs = _trace_inputs(arch)
    names, outputs = list(inputs), list(_output_names(arch))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "ts":
            buffer = io.BytesIO()
            torch.onnx.export(wrapper, tuple(inputs.values()), buffer, dynamo=False, opset_version=opset,
                              input_names=names, output_names=outputs,
                              dynamic_axes=_dynamic_axes(arch, names, tuple(outputs)), do_constant_folding=True)
            data = buffer.getvalue()
        else:
            data = _dynamo_program(arch, wrapper, inputs).model_proto.SerializeToString()
    wrapper.eval()  # the TorchScript exporter restores the wrapper's previous training flag
    return data, wrapper


def _dynamo_program(arch: Architecture, wrapper, inputs: dict):
    """torch's dynamo export of the wrapped model at the section's opset, its dynamic shapes declared (an
    ONNXProgram)."""
    import torch

    names = list(inputs)
    return torch.onnx.export(wrapper, tuple(inputs.values()), dynamo=True, opset_version=EXPORTERS["dynamo"][0],
                             input_names=names, output_names=list(_output_names(arch)),
                             dynamic_shapes=_dynamic_shapes(arch, names), verbose=False)


def export_to_file(arch: Architecture, path) -> None:
    """`arch` exported by the dynamo exporter straight to `path`, its weights in one external data file beside it
    (`<name>.data`): for models over protobuf's 2 GB, which `export_architecture`'s bytes cannot hold.  The deployed
    shape of its first entry goes into the metadata, as the zoo's exports have it."""
    import onnx
    import torch

    from rlflow.graph.model_file import max_ir_version

    wrapper = _wrap(_model(arch), arch)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = _dynamo_program(arch, wrapper, _trace_inputs(arch))
    program.save(str(path), external_data=True)
    proto = onnx.load(str(path), load_external_data=False)
    proto.metadata_props.add(key=DEPLOYED_SHAPES_KEY, value=format_input_shapes(next(iter(arch.shapes.values()))))
    proto.ir_version = min(proto.ir_version, max_ir_version())
    onnx.save(proto, str(path))  # the proto alone: the weights stay where the exporter wrote them


def export(entry):
    """The zoo's ``Export`` of a deployment entry: the shared export, checked at the entry's deployed shape.

    Raises:
        RlflowError: transformers is not installed.
    """
    try:
        import transformers
    except ImportError:
        from rlflow.errors import RlflowError

        raise RlflowError(f"zoo model '{entry.name}' needs transformers: pip install 'rlflow[deploy]'") from None
    import onnx
    import torch

    from rlflow.zoo import base as zoo
    arch = _BY_KEY[entry.config["architecture"]]
    exporter = entry.config["exporter"]
    data, wrapper = _exported(arch.key, exporter)
    gen = torch.Generator().manual_seed(zoo.SEED + 1)
    inputs = {name: _tensor(name, shape, arch, gen) for name, shape in entry.input_shapes.items()}
    with torch_threads(1), torch.no_grad():
        expected = [t.numpy() for t in wrapper(*inputs.values())]
    if arch.kind == "decode":
        check_cache(entry.name, expected[1].shape[2], entry.input_shapes["attention_mask"][1])
    return zoo.Export(
        proto=onnx.load_from_string(data), feeds={k: v.numpy() for k, v in inputs.items()}, expected=expected,
        exporter=EXPORTERS[exporter][1], opset=EXPORTERS[exporter][0],
        props={DEPLOYED_SHAPES_KEY: format_input_shapes(entry.input_shapes), "rlflow.zoo.exporter": exporter},
        metadata=dict(transformers=transformers.__version__, transformer=entry.transformer,
                      attn_implementation=wrapper.model.config._attn_implementation))
