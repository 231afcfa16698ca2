"""The peer tools `rlflow bench --peers` measures rlflow against: each a function ModelProto -> ModelProto.

onnxsim, onnxoptimizer, onnxslim and the onnxscript optimizer take nothing but the model, and so does
`onnxscript-ort`: that optimizer followed by onnxscript's fusions for onnxruntime (`onnxscript.rewriter.ort_fusions`:
RMSNorm, rotary embeddings, sdpa into MultiHeadAttention or GroupQueryAttention), the peer that knows decoder LLMs'
patterns.  `ort-transformers` is
onnxruntime's transformers optimizer (`onnxruntime.transformers.optimizer.optimize_model`) with the settings of
`optimum-cli export onnx --optimize O2`; it needs the model type, head count and hidden size, taken from the zoo
entry's hints when there are some, else read from the graph.  What it was run with (and which fusions it reported)
travels with its output in the metadata key `PEER_SETTINGS_KEY`, so that the bench records it beside the timings.
"""
from __future__ import annotations

import collections
import contextlib
import json
import multiprocessing
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Callable, Iterator, Mapping

import numpy as np
import onnx
from onnx import numpy_helper

from rlflow.graph.external_data import tensor_bytes
from rlflow.graph.model_file import max_ir_version, read_model, save_model

PeerTool = Callable[[onnx.ModelProto], onnx.ModelProto]

PEERS = ("onnxsim", "onnxoptimizer", "onnxslim", "onnxscript", "onnxscript-ort", "ort-transformers")
"""Every peer, in the order the bench runs them."""

PEER_SETTINGS_KEY = "rlflow.peer.settings"
"""metadata_props key of a peer's output: JSON of the settings it ran with (absent for peers that take none)."""

ORT_OPT_LEVEL = 2
"""optimum's O2: onnxruntime's basic and extended graph optimisations first (`optimization_level=2`), then the
transformer fusions (`enable_transformers_specific_optimizations=True`), no GELU approximation, no fp16."""


ISOLATED_PEER_BYTES = 2**28
"""Models whose weights reach this run each peer in a child process of its own (`run_peer`): the tools copy the
weights several times over (onnxruntime's transformers optimizer held about ten times a decoder's weights), and a
process gives back what it took only when it ends."""


class NotApplicable(Exception):
    """The peer does not apply to this model (its row says why instead of timing a no-op)."""


def peer_tools(*, use_gpu: bool = False, transformer: Mapping | None = None,
               family: str | None = None) -> dict[str, PeerTool]:
    """The peers by name (`PEERS`), ready for one model.

    Args:
        use_gpu: the bench measures on CUDA (onnxruntime's transformers optimizer then fuses for the GPU).
        transformer: the model's zoo hints for `ort-transformers`, e.g. {"model_type": "bert", "num_heads": 2,
            "hidden_size": 128}; missing values are read from the graph.
        family: the model's zoo family ("cnn", "transformer", "rnn", "deploy"), when it is a zoo model.
    """

    def onnxsim(model):
        from onnxsim import simplify

        simplified, ok = simplify(model)
        if not ok:
            raise RuntimeError("onnxsim's own check failed")
        return simplified

    def onnxoptimizer(model):
        import onnxoptimizer as tool

        return tool.optimize(model)

    def onnxslim(model):
        import onnxslim as tool

        return tool.slim(model)

    def onnxscript(model):
        from onnxscript import optimizer

        return optimizer.optimize(model)

    def ort(model):
        return ort_transformers(model, hints=transformer, family=family, use_gpu=use_gpu)

    tools = {"onnxsim": onnxsim, "onnxoptimizer": onnxoptimizer, "onnxslim": onnxslim, "onnxscript": onnxscript,
             "onnxscript-ort": onnxscript_ort, "ort-transformers": ort}
    return {name: tools[name] for name in PEERS}


