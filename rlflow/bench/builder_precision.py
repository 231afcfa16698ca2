"""onnxruntime-genai's model builder as a quantizer's peer in `rlflow bench-precision` (issue #77): ``genai-int4``, the
builder's int4 graph of a zoo decoder (`-p int4 -e cpu`), built from the export's weights as the fp32/fp16 reference
is (`rlflow.bench.genai_builder`, `rlflow.bench.builder_reference`), never by quantizing the input model.

Its inputs are its own (no position_ids, its names and dtypes), so each of the bench's feeds is translated into them
(`builder_feeds`) and it is timed in the bench's one interleaved comparison, fed its own inputs.  The builder derives
positions from the attention mask, so a feed it can take is a step: an all-ones mask and positions following the cache
(`as_step`); `rlflow bench-precision` makes its random samples of a zoo decoder steps for every row, so that all are
measured on the same.  Its error is taken against the export's outputs on those samples, over the outputs both graphs
have by name and shape: the logits, and the present cache where the builder writes it as the export does (the row
says which).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import onnx
from onnx import helper

from rlflow.bench.builder_reference import builder_feeds, builder_graph
from rlflow.bench.genai_builder import Decoder, build_reference, builder_command, decoder_of
from rlflow.bench.peers import NotApplicable
from rlflow.measure.accuracy import ErrorReport, Evaluator, Samples
from rlflow.measure.session import SessionSettings, create_session, run_session

_QUANTIZED = ("MatMulNBits", "GatherBlockQuantized")
"""The operators the builder's int4 graph stores int4 weights in (a linear layer's; the embedding's)."""


