"""`rlflow optimize --padding NAME=right`: after the exact search, the GroupQueryAttentions whose bias comes of the
declared mask read the rows' lengths instead (`rlflow.rewrites.padding`), the output is verified on right-padded
batches row by row (`rlflow.measure.padding`), and the gate times both models with the mask all ones, the contract's
case where the rows' lengths save nothing (random masks would shorten the candidate's rows alone).  docs/padding.md
says what the contract promises."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from rlflow.errors import InputError
from rlflow.graph.core import Graph
from rlflow.measure.padding import verify_padded
from rlflow.measure.verify import Verification
from rlflow.rewrites import rule
from rlflow.rewrites.base import apply_everywhere
from rlflow.rewrites.padding import PADDING_SIDES, GqaPaddingLengths
from rlflow.search.candidates import SearchResult

PADDING_KEY = "rlflow.padding"
"""Metadata key of a written model that holds the padding contract it was rewritten under (`attention_mask=right`)."""

LONGER_PAST = 7
"""Positions added to the past of the verification's second set of shapes, so that a length baked in is caught."""


def parse_padding(spec: str | None) -> dict[str, str] | None:
    """`NAME=SIDE` (the CLI's --padding) as {NAME: SIDE}; None for None."""
    if spec is None:
        return None
    name, sep, side = spec.partition("=")
    if not sep or not name.strip() or not side.strip():
        raise InputError(f"bad --padding '{spec}': expected a mask input's name and its padding, such as "
                         "attention_mask=right")
    return {name.strip(): side.strip()}


def check_padding(padding: Mapping[str, str] | None, precision: str | None) -> None:
    """Raises InputError for a contract no run could use."""
    if not padding:
        return
    if len(padding) > 1:
        raise InputError(f"--padding declares one mask; got {', '.join(padding)}")
    (name, side), = padding.items()
    if side not in PADDING_SIDES:
        raise InputError(f"--padding {name}={side}: only right padding can be declared (GroupQueryAttention's "
                         "seqlens_k counts a row's valid keys from its start)")
    if precision:
        raise InputError("--padding with --precision is not supported yet: the precision search measures its error "
                         "on unpadded inputs")


def check_mask(model: onnx.ModelProto, mask: str) -> None:
    """Raises InputError, before any work, where `mask` is no 2-D input of `model`."""
    weights = {t.name for t in model.graph.initializer}
    inputs = {vi.name: vi for vi in model.graph.input if vi.name not in weights}
    if mask not in inputs:
        raise InputError(f"--padding names no input of the model: {mask}; its inputs are {', '.join(inputs) or 'none'}")
    if len(inputs[mask].type.tensor_type.shape.dim) != 2:
        raise InputError(f"--padding {mask}=right: {mask} is not 2-D [batch, total length]")


@dataclass
class PaddingOutcome:
    """What the contract changed, for the report and the JSON."""

    mask: str
    applied: int
    reason: str = ""
    lengths: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"mask": self.mask, "side": "right", "applied": self.applied, "reason": self.reason,
                "verified_lengths": self.lengths}


def apply_padding(graph: Graph, given: onnx.ModelProto, search: SearchResult, exact: Verification | None,
                  mask: str, seed: int) -> tuple[SearchResult, Verification | None, PaddingOutcome]:
    """The exact search's result with the contract's rewrite on top, the padded verification of what it hands back
    (`exact`, the exact graph's own, where nothing changed), and what happened."""
    exact_kept = exact is not None and exact.ok
    base = search.graph if exact_kept else graph
    rewritten, applied, dropped = contract_rewrite(base, mask)
    if not applied:
        reasons = sorted({r.reason for r in GqaPaddingLengths(mask).reasons(base)})
        why = reasons[0] if reasons else "the graph has no GroupQueryAttention (no attention was fused)"
        return search, exact, PaddingOutcome(mask, 0, why)  # as the exact search left it, its check included
    shapes = [dict(graph.input_shapes), _longer_past(graph.input_shapes, mask)]
    check = verify_padded(given, rewritten.to_model(static=False), mask, shapes, seed=seed)
    if not check.ok:  # the exact search's result stands, as if nothing had been declared
        return search, exact, PaddingOutcome(mask, 0, f"the rewrite does not verify on padded batches: {check.message}")
    outcome = PaddingOutcome(mask, len(applied), "", [s["lengths"] for s in check.shapes])
    result = replace(search, graph=rewritten, applied=[*(search.applied if exact_kept else []), *applied, *dropped],
                     stop_reason=f"{search.stop_reason}; padding contract: {len(applied)} attention(s) read lengths")
    return result, check, outcome


def contract_rewrite(graph: Graph, mask: str) -> tuple[Graph, list, list]:
    """`graph` as the contract leaves it: every attention whose bias comes of `mask` reading the rows' lengths, then
    the NaN guards after them dropped, now dead; and the two rules' rewrites."""
    contract = GqaPaddingLengths(mask)
    rewritten, applied = apply_everywhere(graph, contract, contract.find(graph), [contract])
    if not applied:
        return graph, [], []
    guard = rule("attention-nan-guard-elim")
    rewritten, dropped = apply_everywhere(rewritten, guard, guard.find(rewritten), [guard])
    return rewritten, applied, dropped


def _longer_past(shapes: Mapping[str, tuple[int, ...]], mask: str) -> dict[str, list[int]]:
    grown = {}
    for name, dims in shapes.items():
        dims = list(dims)
        if name == mask:
            dims[1] += LONGER_PAST
        elif name.startswith("past"):
            dims[-2] += LONGER_PAST
        grown[name] = dims
    return grown


def unpadded(graph: Graph, mask: str) -> Graph:
    """`graph` reading a mask of ones in place of `mask`'s values (the gate's inputs: see the module's docstring)."""
    out = graph.clone()
    tensor = next(t for t in out.gs.inputs if t.name == mask)
    readers = [n for n in tensor.outputs if n.op != "Shape"]
    shape = out.add_node("Shape", [tensor], 1)[0]
    ones = gs.Constant(out.fresh_name("ones"), np.ones(1, np.dtype(tensor.dtype)))
    filled = out.add_node("ConstantOfShape", [shape], 1, {"value": ones})[0]
    filled.dtype, filled.shape = tensor.dtype, tensor.shape
    for node in readers:
        for i, t in enumerate(node.inputs):
            if t is tensor:
                node.inputs[i] = filled
    out.finish_edit()
    return out


def record(model: onnx.ModelProto, mask: str) -> None:
    """Writes the contract into the output's metadata (`PADDING_KEY`)."""
    model.metadata_props.add(key=PADDING_KEY, value=f"{mask}=right")
