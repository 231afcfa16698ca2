"""The deployment section's decoders: Llama- and Qwen3-style language models as a prefill and as a decode step.

Each row of `rlflow.zoo.decoder_architectures` is built from its configuration (random weights from the zoo's seed,
nothing downloaded) and exported by both torch exporters, as `rlflow.zoo.deploy` exports the encoders (``-ts``:
TorchScript, opset 17, ``dynamic_axes``; ``-dynamo``: opset 18, ``dynamic_shapes``), at batch 1:

* prefill (``<key>-prefill-s128-<exporter>``): ``input_ids``, ``attention_mask`` and ``position_ids`` (batch,
  sequence) in; ``logits`` and every layer's ``present.<i>.key`` / ``present.<i>.value`` (batch, kv heads, sequence,
  head_dim) out;
* decode step (``<key>-decode-p128-<exporter>``, ``-p1024``): one token's ``input_ids`` and ``position_ids`` (batch,
  1), ``attention_mask`` (batch, past + 1) and ``past_key_values.<i>.key`` / ``.value`` (batch, kv heads, past,
  head_dim) in; the logits and the cache one longer out.  The batch and the past length are dynamic, so one export
  serves every past length; the entries differ in the deployed shape their metadata records.

transformers 5's models take the cache as a ``Cache`` object, which neither exporter takes as an input: the exported
module (`_DecodeStep`) takes the flat tensors, fills a ``DynamicCache`` with them and returns the flat present
tensors.  Attention is transformers' default, ``sdpa``, as users run these models (``eager`` exports as well with
both exporters, but is not what they deploy): both exporters decompose ``scaled_dot_product_attention`` into MatMul
and Softmax at these opsets, and transformers builds the mask from ``attention_mask`` while tracing (it drops an
all-ones mask only when not tracing), so a padded mask is honoured by both exports.  The TorchScript exporter's
constant folding stores a tied embedding twice (the Gather's table and the LM head's transposed copy): its files are
larger by the embedding than the dynamo exporter's.  Float16 variants are ``model.half()`` exported on the CPU, for
the GPU (GPU entries), and checked against PyTorch's float16 on the CPU within a looser tolerance.
"""

from __future__ import annotations

import functools
import io
import warnings

from rlflow.graph.input_shapes import DEPLOYED_SHAPES_KEY, format_input_shapes
from rlflow.torch_threads import torch_threads
from rlflow.zoo import deploy
from rlflow.zoo.decoder_architectures import DECODERS, DecoderArchitecture
from rlflow.zoo.deploy import EXPORTERS, FAMILY

ATTENTION = "sdpa"
KINDS = ("prefill", "decode")
_BY_KEY = {a.key: a for a in DECODERS}
_INTS = ("input_ids", "attention_mask", "position_ids")
# float16 against PyTorch's float16 on the CPU: rounding differs with the order of accumulation
_TOLERANCE = {"float32": 1e-3, "float16": 3e-2}


def owns(entry) -> bool:
    """Whether `entry` is one of this module's (else `rlflow.zoo.deploy` builds it)."""
    return entry.family == FAMILY and dict(entry.config).get("architecture") in _BY_KEY


def input_shapes(arch: DecoderArchitecture, kind: str, length: int) -> dict:
    """Graph input name -> shape at batch 1: a prompt of `length` tokens, or one token after `length` cached."""
    if kind == "prefill":
        return {name: (1, length) for name in _INTS}
    past = {f"past_key_values.{i}.{kv}": (1, *arch.kv_shape[:1], length, arch.kv_shape[1])
            for i in range(arch.layers) for kv in ("key", "value")}
    return {"input_ids": (1, 1), "attention_mask": (1, length + 1), "position_ids": (1, 1), **past}


def output_names(arch: DecoderArchitecture) -> tuple[str, ...]:
    return ("logits", *(f"present.{i}.{kv}" for i in range(arch.layers) for kv in ("key", "value")))