@dataclass
class BuilderPeer:
    """The builder's graph of a zoo decoder, as a row of `rlflow bench-precision` measures it."""

    model: onnx.ModelProto
    """As built (its inputs dynamic, as the bench's other models are), its weights left in their file."""
    dec: Decoder
    path: Path
    """Its model.onnx; the genai_config.json beside it names its inputs."""
    settings: dict

    def feeds(self, export_feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The builder's inputs for the export's `export_feed`, taken as a step (`as_step`)."""
        return builder_feeds(self.model, as_step(export_feed), self.dec, self.path)

    def error(self, export: onnx.ModelProto, samples: Samples, settings: SessionSettings) -> tuple[ErrorReport, dict]:
        """Its error against `export` on `samples` taken as steps, both fed the same step in their own inputs, and what
        the row says of it: the outputs compared and the samples."""
        steps = as_steps(samples)
        evaluator = _TranslatedEvaluator(export, steps, Samples([self.feeds(step) for step in steps.feeds],
                                                                steps.source, steps.random), self.model, settings)
        cache = [name for name in evaluator.names if not name.startswith("logits")]
        over = (f"logits and the present cache ({len(cache)} outputs)" if cache else
                "logits only: the builder's present cache is not in the export's names and layout")
        return evaluator.error(self.model), {"error_over": over}


class _TranslatedEvaluator(Evaluator):
    """The export's outputs on its steps; `error` runs the builder's graph on the same steps in its inputs, over the
    outputs `comparable_outputs` names that have the export's shapes on the first step."""

    def __init__(self, export: onnx.ModelProto, steps: Samples, builder_steps: Samples, builder: onnx.ModelProto,
                 settings: SessionSettings) -> None:
        super().__init__(export, steps, settings, budget=math.inf)
        names = [name for name in comparable_outputs(export, builder) if name in self.names]
        shapes = run_session(create_session(builder, settings), names, builder_steps.feeds[0])
        kept = [self.names.index(name) for name, got in zip(names, shapes)  # logits of another shape: an infinite error
                if got.shape == self.reference[self.names.index(name)][0].shape or name.startswith("logits")]
        self.names, self.reference = [self.names[i] for i in kept], [self.reference[i] for i in kept]
        self.samples = builder_steps


def as_step(feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The export's feed as a decoder step the builder can take: its tokens and cache, an all-ones attention mask and
    positions following the cache (the builder takes no position_ids; it derives them from the mask, as an unpadded
    batch has them).  A feed that is such a step already comes back equal."""
    out = dict(feed)
    if "attention_mask" in feed:
        out["attention_mask"] = np.ones_like(feed["attention_mask"])
        if "position_ids" in feed and "input_ids" in feed:
            length = feed["input_ids"].shape[1]
            past = feed["attention_mask"].shape[1] - length
            positions = np.arange(past, past + length, dtype=feed["position_ids"].dtype)
            out["position_ids"] = np.ascontiguousarray(np.broadcast_to(positions, feed["position_ids"].shape))
    return out


def as_steps(samples: Samples) -> Samples:
    """`samples` with each feed taken as a step (`as_step`): themselves where each is one already, else their source
    says so."""
    steps = [as_step(feed) for feed in samples.feeds]
    if all(np.array_equal(step[k], feed[k]) for step, feed in zip(steps, samples.feeds) for k in feed):
        return samples
    return Samples(steps, f"{samples.source} as decoder steps (all-ones mask, positions after the cache)",
                   samples.random)


def _dims(value: onnx.ValueInfoProto) -> list[int | None]:
    return [d.dim_value if d.HasField("dim_value") else None for d in value.type.tensor_type.shape.dim]


def comparable_outputs(export: onnx.ModelProto, builder: onnx.ModelProto) -> list[str]:
    """The export's outputs that the builder's graph may compute too, as far as the graphs say: the same name and
    rank, no fixed size that differs (the error checks the shapes on a step)."""
    theirs = {o.name: _dims(o) for o in builder.graph.output}
    return [o.name for o in export.graph.output if o.name in theirs and len(_dims(o)) == len(theirs[o.name])
            and all(a is None or b is None or a == b for a, b in zip(_dims(o), theirs[o.name]))]


def quantization(model: onnx.ModelProto) -> dict:
    """What the builder's graph stores in int4, read off its nodes: per operator its node count, each attribute's
    value (sizes aside; a list where nodes differ) and whether any has zero points (else symmetric); and whether the
    embedding reads the LM head's int4 weight (tied, as the builder ties a model whose configuration ties them)."""
    out: dict = {}
    for node in model.graph.node:
        if node.op_type not in _QUANTIZED:
            continue
        entry = out.setdefault(node.op_type, {"nodes": 0, "zero_points": False})
        entry["nodes"] += 1
        entry["zero_points"] |= len(node.input) > 3 and bool(node.input[3])
        for attr in node.attribute:
            if attr.name not in ("K", "N"):
                values = entry.setdefault("_" + attr.name, [])
                value = helper.get_attribute_value(attr)
                values += [value] if value not in values else []
    for entry in out.values():
        for key in [k for k in entry if k.startswith("_")]:
            values = entry.pop(key)
            entry[key[1:]] = values[0] if len(values) == 1 else values
    producer = {output: node for node in model.graph.node for output in node.output}

    def stored(name: str) -> str:  # the tensor a value is reshaped from
        while name in producer and producer[name].op_type == "Reshape":
            name = producer[name].input[0]
        return name

    heads = {stored(n.input[1]) for n in model.graph.node if n.op_type == "MatMulNBits"}
    out["embedding_tied_to_lm_head"] = any(stored(n.input[0]) in heads for n in model.graph.node
                                           if n.op_type == "GatherBlockQuantized")
    return out


def builder_peer(name: str, precision: str, model: onnx.ModelProto, path: str | os.PathLike | None = None,
                 settings: SessionSettings | None = None) -> BuilderPeer:
    """The peer `name`'s graph for the zoo decoder `model` is (its metadata, else `path`'s stem): the builder at `-p
    precision` and `-e` the provider of `settings` (the CPU without), its defaults otherwise.

    Raises:
        NotApplicable: not a zoo decoder, no builder venv, the builder failed, or its graph has no logits the
            export's compare with; one line saying which.
    """
    dec = decoder_of(model, path)
    if dec is None:
        label = Path(path).stem if path is not None else model.graph.name or "the model"
        raise NotApplicable(f"{name} is the genai builder's graph of a zoo decoder's weights: {label} is not one "
                            "of the zoo's decoders")
    if builder_command() is None:
        raise NotApplicable(f"{name} needs onnxruntime-genai's builder: `make genai-builder` makes its venv")
    provider = "cuda" if settings is not None and settings.provider == "CUDAExecutionProvider" else "cpu"
    try:
        built, record = build_reference(dec, precision=precision, provider=provider)
    except Exception as exc:  # noqa: BLE001 - the builder's failure on one model is that peer's row
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise NotApplicable(f"{name} failed: {type(exc).__name__}: {first}") from exc
    graph = builder_graph(built)
    if not any(n.startswith("logits") for n in comparable_outputs(model, graph)):
        raise NotApplicable(f"{name}'s graph has no logits output of the export's shape to compare")
    version = record.get("versions", {}).get("onnxruntime-genai")
    return BuilderPeer(graph, dec, Path(built), {
        "builder": f"onnxruntime-genai {version} model builder", "arguments": f"-p {precision} -e {provider}",
        "extra_options": "none: the builder's defaults", "quantization": quantization(graph),
        "build": record, "builder_model": str(built)})