def run_peer(name: str, model: onnx.ModelProto, folder: str | os.PathLike,
             **tool_options) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """The peer `name` (`PEERS`) on `model`, with `peer_tools`' keywords `tool_options`: (the input, the output).

    A model whose weights reach ISOLATED_PEER_BYTES goes to a child process through files in `folder`, and both
    come back with their weights left there (`folder` must outlive them), so that this process holds no copy of
    them: sessions map them.

    Raises:
        whatever the tool raises (NotApplicable, ImportError...), from the child too; RuntimeError when the child dies.
    """
    if sum(tensor_bytes(t) for t in model.graph.initializer) < ISOLATED_PEER_BYTES:
        return model, peer_tools(**tool_options)[name](model)
    source = save_model(model, Path(folder) / "input.onnx", external=True)
    output = Path(folder) / "output.onnx"
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            pool.submit(_run_peer_child, name, str(source), str(output), tool_options).result()
        except BrokenProcessPool:
            raise RuntimeError(f"{name}'s process died (killed by the system: out of memory?)") from None
    return read_model(source, external=True), read_model(output, external=True)


def _run_peer_child(name: str, source: str, output: str, tool_options: dict) -> None:
    save_model(peer_tools(**tool_options)[name](read_model(source)), output, external=True)


def zoo_hints(model: onnx.ModelProto, path: str | os.PathLike | None = None) -> dict:
    """`peer_tools`' keywords from the zoo: the model's family and its transformer hints (`ZooEntry.transformer`,
    where the entry has them).  The entry is the one named by the model's metadata (`rlflow.zoo.name`, written by
    `rlflow zoo build`), else by its file stem; {} for models outside the zoo."""
    from rlflow import zoo

    names = [p.value for p in model.metadata_props if p.key == "rlflow.zoo.name"] + ([Path(path).stem] if path else [])
    for name in names:
        try:
            entry = zoo.get(name)
        except ValueError:
            continue
        return {"family": entry.family, "transformer": getattr(entry, "transformer", None)}
    return {}


def peer_settings(model: onnx.ModelProto) -> dict:
    """The settings a peer recorded in its output (`PEER_SETTINGS_KEY`), removed from it; {} when none."""
    for k, prop in enumerate(model.metadata_props):
        if prop.key == PEER_SETTINGS_KEY:
            value = prop.value
            del model.metadata_props[k]
            return json.loads(value)
    return {}


# ------------------------------------------------------------------------------------- onnxruntime's transformers
def ort_transformers(model: onnx.ModelProto, *, hints: Mapping | None = None, family: str | None = None,
                     use_gpu: bool = False) -> onnx.ModelProto:
    """onnxruntime's transformers optimizer as optimum's O2 runs it; the input is left untouched.

    One setting differs from O2, for the bench's verification on random masks: a fused Attention takes the raw
    attention mask (O2 on BERT turns it into the index of the first padded position, right only for right-padded
    masks).  As in O2, whose default disables it, EmbedLayerNormalization is not fused.  The output records the
    settings (`peer_settings`).

    Raises:
        NotApplicable: the model is not a transformer, as optimum refuses model types outside its list.  Hints, or
            zoo family "transformer", say it is one; zoo family "cnn" or "rnn" says it is not; otherwise (another
            family, e.g. the zoo's deployment entries without hints, or no zoo entry) the graph decides: it needs
            attention, a Softmax feeding a MatMul.
    """
    if not hints and family in ("cnn", "rnn"):
        raise NotApplicable(f"not a transformer (zoo family '{family}')")
    if not hints and family != "transformer" and not has_attention(model):
        raise NotApplicable("not a transformer (no Softmax feeding a MatMul in the graph)")
    from onnxruntime.transformers.fusion_options import AttentionMaskFormat, FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    settings = transformer_settings(model, hints)
    options = FusionOptions(settings["model_type"])
    options.enable_embed_layer_norm = False
    if settings["model_type"] not in ("vit", "swin"):  # those run without a mask
        options.use_raw_attention_mask(True)
    with tempfile.TemporaryDirectory(prefix="rlflow-ort-transformers-") as tmp, working_directory(tmp):
        # A path, not the proto: the optimizer then handles external data, and its own temporary files, as well as
        # the `sym_shape_infer_temp.onnx` its shape inference writes into the working directory when it cannot
        # finish, land in this folder.
        path = save_model(model, Path(tmp) / "input.onnx")
        optimizer = optimize_model(str(path), settings["model_type"], settings["num_heads"], settings["hidden_size"],
                                   optimization_options=options, opt_level=ORT_OPT_LEVEL, use_gpu=use_gpu,
                                   provider="cuda" if use_gpu else None)
        fused = optimizer.get_fused_operator_statistics()
        output = optimizer.model  # loaded with its weights in memory, so nothing refers into this folder
    output.ir_version = min(output.ir_version, max_ir_version())
    raw_mask = options.attention_mask_format == AttentionMaskFormat.AttentionMask
    settings.update(opt_level=ORT_OPT_LEVEL, use_gpu=use_gpu, attention_mask="raw" if raw_mask else "none",
                    embed_layer_norm=False, fused={op: n for op, n in fused.items() if n})
    for k in reversed(range(len(output.metadata_props))):
        if output.metadata_props[k].key == PEER_SETTINGS_KEY:
            del output.metadata_props[k]
    output.metadata_props.add(key=PEER_SETTINGS_KEY, value=json.dumps(settings, sort_keys=True))
    return output


