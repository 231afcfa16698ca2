"""The quantizers a user would pick instead of `rlflow optimize --precision`, each run as its documentation presents it
on the same fp32 model, so that `rlflow bench-precision` measures their speed and error beside rlflow's.

- `ort-int4-rtn`: onnxruntime's `MatMulNBitsQuantizer` (round to nearest, its default algorithm) at the settings
  onnxruntime-genai's model builder uses for the CPU: 4 bits, blocks of 32, symmetric, `accuracy_level` 4.
- `ort-int4-hqq`: the same quantizer with `HQQWeightOnlyQuantConfig` (half-quadratic optimisation of the scales and
  zero points, no data needed; it runs on torch, seconds per layer).  Blocks of 32, as the RTN peer and the
  builder, rather than its default 128, so that the two differ by the algorithm only.  onnxruntime writes HQQ's
  zero points as float32 and no `accuracy_level` (its quantizer drops the setting for HQQ); its CPU kernel has no
  fast path for float zero points and dequantizes the weight on every run, far slower than float32.  That is what a
  user of it gets, so the peer keeps it as written.
- `ort-int8-dynamic`: `onnxruntime.quantization.quantize_dynamic` with `weight_type=QInt8` and its other defaults
  (one scale per weight tensor, the activation quantized to uint8 as the model runs).
- `ort-fp16`: onnxruntime's float16 converter, `onnxruntime.transformers.float16.convert_float_to_float16` with
  `keep_io_types=True` and its other defaults (float32 inputs and outputs, its own operator block list).
- `ort-fp16-optimized`: onnxruntime's transformers optimizer, then its float16 conversion, as onnxruntime presents it
  for transformers: `optimize_model(path, model_type, num_heads=0, hidden_size=0, opt_level=None)` (heads and width
  detected by the optimizer; the model type's default level, basic graph optimisations bound to no provider), then
  `.convert_float_to_float16(keep_io_types=True)`.  The model type is the one the `ort-transformers` peer reads from
  the graph (`graph_model_type`): `gpt2` for a causal decoder, `vit` for an image input, else `bert`; on the zoo's
  Llama-style decoders `gpt2` fuses as much as `bert` or `qwen3` (RMSNorm into SimplifiedLayerNormalization).
- `onnxsim-int4`, `onnxsim-int8`, `onnxsim-int8-weight-only`, `onnxsim-fp16`: onnxsim's own passes as its CLI runs
  them, `onnxsim IN OUT --weight-only-quantize-int4 | --dynamic-quantize | --weight-only-quantize | --fp16-quantize`:
  `onnxsim.simplify` with the CLI's defaults, then `onnxsim.quantize_weight_only_int4` (standard ONNX: INT4 weights
  in blocks of 32, symmetric, each read through a `DequantizeLinear(block_size=32)`, which onnxruntime fuses with its
  MatMul into `MatMulNBits`, though not where the MatMul feeds a Relu), `onnxsim.quantize_dynamic` (int8 weights per
  output channel, uint8 activations: `DynamicQuantizeLinear` + `MatMulInteger`), `onnxsim.quantize_weight_only`
  (int8 weights per output channel, each read through a `DequantizeLinear`; the activation stays float) or
  `onnxsim.quantize_fp16` (float16 weights and activations, float32 inputs and outputs).  The simplification is not
  optional: onnxsim's passes skip a MatMul whose operand types are unknown, and it is the shape inference within
  `simplify` that gives them.  The int4 pass needs opset 21 and silently does nothing below it; its help says so, so
  this peer asks `simplify` for opset 21 (`--target-opset 21`) on an older model.
- `onnxconverter-fp16-mixed`: onnxconverter-common's `auto_mixed_precision.auto_convert_mixed_precision(model, feed,
  validate_fn, keep_io_types=True)`: all converted, but the fewest nodes its bisection must keep float32 for the output
  to pass `validate_fn`.  That is rlflow's own bound, the relative error norm of every float output within
  `--max-error` (else rlflow's fp16 default): its `rtol`/`atol` are elementwise `np.allclose`, which near-zero outputs
  fail at any `atol` that does not loosen all the rest.  It tunes on one feed: the first sample the bench measures
  error on, else random inputs made as rlflow makes them.  It blocks nodes by name, so unnamed ones are named first;
  its progress and warnings are swallowed.  Its converter (1.16) mistypes a graph output that another node also
  reads when it keeps the float32 interface, which onnxruntime refuses: not applicable, and its row says so.
- `genai-int4`: onnxruntime-genai's model builder at `-p int4 -e cpu` (`-e cuda` where the bench measures on CUDA)
  with its defaults (in 0.18: onnxruntime's `MatMulNBitsQuantizer`, round to nearest, blocks of 32, symmetric,
  `accuracy_level` 4 on the CPU; the embedding shares the LM head's int4 weight where the model ties them), the
  graph a user of onnxruntime-genai deploys.  Not a quantizer of the input: it builds its own graph from a zoo
  decoder's weights (`rlflow.bench.builder_precision`, its venv made by `make genai-builder`), so it applies to zoo
  decoders only, takes its own inputs (each of the bench's feeds translated into them) and its error is taken over
  the outputs both graphs share (the logits; the present cache where its layout is the export's).

onnxruntime's CPU provider has no float16 kernel for most operators (MatMul among them on x86): it computes those in
float32 between Casts, widening their constant weights as it loads the model, so there the fp16 peers halve the
weight bytes stored, not the bytes a run reads.

onnxruntime's int4 quantizer handles MatMul only (no Gemm), so a model whose layers are all Gemm is not applicable
to its two peers.

Left out: onnxsim's `quantize_weight_only_matmul_nbits` (the same int4 scheme written as `MatMulNBits`) has no CLI
flag; its block-wise int8 (`--weight-only-quantize-int8-block`) adds no speed over `--weight-only-quantize` on
onnxruntime's CPU.

Every output has its `ir_version` lowered to what the installed onnxruntime accepts and its unused initializers
dropped: onnxsim's passes leave the float32 weights they replaced in the graph, which onnxruntime drops when it loads
the model, and a weight-bytes column would otherwise count them.
"""
from __future__ import annotations

