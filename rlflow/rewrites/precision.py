"""Reduced-precision rules: one MatMul's constant weight stored in fewer bits.

Unlike every other rule these change what a model computes, within an error the caller accepts, so they are never
among the default rules (`registry.PRECISION_RULES`, kept apart from `RULES`): only `rlflow optimize --precision`
offers them, and its search decides where each may apply by the error it measures (`rlflow.search.precision`).

The tensor work is onnxruntime's own (`onnxruntime.quantization`): the block quantizer behind `MatMulNBitsQuantizer`
for weight-only int4/int8 (`MatMulNBits`), and `quantize_data`, `quantize_dynamic`'s weight quantizer, for dynamic
int8 (`DynamicQuantizeMatMul`, which quantizes the activations as it runs).  A rule states which form, block size and
symmetry it writes; `replacement` is what both the rewrite and the search's per-layer measurement build from.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import onnx_graphsurgeon as gs

from rlflow.graph.core import Graph
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.edits import emit, replace_typed
from rlflow.rewrites.queries import MS

MIN_WEIGHT_ELEMENTS = 4096
"""Smaller weights are left in float32: their bytes are too few to matter, and a tiny layer (a classifier head of two
labels) is where a model's outputs feel quantisation most."""


@dataclass(frozen=True)
class Replacement:
    """What replaces `MatMul(A, W)`: `op(A, *constants)` in com.microsoft with `attrs`."""

    op: str
    attrs: dict
    constants: tuple[np.ndarray, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the constants, as stored (an int4 weight is half a byte a value)."""
        return sum(c.nbytes for c in self.constants)


class PrecisionRule(Rule):
    """A product `A @ W (+ bias)` whose weight is a float32 constant, rewritten with that weight in fewer bits.

    The product is a MatMul, a Gemm (the exact rules write it, `matmul3d-add-to-gemm`, and exporters do) or a
    FusedMatMul (`tied-head-fusion`'s); the weight is the constant itself or a Transpose of its last two axes, as the
    dynamo exporter writes a language model's head (the largest matrix of a small decoder's step).
    """

    root_ops = ("MatMul", "Gemm", "FusedMatMul")
    domains = ("", "ai.onnx", MS)
    contrib = True
    precision: ClassVar[str] = ""
    """The precision it writes: `int4` or `int8` (what `--precision` asks for)."""
    bias_input: ClassVar[int] = 5
    """Where the replacement operator takes a bias."""
    tolerance: ClassVar[float] = 0.0
    """The relative error norm of one product with standard-normal weights and activations that the rule stays
    within (its tests hold it to this): what one layer costs, before the search weighs it."""

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        if node.op == "MatMul" and (node.domain or "") == MS:
            return self.no(node, "not the default domain's MatMul")
        if node.op != "MatMul" and (node.attrs.get("alpha", 1.0) != 1.0 or node.attrs.get("beta", 1.0) != 1.0
                                    or node.attrs.get("transA", 0) or node.attrs.get("transBatchA", 0)
                                    or node.attrs.get("transBatchB", 0)):
            return self.no(node, f"the {node.op} scales or transposes beyond A @ W + bias")
        source = self.weight_source(node)
        if source is None:
            return self.no(node, "the weight is not a float32 constant, nor one's Transpose of its last two axes")
        shape = source[0].values.shape
        if len(shape) < 2 or any(d != 1 for d in shape[:-2]):
            return self.no(node, f"the weight's shape {list(shape)} is not a matrix")
        if source[0].values.size < MIN_WEIGHT_ELEMENTS:
            return self.no(node, f"the weight has fewer than {MIN_WEIGHT_ELEMENTS} elements")
        if node.op == "Gemm" and len(node.inputs) > 2 and node.inputs[2].name:
            bias = node.inputs[2]
            n = shape[-2] if source[1] else shape[-1]
            if not isinstance(bias, gs.Constant) or bias.values.dtype != np.float32 or bias.values.size != n:
                return self.no(node, "the Gemm's bias is not a float32 constant of one value per column")
        a = graph.shape(node.inputs[0])
        if a is not None and len(a) < 2:
            return self.no(node, "the activation is a vector")
        if len(shape) > 2 and (a is None or len(a) < len(shape)):
            return self.no(node, "the weight has leading axes the activation's rank does not cover")
        if node.inputs[0].dtype not in (None, np.float32):
            return self.no(node, "the activation is not float32")
        return self.match([node])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        weight, bias = self.operands(node)
        new = self.replacement(weight)
        inputs = [node.inputs[0], *(graph.add_constant(c, f"{node.name}_{self.precision}") for c in new.constants)]
        if bias is not None:
            inputs += [gs.Variable.empty()] * (self.bias_input - len(inputs)) + [graph.add_constant(bias, "bias")]
        out = emit(graph, new.op, inputs, new.attrs, domain=MS, hint=node.name)
        replace_typed(graph, node.outputs[0], out)

    @staticmethod
    def weight_source(node: gs.Node) -> tuple[gs.Constant, bool] | None:
        """The float32 constant the product's weight comes from, and whether the product reads it transposed."""
        if len(node.inputs) < 2:
            return None
        weight, transposed = node.inputs[1], bool(node.attrs.get("transB", 0))
        if not isinstance(weight, gs.Constant) and len(weight.inputs) == 1 and weight.inputs[0].op == "Transpose":
            producer = weight.inputs[0]
            inner = producer.inputs[0]
            rank = len(inner.shape or ()) if isinstance(inner, gs.Constant) else 0
            if rank >= 2 and list(producer.attrs.get("perm", range(rank - 1, -1, -1))) == [
                    *range(rank - 2), rank - 1, rank - 2]:
                weight, transposed = inner, not transposed
        if not isinstance(weight, gs.Constant) or weight.values.dtype != np.float32:
            return None
        return weight, transposed

    @classmethod
    def operands(cls, node: gs.Node) -> tuple[np.ndarray, np.ndarray | None]:
        """The weight as a [K, N] matrix and the bias (None without one) of a node `check` accepted."""
        constant, transposed = cls.weight_source(node)
        weight = constant.values.reshape(constant.values.shape[-2:])
        if transposed:
            weight = np.ascontiguousarray(weight.T)
        bias = node.inputs[2] if node.op == "Gemm" and len(node.inputs) > 2 and node.inputs[2].name else None
        return weight, None if bias is None else bias.values.reshape(-1)

    def replacement(self, weight: np.ndarray) -> Replacement:
        """The operator and constants standing for the float32 matrix `weight` [K, N]."""
        raise NotImplementedError


class WeightOnly(PrecisionRule):
    """`MatMulNBits`: the weight in `bits`-bit blocks of `block` values along K, each with its scale (and zero point
    when not symmetric); accuracy level 4 lets the CPU kernel multiply in int8, as onnxruntime-genai's builder asks."""

    bits: ClassVar[int] = 4
    block: ClassVar[int] = 32
    symmetric: ClassVar[bool] = True
    accuracy_level: ClassVar[int] = 4

    def replacement(self, weight: np.ndarray) -> Replacement:
        from onnxruntime.quantization.matmul_nbits_quantizer import (
            DefaultWeightOnlyQuantConfig,
            DefaultWeightOnlyQuantizer,
        )

        config = DefaultWeightOnlyQuantConfig(block_size=self.block, is_symmetric=self.symmetric, bits=self.bits,
                                              accuracy_level=self.accuracy_level)
        packed, scales, zero_points = DefaultWeightOnlyQuantizer(config).qbits_block_quant(
            np.ascontiguousarray(weight, dtype=np.float32))
        k, n = weight.shape
        attrs = {"K": int(k), "N": int(n), "bits": self.bits, "block_size": self.block,
                 "accuracy_level": self.accuracy_level}
        constants = (packed, scales) if self.symmetric else (packed, scales, zero_points)
        return Replacement("MatMulNBits", attrs, constants)


class MatMulInt4Block32(WeightOnly):
    """Replaces `A @ W (+ bias)`, W a float32 matrix, with `MatMulNBits(A, W in int4 blocks of 32, symmetric)`."""

    name = "matmul-int4-block32"
    precision = "int4"
    tolerance = 0.12


class MatMulInt4Block128(WeightOnly):
    """Replaces `A @ W (+ bias)`, W a float32 matrix, with `MatMulNBits(A, W in int4 blocks of 128, zero points)`."""

    name = "matmul-int4-block128"
    precision = "int4"
    tolerance = 0.12
    block = 128
    symmetric = False


class MatMulInt8Block32(WeightOnly):
    """Replaces `A @ W (+ bias)`, W a float32 matrix, with `MatMulNBits(A, W in int8 blocks of 32, symmetric)`."""

    name = "matmul-int8-block32"
    precision = "int8"
    tolerance = 0.012
    bits = 8


DYNAMIC_KEPT_BYTES = 2**28
"""Bytes of dynamic-int8 weights kept, most recent first, so that a weight is quantized once per process: onnxruntime's
per-column quantizer is a Python loop (70 ms for a 576x1536 weight, where the block quantizer takes 3-6 ms), and the
precision search measures each layer, then applies its choice again at every whole-model evaluation."""

_DYNAMIC_DONE: OrderedDict[bytes, Replacement] = OrderedDict()


class MatMulDynamicInt8(PrecisionRule):
    """Replaces `A @ W (+ bias)`, W a float32 matrix, with `DynamicQuantizeMatMul(A, W in int8 per column)`.

    A is quantized as the model runs (per tensor, by its own range), so the product runs as an int8 GEMM: the form
    `quantize_dynamic` writes, and the one that pays where A has many rows (an encoder's sequence)."""

    name = "matmul-dynamic-int8"
    precision = "int8"
    tolerance = 0.02
    bias_input = 4
    cuda = False  # onnxruntime's DynamicQuantizeMatMul is a CPU kernel

    def replacement(self, weight: np.ndarray) -> Replacement:
        key = hashlib.blake2b(np.ascontiguousarray(weight), digest_size=16).digest() + repr(weight.shape).encode()
        if key in _DYNAMIC_DONE:
            _DYNAMIC_DONE.move_to_end(key)
            return _DYNAMIC_DONE[key]
        new = self._quantized(weight)
        for array in new.constants:  # shared by every graph it is written into: never to be edited in place
            array.setflags(write=False)
        _DYNAMIC_DONE[key] = new
        while sum(r.nbytes for r in _DYNAMIC_DONE.values()) > DYNAMIC_KEPT_BYTES and len(_DYNAMIC_DONE) > 1:
            _DYNAMIC_DONE.popitem(last=False)
        return new

    @staticmethod
    def _quantized(weight: np.ndarray) -> Replacement:
        from onnx import TensorProto
        from onnxruntime.quantization.quant_utils import quantize_data

        k, n = weight.shape
        quantized = np.empty((k, n), dtype=np.int8)
        scales = np.empty(n, dtype=np.float32)
        for j in range(n):
            _, scale, column = quantize_data(weight[:, j], TensorProto.INT8, symmetric=True)
            quantized[:, j], scales[j] = column, scale
        return Replacement("DynamicQuantizeMatMul", {}, (quantized, scales, np.zeros(n, dtype=np.int8)))