def entries(entry_type) -> list:
    """The decoders' zoo entries (``entry_type`` is ``rlflow.zoo.ZooEntry``): by architecture, dtype, kind,
    exporter and shape, shapes innermost so that consecutive builds share one export."""
    out = []
    for arch in DECODERS:
        for dtype in arch.dtypes:
            fp16 = dtype == "float16"
            for kind in KINDS:
                for exporter, (opset, _) in EXPORTERS.items():
                    for length in (arch.prefill if kind == "prefill" else arch.past):
                        shape = f"s{length}" if kind == "prefill" else f"p{length}"
                        shapes = input_shapes(arch, kind, length)
                        total = length + (kind == "decode")
                        dtypes = {n: "int64" if n in _INTS else dtype for n in shapes if n in _INTS or fp16}
                        ranges = {"input_ids": (0, arch.config["vocab_size"]), "attention_mask": (0, 2),
                                  "position_ids": (0, total)}
                        config = dict(architecture=arch.key, model=arch.model, kind=kind, config=arch.config,
                                      exporter=exporter, opset=opset, dtype=dtype, attention=ATTENTION)
                        if arch.tiny:
                            config["tiny"] = True
                        out.append(entry_type(
                            f"{arch.key}-{kind}-{shape}-{exporter}" + ("-fp16" if fp16 else ""), FAMILY, shapes,
                            None, "transformers", config, input_dtypes=dtypes, input_ranges=ranges,
                            output_names=output_names(arch),
                            description=f"{arch.description}, {kind} {shape}, {exporter} exporter"
                                        + (", float16 (GPU)" if fp16 else ""),
                            transformer=arch.transformer, gpu=arch.gpu or fp16))
    return out


def _model(arch: DecoderArchitecture, dtype: str):
    """The transformers model of `arch` in eval mode: weights from the zoo's seed as for the other deployment
    models (``models/common.py``), RMSNorm scales from U(0.5, 1.5) as common gives LayerNorms, so that no norm is an
    identity and no two norms are equal."""
    import torch
    import transformers

    from rlflow.zoo import base as zoo
    common = __import__(f"{zoo.models_package().__name__}.common", fromlist=["init_weights"])
    torch.manual_seed(zoo.SEED)
    cls = getattr(transformers, arch.model)
    model = cls(cls.config_class(**arch.config, attn_implementation=ATTENTION))
    common.init_weights(model, zoo.SEED, "transformer")
    gen = torch.Generator().manual_seed(zoo.SEED + 1)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.copy_(torch.rand(module.weight.shape, generator=gen) + 0.5)
    model = model.eval()
    return model.half() if dtype == "float16" else model


def _wrap(model, kind: str):
    """The module the exporters see: plain tensors in, a tuple of tensors out."""
    import torch

    keyword = deploy.cache_keyword(model)

    class Prefill(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=True, return_dict=True)
            return (out.logits, *deploy.flat_cache(out))

    class DecodeStep(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, *past):
            from transformers import DynamicCache

            cache = DynamicCache(config=self.model.config)
            for layer in range(len(past) // 2):
                cache.update(past[2 * layer], past[2 * layer + 1], layer)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=True, return_dict=True, **{keyword: cache})
            return (out.logits, *deploy.flat_cache(out))

    return (DecodeStep if kind == "decode" else Prefill)().eval()


def inputs_at(arch: DecoderArchitecture, kind: str, dtype: str, batch: int, length: int, seed: int) -> dict:
    """Inputs of one call: token ids from the vocabulary, no padding, positions after the cache, N(0, 1) cache."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    seq, past = (length, 0) if kind == "prefill" else (1, length)
    ids = torch.randint(0, arch.config["vocab_size"], (batch, seq), generator=gen)
    positions = (torch.arange(seq) + past).unsqueeze(0).expand(batch, seq).contiguous()
    inputs = {"input_ids": ids, "attention_mask": torch.ones(batch, past + seq, dtype=torch.int64),
              "position_ids": positions}
    for name, shape in input_shapes(arch, kind, length).items():
        if name not in _INTS:
            inputs[name] = torch.randn((batch, *shape[1:]), generator=gen).to(getattr(torch, dtype))
    return inputs


def _dynamic_axes(kind: str, names: list, outputs: list) -> dict:
    """TorchScript's dynamic_axes: name -> {axis: symbol}.  A decode step's token axis stays 1, as dynamo has it."""
    axes = {}
    for name in names:
        if name.startswith("past"):
            axes[name] = {0: "batch", 2: "past_sequence"}
        elif kind == "decode":
            axes[name] = {0: "batch", 1: "total_sequence"} if name == "attention_mask" else {0: "batch"}
        else:
            axes[name] = {0: "batch", 1: "sequence"}
    total = "total_sequence" if kind == "decode" else "sequence"
    for name in outputs:
        axes[name] = {0: "batch", 2: total} if name.startswith("present") else \
            {0: "batch", 1: "sequence"} if kind == "prefill" else {0: "batch"}
    return axes


def _dynamic_shapes(arch: DecoderArchitecture, kind: str, names: list):
    """dynamo's dynamic_shapes for ``input_ids, attention_mask, position_ids, *past``."""
    from torch.export import Dim

    batch, limit = Dim("batch"), arch.config["max_position_embeddings"]
    if kind == "decode":  # the mask covers past + 1 tokens: a derived dimension
        past = Dim("past_sequence", min=1, max=limit - 1)
        return {0: batch}, {0: batch, 1: past + 1}, {0: batch}, tuple({0: batch, 2: past} for _ in names[3:])
    seq = Dim("sequence", min=1, max=limit)
    return {0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch, 1: seq}