import contextlib
import copy
import io
import os
import tempfile
import warnings
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import onnx

from rlflow.bench.peers import NotApplicable, graph_model_type, working_directory
from rlflow.graph.model_file import max_ir_version, save_model

PRECISION_PEERS: dict[str, str] = {
    "ort-int4-rtn": "int4",
    "ort-int4-hqq": "int4",
    "ort-int8-dynamic": "int8",
    "ort-fp16": "fp16",
    "ort-fp16-optimized": "fp16",
    "onnxsim-int4": "int4",
    "onnxsim-int8": "int8",
    "onnxsim-int8-weight-only": "int8",
    "onnxsim-fp16": "fp16",
    "onnxconverter-fp16-mixed": "fp16",
    "genai-int4": "int4",
}
"""Peer name -> the precision it writes, in the order a bench runs them."""

BUILT_PEERS = frozenset({"genai-int4"})
"""Peers that build their own graph from a zoo decoder's weights (`rlflow.bench.builder_precision`) rather than
quantize the model given: their inputs are their own."""

INT4_BLOCK = 32
"""onnxruntime-genai's builder's block size for the CPU (`int4_block_size`), and onnxsim's only one."""

INT4_ACCURACY_LEVEL = 4
"""The builder's `int4_accuracy_level` for the CPU: the kernel may quantize the activation to int8 and multiply in
int8."""

ONNXSIM_INT4_OPSET = 21
"""The opset onnxsim's int4 pass needs (INT4 tensors, `DequantizeLinear`'s `block_size`)."""


def run_precision_peer(name: str, model: onnx.ModelProto | str | os.PathLike,
                       feed: Mapping[str, np.ndarray] | None = None, max_error: float | None = None) -> onnx.ModelProto:
    """The peer `name`'s quantized model of `model` (a proto, left untouched, or a path, its external data read in).

    `feed` and `max_error` are for the peers that tune on data (`_TUNED`): the inputs they tune on [default: random
    inputs as rlflow makes them] and the relative error norm they keep within [default: rlflow's fp16 default].

    A BUILT_PEERS peer's model is its own graph of the zoo decoder `model` is, its inputs its own.

    Raises:
        KeyError: `name` is not in PRECISION_PEERS.
        NotApplicable: the peer's package is missing, the tool failed on the model, or it quantized nothing (a model
            without a layer it handles); the message is one line saying which.
    """
    if name in BUILT_PEERS:
        from rlflow.bench.builder_precision import builder_peer

        path = model if isinstance(model, (str, os.PathLike)) else None
        proto = onnx.load(os.fspath(model), load_external_data=False) if path is not None else model
        return builder_peer(name, PRECISION_PEERS[name], proto, path).model
    tool = _TOOLS[name]
    source = onnx.load(os.fspath(model)) if isinstance(model, (str, os.PathLike)) else copy.deepcopy(model)
    source.ir_version = min(source.ir_version, max_ir_version())  # the tools that run the model run it in onnxruntime
    try:
        output = tool(source, feed, max_error) if name in _TUNED else tool(source)
    except NotApplicable:
        raise
    except ImportError as exc:
        raise NotApplicable(f"{name} needs {exc.name or 'a package that is missing'}") from exc
    except Exception as exc:  # noqa: BLE001 - a tool's failure on one model is that peer's row, not the run's end
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise NotApplicable(f"{name} failed: {type(exc).__name__}: {first}") from exc
    if not _WROTE[name](output):
        raise NotApplicable(f"{name} quantized no layer of this model (it handles {_HANDLES[name]})")
    _drop_unused_initializers(output.graph)
    output.ir_version = min(output.ir_version, max_ir_version())
    return output