def onnxscript_ort(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxscript's optimizer, then its fusions for onnxruntime (`optimize_for_ort`, the default configuration);
    the fusions it reported travel in the output's `PEER_SETTINGS_KEY`.  It runs on a copy: on a dynamo export of
    a Llama-style decoder its fusions write into the protos the IR was read from."""
    import onnx_ir as ir
    from onnxscript import optimizer
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = ir.from_proto(copy)
    optimizer.optimize(graph)
    graph, fused = optimize_for_ort(graph)
    output = ir.to_proto(graph)
    output.ir_version = min(output.ir_version, max_ir_version())
    settings = {"fused": {name: n for name, n in sorted(fused.items()) if n}}
    output.metadata_props.add(key=PEER_SETTINGS_KEY, value=json.dumps(settings, sort_keys=True))
    return output


def transformer_settings(model: onnx.ModelProto, hints: Mapping | None = None) -> dict:
    """model_type, num_heads and hidden_size for the optimizer: the hints' values, the rest read from the graph (0
    where the graph does not tell: the optimizer then detects it itself), and where each came from."""
    hints = dict(hints or {})
    found = {"model_type": None, "num_heads": None, "hidden_size": None}
    sources = {}
    for key in found:
        if hints.get(key):
            found[key], sources[key] = hints[key], "zoo"
    if found["model_type"] is None:
        found["model_type"], sources["model_type"] = graph_model_type(model), "graph"
    if found["hidden_size"] is None or found["num_heads"] is None:
        heads, hidden = graph_heads_and_hidden(model, found["hidden_size"])
        for key, value in (("num_heads", heads), ("hidden_size", hidden)):
            if found[key] is None:
                found[key], sources[key] = value, "graph"
    heads, hidden = found["num_heads"], found["hidden_size"]
    if not (heads and hidden and hidden % heads == 0):  # the optimizer takes both or neither
        found.update(num_heads=0, hidden_size=0)
        sources.update(num_heads="optimizer", hidden_size="optimizer")
    return {**found, "source": sources}


def graph_model_type(model: onnx.ModelProto) -> str:
    """'gpt2' for a causal decoder (Trilu, past inputs, or a triangular mask constant), 'vit' for a 4-D float input,
    else 'bert'."""
    graph = model.graph
    if any(n.op_type == "Trilu" for n in graph.node) or any("past" in i.name.lower() for i in graph.input):
        return "gpt2"
    for tensor in _constants(graph).values():
        if tensor.ndim >= 2 and tensor.shape[-1] == tensor.shape[-2] > 1 and tensor.size <= 1 << 24 \
                and tensor.dtype.kind in "biuf":
            square = tensor.reshape(-1, *tensor.shape[-2:])[0]
            triangular = np.array_equal(square, np.tril(square)) or np.array_equal(square, np.triu(square))
            if triangular and square.any() and not np.array_equal(square, np.diag(np.diag(square))):
                return "gpt2"  # a causal mask: ones on and below the diagonal, or masked_fill's strict upper part
    initializers = {t.name for t in graph.initializer}
    for vi in graph.input:
        tensor_type = vi.type.tensor_type
        if vi.name not in initializers and tensor_type.elem_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16,
                                                                     onnx.TensorProto.BFLOAT16) \
                and len(tensor_type.shape.dim) == 4:
            return "vit"
    return "bert"


def graph_heads_and_hidden(model: onnx.ModelProto, hidden: int | None = None) -> tuple[int, int]:
    """(heads, hidden size) read from the graph, 0 for what it does not show.

    Hidden size: the last dimension of a LayerNormalization's scale, else the width of the embedding table gathered
    by a graph input.  Heads: the most common [..., heads, head_size] among the Reshapes that feed attention's
    Transpose (perm [0, 2, ...]); a -1 there counts as hidden / head_size, and an unknown head_size (computed from
    the input's shape) is fine where heads divides the hidden size.
    """
    graph = model.graph
    constants = _constants(graph)
    producers = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list[onnx.NodeProto]] = collections.defaultdict(list)
    for node in graph.node:
        for name in node.input:
            consumers[name].append(node)

    def constant(name: str) -> np.ndarray | None:
        """The value of `name` where it is a constant, also through Identity and Unsqueeze (exporters' shapes)."""
        while name not in constants and name in producers and producers[name].op_type in ("Identity", "Unsqueeze"):
            name = producers[name].input[0]
        return constants.get(name)

    if not hidden:
        widths = [scale.shape[-1] for node in graph.node if node.op_type == "LayerNormalization"
                  for scale in [constant(node.input[1])] if scale is not None and scale.ndim >= 1]
        if not widths:
            inputs = {i.name for i in graph.input}
            widths = [table.shape[1] for node in graph.node if node.op_type == "Gather" and node.input[1] in inputs
                      for table in [constant(node.input[0])] if table is not None and table.ndim == 2]
        hidden = collections.Counter(widths).most_common(1)[0][0] if widths else 0

    splits = []
    for node in graph.node:
        if node.op_type != "Reshape" or not any(
                c.op_type == "Transpose" and _perm(c)[:2] == [0, 2] for c in consumers[node.output[0]]):
            continue
        heads, head_size = _shape_tail(node.input[1], constant, producers)
        if (heads or 0) <= 0 and (head_size or 0) > 0 and hidden and hidden % head_size == 0:
            heads = hidden // head_size  # [..., -1, head_size]
        if (heads or 0) > 0 and (not hidden or hidden % heads == 0) and (
                (head_size or 0) <= 0 or not hidden or heads * head_size == hidden):
            splits.append(heads)
    heads = collections.Counter(splits).most_common(1)[0][0] if splits else 0
    return int(heads), int(hidden)


def has_attention(model: onnx.ModelProto) -> bool:
    """A Softmax whose output reaches a MatMul through at most two elementwise steps, or a fused attention op."""
    graph = model.graph
    if any(n.op_type in ("Attention", "MultiHeadAttention", "GroupQueryAttention") for n in graph.node):
        return True
    consumers: dict[str, list[onnx.NodeProto]] = collections.defaultdict(list)
    for node in graph.node:
        for name in node.input:
            consumers[name].append(node)
    passthrough = {"Cast", "Where", "Dropout", "Identity", "Mul", "Add"}
    for node in graph.node:
        if node.op_type != "Softmax":
            continue
        frontier = [node.output[0]]
        for _ in range(3):
            following = [c for name in frontier for c in consumers[name]]
            if any(c.op_type == "MatMul" for c in following):
                return True
            frontier = [out for c in following if c.op_type in passthrough for out in c.output]
    return False


def _shape_tail(name: str, constant: Callable, producers: Mapping) -> tuple[int | None, int | None]:
    """The last two entries of a 4-D Reshape target (None where not constant): from a constant, or from a Concat of
    four one-element parts."""
    shape = constant(name)
    if shape is not None:
        shape = shape.reshape(-1)
        return (int(shape[-2]), int(shape[-1])) if shape.size == 4 else (None, None)
    node = producers.get(name)
    if node is None or node.op_type != "Concat" or len(node.input) != 4:
        return None, None
    parts = [constant(part) for part in node.input[-2:]]
    return tuple(int(p.reshape(-1)[0]) if p is not None and p.size == 1 else None for p in parts)


def _perm(node: onnx.NodeProto) -> list[int]:
    return next((list(a.ints) for a in node.attribute if a.name == "perm"), [])


def _constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """Initializers and Constant-node values stored in the model (external data is not read)."""
    out = {}
    for tensor in graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            out[tensor.name] = numpy_helper.to_array(tensor)
    for node in graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value" and attr.t.data_location != onnx.TensorProto.EXTERNAL:
                    out[node.output[0]] = numpy_helper.to_array(attr.t)
    return out


@contextlib.contextmanager
def working_directory(path: str) -> Iterator[None]:
    """contextlib.chdir, which Python 3.10 lacks."""
    previous = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)