@functools.lru_cache(maxsize=1)
def _exported(key: str, kind: str, exporter: str, dtype: str):
    """(ONNX bytes, wrapped torch module) of one (architecture, kind, exporter, dtype): made once, shared by its
    shapes."""
    return export_decoder(_BY_KEY[key], kind, exporter, dtype)


def export_decoder(arch: DecoderArchitecture, kind: str, exporter: str, dtype: str = "float32"):
    """(ONNX bytes, wrapped torch module) of `arch`'s prefill or decode step exported by `exporter` (``ts`` or
    ``dynamo``), traced at batch 2 and sequence or past 8, so that no dynamic axis is 0, 1 or a deployed size."""
    import torch

    opset = EXPORTERS[exporter][0]
    wrapper = _wrap(_model(arch, dtype), kind)
    inputs = inputs_at(arch, kind, dtype, batch=2, length=8, seed=0)
    names, outputs = list(inputs), list(output_names(arch))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if exporter == "ts":
            buffer = io.BytesIO()
            torch.onnx.export(wrapper, tuple(inputs.values()), buffer, dynamo=False, opset_version=opset,
                              input_names=names, output_names=outputs,
                              dynamic_axes=_dynamic_axes(kind, names, outputs), do_constant_folding=True)
            data = buffer.getvalue()
        else:
            program = torch.onnx.export(wrapper, tuple(inputs.values()), dynamo=True, opset_version=opset,
                                        input_names=names, output_names=outputs,
                                        dynamic_shapes=_dynamic_shapes(arch, kind, names), verbose=False)
            data = program.model_proto.SerializeToString()
    wrapper.eval()  # the TorchScript exporter restores the wrapper's previous training flag
    return data, wrapper


def export(entry):
    """The zoo's ``Export`` of a decoder entry: the shared export, checked at the entry's deployed shape.

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
    config = entry.config
    arch, kind, exporter, dtype = _BY_KEY[config["architecture"]], config["kind"], config["exporter"], config["dtype"]
    data, wrapper = _exported(arch.key, kind, exporter, dtype)
    shapes = entry.input_shapes
    length = shapes["input_ids"][1] if kind == "prefill" else shapes["attention_mask"][1] - 1
    inputs = inputs_at(arch, kind, dtype, batch=1, length=length, seed=zoo.SEED + 1)
    with torch_threads(1), torch.no_grad():
        expected = [t.float().numpy() if dtype == "float16" else t.numpy() for t in wrapper(*inputs.values())]
    if kind == "decode":
        deploy.check_cache(entry.name, expected[1].shape[2], length + 1)
    return zoo.Export(
        proto=onnx.load_from_string(data), feeds={k: v.numpy() for k, v in inputs.items()}, expected=expected,
        exporter=EXPORTERS[exporter][1], opset=EXPORTERS[exporter][0],
        props={DEPLOYED_SHAPES_KEY: format_input_shapes(entry.input_shapes), "rlflow.zoo.exporter": exporter},
        metadata=dict(transformers=transformers.__version__, transformer=entry.transformer, kind=kind, dtype=dtype,
                      gpu=entry.gpu, attn_implementation=wrapper.model.config._attn_implementation),
        tolerance=_TOLERANCE[dtype])