# ----------------------------------------------------------------------------------------------------- onnxruntime
def _ort_int4(model: onnx.ModelProto, algo_config=None) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quant = MatMulNBitsQuantizer(model, bits=4, block_size=INT4_BLOCK, is_symmetric=True,
                                 accuracy_level=INT4_ACCURACY_LEVEL, algo_config=algo_config)
    quant.process()
    return quant.model.model


def ort_int4_rtn(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxruntime's block quantizer at the genai builder's CPU settings (it quantizes `model` in place)."""
    return _ort_int4(model)


def ort_int4_hqq(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxruntime's HQQ quantizer in blocks of INT4_BLOCK (it quantizes `model` in place)."""
    import torch  # noqa: F401 - HQQ runs on torch: missing, the peer is not applicable
    from onnxruntime.quantization.matmul_nbits_quantizer import HQQWeightOnlyQuantConfig

    return _ort_int4(model, HQQWeightOnlyQuantConfig(block_size=INT4_BLOCK, bits=4))


def ort_int8_dynamic(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxruntime's dynamic quantization with its defaults; it takes paths, so it runs in a temporary folder."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory(prefix="rlflow-ort-int8-") as tmp:
        source = save_model(model, Path(tmp) / "input.onnx")
        target = Path(tmp) / "output.onnx"
        quantize_dynamic(source, target, weight_type=QuantType.QInt8)
        return onnx.load(str(target))  # its weights read in, so nothing refers into the folder


def ort_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxruntime's float16 converter with its defaults, float32 inputs and outputs kept."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    return convert_float_to_float16(model, keep_io_types=True)


def ort_fp16_optimized(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxruntime's transformers optimizer at the model type's defaults, then its float16 conversion.  It runs on a
    path in a temporary folder, where the optimizer's own files land too."""
    from onnxruntime.transformers.optimizer import optimize_model

    with tempfile.TemporaryDirectory(prefix="rlflow-ort-fp16-") as tmp, working_directory(tmp):
        path = save_model(model, Path(tmp) / "input.onnx")
        optimized = optimize_model(str(path), model_type=graph_model_type(model), num_heads=0, hidden_size=0,
                                   opt_level=None)
        optimized.convert_float_to_float16(keep_io_types=True)
        return optimized.model  # its weights in memory, so nothing refers into the folder


# ------------------------------------------------------------------------------------------- onnxconverter-common
def onnxconverter_fp16_mixed(model: onnx.ModelProto, feed: Mapping[str, np.ndarray] | None,
                             max_error: float | None) -> onnx.ModelProto:
    """onnxconverter-common's automatic mixed precision, bounded by rlflow's measure and budget (module docstring)."""
    from onnxconverter_common.auto_mixed_precision import auto_convert_mixed_precision

    from rlflow.measure.verify import compare_arrays
    from rlflow.optimize.precision import DEFAULT_MAX_ERROR

    if feed is None:
        from rlflow.graph.input_shapes import deployed_shapes
        from rlflow.measure.inputs import random_inputs

        feed = random_inputs(model, 0, deployed_shapes(model))
    budget = DEFAULT_MAX_ERROR["fp16"] if max_error is None else max_error

    def within_budget(reference: list[np.ndarray], candidate: list[np.ndarray]) -> bool:
        return all(compare_arrays("", ref, cand, budget).ok
                   for ref, cand in zip(reference, candidate) if ref.dtype.kind == "f")

    seen: set[str] = set()
    for k, node in enumerate(model.graph.node):  # it blocks nodes by name: each needs its own
        if not node.name or node.name in seen:
            node.name = f"{node.name or node.op_type}_rlflow{k}"
        seen.add(node.name)
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a line per tiny weight it rounds to its smallest value
            return auto_convert_mixed_precision(model, dict(feed), validate_fn=within_budget, keep_io_types=True)
    except Exception as exc:
        read = {name for node in model.graph.node for name in node.input}
        shared = [o.name for o in model.graph.output if o.name in read]
        if shared:  # its converter's keep_io_types bug, which the first attempt hits
            raise NotApplicable(f"onnxconverter-fp16-mixed failed: its converter mistypes graph output {shared[0]}, "
                                "which another node reads, and onnxruntime refuses its model") from exc
        raise


# ---------------------------------------------------------------------------------------------------------- onnxsim
def _onnxsim(model: onnx.ModelProto, quantize: Callable[[onnx.ModelProto], onnx.ModelProto],
             opset: int | None = None) -> onnx.ModelProto:
    """What `onnxsim IN OUT --<pass>` does: simplify with the CLI's defaults, then the pass."""
    from onnxsim import simplify

    simplified, ok = simplify(model, target_opset_version=opset)
    if not ok:
        raise NotApplicable("onnxsim's own check of its simplified model failed")
    return quantize(simplified)


def onnxsim_int4(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxsim's `--weight-only-quantize-int4`, at opset ONNXSIM_INT4_OPSET where the model's is older."""
    from onnxsim import quantize_weight_only_int4

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    return _onnxsim(model, quantize_weight_only_int4, ONNXSIM_INT4_OPSET if opset < ONNXSIM_INT4_OPSET else None)


def onnxsim_int8(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxsim's `--dynamic-quantize`."""
    from onnxsim import quantize_dynamic

    return _onnxsim(model, quantize_dynamic)


def onnxsim_int8_weight_only(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxsim's `--weight-only-quantize`."""
    from onnxsim import quantize_weight_only

    return _onnxsim(model, quantize_weight_only)


def onnxsim_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxsim's `--fp16-quantize` (float32 inputs and outputs kept)."""
    from onnxsim import quantize_fp16

    return _onnxsim(model, quantize_fp16)


_TOOLS: dict[str, Callable[..., onnx.ModelProto]] = {
    "ort-int4-rtn": ort_int4_rtn, "ort-int4-hqq": ort_int4_hqq, "ort-int8-dynamic": ort_int8_dynamic,
    "onnxsim-int4": onnxsim_int4, "onnxsim-int8": onnxsim_int8, "onnxsim-int8-weight-only": onnxsim_int8_weight_only,
    "onnxsim-fp16": onnxsim_fp16, "ort-fp16": ort_fp16, "ort-fp16-optimized": ort_fp16_optimized,
    "onnxconverter-fp16-mixed": onnxconverter_fp16_mixed,
}
_TUNED = {"onnxconverter-fp16-mixed"}
"""Peers that take `run_precision_peer`'s feed and budget."""


# ------------------------------------------------------------------------------------------------ what they wrote
def _ops(model: onnx.ModelProto) -> set[str]:
    return {node.op_type for node in model.graph.node}


def _has_initializer_of(model: onnx.ModelProto, data_type: int) -> bool:
    return any(t.data_type == data_type for t in model.graph.initializer)


_WROTE: dict[str, Callable[[onnx.ModelProto], bool]] = {
    "ort-int4-rtn": lambda m: "MatMulNBits" in _ops(m),
    "ort-int4-hqq": lambda m: "MatMulNBits" in _ops(m),
    "ort-int8-dynamic": lambda m: bool({"MatMulInteger", "DynamicQuantizeMatMul"} & _ops(m)),
    "onnxsim-int4": lambda m: _has_initializer_of(m, onnx.TensorProto.INT4),
    "onnxsim-int8": lambda m: bool({"MatMulInteger", "MatMulIntegerToFloat"} & _ops(m)),
    "onnxsim-int8-weight-only": lambda m: _has_initializer_of(m, onnx.TensorProto.INT8),
    **{name: lambda m: _has_initializer_of(m, onnx.TensorProto.FLOAT16)
       for name, precision in PRECISION_PEERS.items() if precision == "fp16"},
}
"""Peer -> whether its output holds what the peer writes (else it quantized nothing)."""

_ORT_INT4 = "MatMul with a constant float weight, no Gemm"
_HANDLES = {"ort-int4-rtn": _ORT_INT4, "ort-int4-hqq": _ORT_INT4,
            "ort-int8-dynamic": "MatMul, Gemm and Conv with a constant float weight",
            "onnxsim-int4": "MatMul, plain Gemm and Conv with a constant float32 weight, depth a multiple of 32",
            "onnxsim-int8": "MatMul and plain Gemm with a constant 2-D float32 weight",
            "onnxsim-int8-weight-only": "MatMul, plain Gemm and Conv with a constant float32 weight",
            **{name: "float32 initializers" for name, precision in PRECISION_PEERS.items() if precision == "fp16"}}
"""Peer -> the layers it quantizes, for the reason a peer that quantized nothing gives."""


def _used_names(graph: onnx.GraphProto) -> set[str]:
    """Every value name the graph's nodes read (subgraphs' included) and its outputs."""
    used = {o.name for o in graph.output}
    for node in graph.node:
        used.update(node.input)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs):
                used |= _used_names(sub)
    return used


def _drop_unused_initializers(graph: onnx.GraphProto) -> None:
    used = _used_names(graph) | {i.name for i in graph.input}
    for k in reversed(range(len(graph.initializer))):
        if graph.initializer[k].name not in used:
            del graph.initializer[k]
