"""onnxruntime-genai's model builder as the decoders' hand-built reference (issue #50): the builder's graph of a zoo
decoder, built from the same weights (`rlflow.bench.genai_builder`), timed as a step at the same cache length beside
the peers, never as a rewrite of the input.

1. Its inputs are read from its graph and filled from the export's step (`builder_feeds`): the same token, mask and
   cache, in the builder's names, layout and dtypes (it computes positions from the mask and takes no position_ids; a
   prefill gets an empty cache).
2. rlflow's onnxruntime runs it, its inputs fixed at those shapes as the bench fixes every model's: its logits against
   the export's on those inputs (same weights: they agree within the zoo's tolerance), an interleaved comparison with
   the export (`compare`, each model fed its own inputs), and both graphs' node counts after onnxruntime's
   ORT_ENABLE_ALL on the CPU provider (the structure target's measure), static and as the files are.
The genai runtime shares one cache buffer of the context length between steps; here the cache is at the step's length.
`rlflow bench --peers` adds the row to zoo decoders when the builder's venv exists; `rlflow bench-builder`
(`bench_builder`) makes it alone.
"""
from __future__ import annotations

import datetime
import json
import os
import tempfile
import time
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path
from typing import Mapping

import numpy as np
import onnx

from rlflow.bench.genai_builder import Decoder, build_reference, builder_command, decoder, decoder_of
from rlflow.bench.results import Row
from rlflow.errors import RlflowError
from rlflow.files import write_text_atomic
from rlflow.graph.core import Graph
from rlflow.measure.session import SessionSettings, create_session, inference_session, run_session, session_options
from rlflow.measure.timing import compare
from rlflow.rewrites import apply_everywhere, rule
from rlflow.search.candidates import Candidate, all_fusions

REFERENCE = "genai-builder"  # the reference row's method

TOLERANCE = {"fp32": 1e-3, "fp16": 3e-2}
"""Largest logits difference from the export's, relative to their largest magnitude, by the builder's precision (the
zoo checks its exports against PyTorch with the same figures)."""

_ROLES = ("input_ids", "attention_mask", "position_ids")


def step_feeds(dec: Decoder, shapes: Mapping, seed: int) -> dict[str, np.ndarray]:
    """The export's inputs of one step at `shapes` (its graph's input shapes): the zoo's (token ids from the
    vocabulary, an all-ones mask, positions after the cache, an N(0, 1) cache)."""
    from rlflow.zoo import decoders

    length = shapes["input_ids"][1] if dec.kind == "prefill" else shapes["attention_mask"][1] - 1
    inputs = decoders.inputs_at(dec.arch, dec.kind, dec.dtype, batch=shapes["input_ids"][0], length=length, seed=seed)
    return {name: value.numpy() for name, value in inputs.items()}


def _genai_names(model_path: Path | None) -> dict:
    """The builder's input names by role, from the genai_config.json beside its graph (the zoo's names without one)."""
    config = model_path.parent / "genai_config.json" if model_path is not None else None
    names = {role: role for role in _ROLES}
    names.update(past_key_names="past_key_values.%d.key", past_value_names="past_key_values.%d.value")
    if config is not None and config.is_file():
        names.update(json.loads(config.read_text())["model"]["decoder"]["inputs"])
    return names


def builder_feeds(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], dec: Decoder,
                  model_path: Path | None = None) -> dict[str, np.ndarray]:
    """The builder's graph's inputs, filled from the export's `feeds`: by role (its genai_config's names), in its
    dtypes and cache layout ((batch, heads, past, head) or (batch, past, heads, head)); an empty cache where the
    export takes none (a prefill).

    Raises:
        RlflowError: an input it cannot fill from the export's.
    """
    names = _genai_names(model_path)
    batch = feeds["input_ids"].shape[0]
    kv_heads, head_dim = dec.arch.kv_shape
    export_name = {names[role]: role for role in _ROLES if role in names}
    for layer in range(dec.arch.layers):
        for kv in ("key", "value"):
            export_name[names[f"past_{kv}_names"] % layer] = f"past_key_values.{layer}.{kv}"
    out = {}
    for vi in model.graph.input:
        source = export_name.get(vi.name)
        if source is None:
            raise RlflowError(f"the builder's input {vi.name} has no counterpart in the export's step")
        value = feeds.get(source)
        if value is None and source.startswith("past_key_values."):
            value = np.zeros((batch, kv_heads, 0, head_dim), dtype=dec.dtype)  # a prefill's cache: empty
        if value is None:
            raise RlflowError(f"the export's step has no {source} for the builder's input {vi.name}")
        fixed = [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
        layouts = [value] + ([value.swapaxes(1, 2)] if value.ndim == 4 else [])
        fitting = [v for v in layouts if v.ndim == len(fixed) and all(f in (None, s) for f, s in zip(fixed, v.shape))]
        if not fitting:
            raise RlflowError(f"the builder's input {vi.name} is {fixed}; the export's {source} is {list(value.shape)}")
        dtype = onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        out[vi.name] = np.ascontiguousarray(fitting[0].astype(dtype, copy=False))
    return out


def optimized_ops(model: onnx.ModelProto | str | os.PathLike, provider: str = "CPUExecutionProvider") -> dict:
    """The model's operators (op type -> count) after onnxruntime's ORT_ENABLE_ALL on `provider`, saved as onnxruntime
    writes it (SessionOptions.optimized_model_filepath, weights into a file beside it)."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="rlflow-ort-all-") as tmp:
        options = session_options(SessionSettings(provider=provider, threads=1))
        options.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "weights.bin")
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        if isinstance(model, onnx.ModelProto):
            inference_session(model, options, [provider])
        else:
            ort.InferenceSession(str(model), sess_options=options, providers=[provider])
        saved = onnx.load(str(Path(tmp) / "optimized.onnx"), load_external_data=False)
    return dict(Counter(node.op_type for node in saved.graph.node))


def logits_difference(export, builder, export_feeds: Mapping, reference_feeds: Mapping,
                      settings: SessionSettings) -> dict:
    """Both graphs' logits on the same step: the largest difference, absolute and relative to the export's largest
    magnitude."""
    got = []
    for model, feeds in ((export, export_feeds), (builder, reference_feeds)):
        session = create_session(model, replace(settings, cuda_graph=False))
        # every output fetched: onnxruntime's CUDA GroupQueryAttention refuses to run when its present outputs are not
        names = [output.name for output in session.get_outputs()]
        got.append(run_session(session, names, feeds)[names.index("logits")].astype(np.float64))
        del session
    if got[0].shape != got[1].shape:
        raise RlflowError(f"the builder's logits are {got[1].shape}, the export's {got[0].shape}")
    difference, largest = float(np.abs(got[0] - got[1]).max()), float(np.abs(got[0]).max())
    return {"logits_max_abs_diff": difference, "logits_max_rel_diff": difference / max(largest, 1e-30)}


def builder_graph(path: str | os.PathLike) -> onnx.ModelProto:
    """The builder's graph as built, its weights left in their file (absolute locations)."""
    from rlflow.graph.external_data import resolve_external_data

    model = onnx.load(str(path), load_external_data=False)
    resolve_external_data(model, Path(path).parent)
    return model


def with_fixed_inputs(path: Path, feeds: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """The builder's graph with its inputs fixed at the shapes of `feeds`, as the bench measures every model; its
    weights stay in their file (absolute locations)."""
    model = builder_graph(path)
    for vi in model.graph.input:
        for dim, size in zip(vi.type.tensor_type.shape.dim, feeds[vi.name].shape):
            dim.Clear()
            dim.dim_value = size
    return model


def reference_row(source: onnx.ModelProto, shapes: Mapping, dec: Decoder, settings: SessionSettings, *,
                  rounds: int = 30, seed: int = 0, precision: str = "fp32", provider: str | None = None,
                  builder: Path | tuple[Path, dict] | None = None, export_file: str | os.PathLike | None = None,
                  model_name: str | None = None) -> Row:
    """The reference row of one decoder step: the builder's graph (`builder`: `build_reference`'s answer, or a path;
    None: built here), its inputs fixed at the step's shapes as `source`'s are (the bench's static input at `shapes`),
    timed interleaved against `source` on the same step; its logits checked against the export's; node counts after
    ORT_ENABLE_ALL on the CPU of both, static and as the files are (`export_file`, where given).  Not a rewrite of the
    input: `kind` ``reference``, `rewritten` False; the speedup is the export's time over the builder's."""
    import onnxruntime

    provider = provider or ("cuda" if settings.provider == "CUDAExecutionProvider" else "cpu")
    start = time.monotonic()
    record = {"precision": precision, "provider": provider}
    if builder is None:
        builder = build_reference(dec, precision=precision, provider=provider)
    if isinstance(builder, tuple):
        builder, record = builder
    seconds = record.get("seconds", time.monotonic() - start)
    export_feeds = step_feeds(dec, shapes, seed)
    feeds = builder_feeds(onnx.load(str(builder), load_external_data=False), export_feeds, dec, builder)
    fixed = with_fixed_inputs(Path(builder), feeds)
    numerics = logits_difference(source, fixed, export_feeds, feeds, settings)
    verified = numerics["logits_max_rel_diff"] <= TOLERANCE[precision]
    ops = {"export": optimized_ops(source), "all-fusions": optimized_ops(fused_and_packed(source)),
           REFERENCE: optimized_ops(fixed)}
    built = {REFERENCE: optimized_ops(builder), **({"export": optimized_ops(export_file)} if export_file else {})}
    comparison = compare([source, fixed], settings, rounds=rounds, seed=seed, feeds=[export_feeds, feeds],
                         labels=["export", REFERENCE])
    ratio = comparison.ratios[1]
    details = {**record, **numerics, "tolerance": TOLERANCE[precision], "builder_model": str(builder),
               "reference": "different inputs: timed as a step at the same cache length, not a rewrite of the input",
               "timed_with": f"onnxruntime {onnxruntime.__version__} (rlflow's)", "builder_inputs": _inputs(feeds),
               "nodes_after_ort_all": {k: sum(v.values()) for k, v in ops.items()},
               "nodes_after_ort_all_as_built": {k: sum(v.values()) for k, v in built.items()},
               "ops_after_ort_all": ops}
    return Row(model_name or source.graph.name, REFERENCE, "ok" if verified else "wrong output",
               "" if verified else f"logits differ by {numerics['logits_max_rel_diff']:.2e} of their largest",
               "reference", baseline_ms=comparison.timings[0].median_ms, latency_ms=comparison.timings[1].median_ms,
               speedup=ratio.median, speedup_low=ratio.low, speedup_high=ratio.high, faster=ratio.faster,
               rewritten=False, verified=verified, max_rel_error=numerics["logits_max_rel_diff"], seconds=seconds,
               reason="reference (different inputs): the builder's graph of the same weights, timed as a step at the "
                      "same cache length; not a rewrite of the input", peer_settings=details)


def fused_and_packed(source: onnx.ModelProto) -> onnx.ModelProto:
    """The static export with every fusion rule applied wherever it matches (`all_fusions`), then sibling projections
    packed (matmul-merge-siblings: Q, K and V where Qwen3's norms keep them out of the attention, gate and up), as the
    builder packs them: the graph issue #50's node-count target compares with the builder's."""
    graph = Graph.from_model(source)
    fused = all_fusions(Candidate(graph, (), graph.fingerprint()))
    graph = fused.graph if fused is not None else graph
    pack = rule("matmul-merge-siblings")
    graph, _ = apply_everywhere(graph, pack, pack.find(graph))
    return graph.to_model(static=True)


def _inputs(feeds: Mapping[str, np.ndarray]) -> dict:
    """The builder's inputs as recorded: name -> shape and dtype, its cache tensors once for all."""
    out = {name: f"{list(v.shape)} {v.dtype}" for name, v in feeds.items() if v.ndim != 4}
    cache = [v for v in feeds.values() if v.ndim == 4]
    return {**out, "cache": f"{len(cache)} x {list(cache[0].shape)} {cache[0].dtype}"} if cache else out


def bench_references(model: onnx.ModelProto, path: str | os.PathLike | None) -> tuple[str, ...]:
    """`rlflow bench --peers`: (REFERENCE,) for a zoo decoder when the builder's venv exists, else ()."""
    return (REFERENCE,) if builder_command() is not None and decoder_of(model, path) is not None else ()


def export_precision(dec: Decoder) -> str:
    """The builder's -p for the export's own precision (the reference); `rlflow bench-precision` asks for int4."""
    return "fp16" if dec.dtype == "float16" else "fp32"


def bench_row(graph, source: onnx.ModelProto, settings: SessionSettings, config) -> Row:
    """The bench's reference row for `graph` (an `rlflow.graph.core.Graph` of a zoo decoder; `source` its static
    model, the bench's input) at its shapes, built in the export's precision for the bench's provider."""
    dec = decoder_of(source, graph.source)
    return reference_row(source, dict(graph.input_shapes), dec, settings, rounds=config.rounds, seed=config.seed,
                         precision=export_precision(dec), export_file=graph.source,
                         model_name=Path(graph.source or dec.name).stem)


def bench_builder(models, precision: str = "fp32", execution_provider: str = "cpu", threads: int = 1, rounds: int = 30,
                  seed: int = 0, cuda_graph: bool = False, out: str | Path = Path("builder-reference.json")) -> dict:
    """`rlflow bench-builder MODEL...`: the reference row of each zoo decoder step in `models` (files named as `rlflow
    zoo build` names them), one at a time: the builder's graph at `precision` (its -p) for `execution_provider` (its
    -e, and the provider both graphs are measured on; with `cuda_graph`, as captured CUDA graphs), measured against
    the export in `rounds` interleaved rounds; the JSON file `out` is written after every model; returns it."""
    import onnxruntime

    from rlflow.graph.core import load
    from rlflow.measure.memory import shares_weights
    from rlflow.measure.session import check_capture, resolve_provider

    provider = resolve_provider(execution_provider)
    check_capture(provider, cuda_graph)
    settings = SessionSettings(provider=provider, threads=threads, cuda_graph=cuda_graph)
    rows, results, out = [], None, Path(out)
    for path in map(Path, models):
        dec = decoder(path.with_suffix(".json") if path.with_suffix(".json").is_file() else path.stem)
        builder = build_reference(dec, precision=precision, provider=execution_provider)
        graph = load(path)  # after the build, and dropped before measuring: one copy of the weights fewer
        shapes, shared, source = dict(graph.input_shapes), shares_weights(graph), graph.to_model(static=True)
        del graph
        row = reference_row(source, shapes, dec, replace(settings, share_weights=shared), rounds=rounds,
                            seed=seed, precision=precision, provider=execution_provider,
                            builder=builder, export_file=path, model_name=path.stem)
        del source
        rows.append(asdict(row))
        nodes, built = row.peer_settings["nodes_after_ort_all"], row.peer_settings["nodes_after_ort_all_as_built"]
        print(f"{row.model}: export {row.baseline_ms:.3f} ms, builder {row.latency_ms:.3f} ms, export/builder "
              f"{row.speedup:.3f} [{row.speedup_low:.3f}, {row.speedup_high:.3f}]; nodes after ORT_ENABLE_ALL, "
              f"static: export {nodes['export']}, all fusions {nodes['all-fusions']}, builder {nodes[REFERENCE]}; "
              f"as built: export {built['export']}, "
              f"builder {built[REFERENCE]}; logits max diff {row.peer_settings['logits_max_abs_diff']:.2e} "
              f"({row.status})")
        results = {"date": datetime.date.today().isoformat(), "settings": settings.as_dict(), "rounds": rounds,
                   "seed": seed, "onnxruntime": onnxruntime.__version__, "rows": rows}
        write_text_atomic(out, json.dumps(results, indent=1, default=str) + "\n")
    return results
