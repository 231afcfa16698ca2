"""onnxruntime sessions with explicit settings, on a named or auto-detected execution provider."""
from __future__ import annotations

import ctypes
import os
import re
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from rlflow.errors import InputError, ProviderError
from rlflow.graph.external_data import (
    external_array,
    external_info,
    external_tensors,
    set_external_data,
    tensor_bytes,
)

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
OPT_LEVELS = ("disable", "basic", "extended", "all")


def _ort():
    try:
        import onnxruntime
    except ImportError:
        raise ProviderError("onnxruntime is not installed: pip install 'rlflow[cpu]' (or 'rlflow[gpu]' for CUDA)") from None
    return onnxruntime


def resolve_provider(name: str = "auto") -> str:
    """The onnxruntime provider for `auto` (CUDA when usable, else CPU), `cpu` or `cuda`.

    Raises:
        ProviderError: the named provider is not available in this onnxruntime build.
    """
    available = _ort().get_available_providers()
    key = name.lower()
    if key == "auto":
        return PROVIDERS["cuda"] if PROVIDERS["cuda"] in available else PROVIDERS["cpu"]
    if key not in PROVIDERS:
        raise ProviderError(f"unknown provider '{name}': choose auto, cpu or cuda")
    provider = PROVIDERS[key]
    if provider not in available:
        hint = " (install onnxruntime-gpu with: pip install 'rlflow[gpu]')" if key == "cuda" else ""
        raise ProviderError(f"the {provider} is not available in this onnxruntime{hint}")
    return provider


def check_capture(provider: str, cuda_graph: bool) -> None:
    """`--cuda-graph` on another provider than CUDA: one line, before any work (`rlflow optimize`, `rlflow bench`).

    Raises:
        InputError: `cuda_graph` with a provider other than CUDA.
    """
    if cuda_graph and provider != PROVIDERS["cuda"]:
        raise InputError(f"--cuda-graph needs the CUDA provider; this run's is {provider}")


@dataclass(frozen=True)
class SessionSettings:
    """Everything that changes how fast a session runs; recorded with every measurement.

    Attributes:
        provider: onnxruntime execution provider name.
        threads: intra-op threads (1 is the quiet setting on small shared machines).
        opt_level: onnxruntime graph optimisation level; `all` is the baseline every user already has.
        execution_mode: `sequential` or `parallel`.
        share_weights: sessions use the weights mapped from the model's external-data file in place (one mapping for
            the whole process) and do not pre-pack them; for models whose weights are a large share of memory
            (`SHARE_WEIGHTS_BYTES`), where every session's own copy made a 2.5 GiB model peak at 6x its size.
        cuda_graph: CUDA only: onnxruntime captures a run as one CUDA graph and replays it (`enable_cuda_graph`), with
            inputs and outputs at fixed device addresses (`rlflow.measure.timing.Runner`). At batch 1 on an H100 the
            setting alone made the zoo 1.28-4.31x faster (docs/gpu.md), so a rewrite for such a deployment must
            be measured with it on.
    """

    provider: str = "CPUExecutionProvider"
    threads: int = 1
    opt_level: str = "all"
    execution_mode: str = "sequential"
    share_weights: bool = False
    cuda_graph: bool = False

    def __post_init__(self) -> None:
        if self.opt_level not in OPT_LEVELS:
            raise ValueError(f"opt_level must be one of {OPT_LEVELS}")
        if self.threads < 0:
            raise ValueError("threads must be >= 0 (0 lets onnxruntime choose)")
        if self.cuda_graph and self.provider != PROVIDERS["cuda"]:
            raise ValueError(f"CUDA graph capture needs the {PROVIDERS['cuda']}, not {self.provider}")

    def as_dict(self) -> dict:
        """The settings as recorded; `cuda_graph` only when on, so that records made before it existed still match."""
        recorded = asdict(self)
        if not self.cuda_graph:
            del recorded["cuda_graph"]
        return recorded


def session_options(settings: SessionSettings, profile_prefix: str | None = None, save_optimised: str | None = None,
                    weights_file: str | None = None):
    """onnxruntime SessionOptions for the settings; `save_optimised`: a path where onnxruntime writes the graph it
    runs (its weights in `weights_file` beside it, where given)."""
    ort = _ort()
    levels = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    options = ort.SessionOptions()
    options.graph_optimization_level = levels[settings.opt_level]
    options.intra_op_num_threads = settings.threads
    options.inter_op_num_threads = 1
    options.execution_mode = (ort.ExecutionMode.ORT_PARALLEL if settings.execution_mode == "parallel"
                              else ort.ExecutionMode.ORT_SEQUENTIAL)
    options.log_severity_level = 3
    if settings.share_weights:  # a pre-packed weight is a private copy per session
        options.add_session_config_entry("session.disable_prepacking", "1")
    if profile_prefix:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    if save_optimised:
        options.optimized_model_filepath = save_optimised
        if weights_file:
            options.add_session_config_entry("session.optimized_model_external_initializers_file_name", weights_file)
            options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    return options


def create_session(model: onnx.ModelProto | bytes | str | os.PathLike, settings: SessionSettings | None = None,
                   *, provider: str | None = None, profile_prefix: str | None = None, save_optimised: str | None = None,
                   weights_file: str | None = None):
    """An InferenceSession for a model proto, serialized bytes or a path (`session_options` for the keywords).

    A proto whose weights are external data (as rlflow loads them), or that is over protobuf's 2 GB limit, gets its
    weights beside the proto: see `_session_with_weights_aside`.

    Raises:
        ProviderError: onnxruntime cannot build a session (an operator the provider cannot run, a bad model...).
    """
    ort = _ort()
    settings = settings or SessionSettings(provider=provider or "CPUExecutionProvider")
    options = session_options(settings, profile_prefix, save_optimised, weights_file)
    first = (settings.provider, {"enable_cuda_graph": "1"}) if settings.cuda_graph else settings.provider
    providers = [first] + (["CPUExecutionProvider"] if settings.provider != "CPUExecutionProvider" else [])
    try:
        if isinstance(model, onnx.ModelProto):
            session = inference_session(model, options, providers, share_weights=settings.share_weights)
        else:
            session = ort.InferenceSession(str(model) if isinstance(model, (str, os.PathLike)) else model,
                                           sess_options=options, providers=providers)
    except ProviderError:
        raise
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises several private exception types
        if settings.cuda_graph and "graph capture" in str(exc):
            raise ProviderError("onnxruntime cannot capture this model as one CUDA graph: it places some of its "
                                "nodes on the CPU; measure without CUDA graph capture") from None
        raise cannot_run(settings, exc) from None
    if session.get_providers()[0] != settings.provider:
        # onnxruntime-gpu whose CUDA libraries do not load logs it and runs on the CPU: a timing would be mislabelled
        raise ProviderError(f"onnxruntime could not start the {settings.provider} (it fell back to "
                            f"{session.get_providers()[0]}); check the CUDA and cuDNN libraries it needs")
    return session


def inference_session(model: onnx.ModelProto, options, providers: Sequence[str], share_weights: bool = False):
    """onnxruntime's InferenceSession for a proto, whatever the size of its weights or where they are stored.

    Weights kept as external data (as rlflow loads them), or a proto over protobuf's 2 GB limit, are handled by
    `_session_with_weights_aside`; onnxruntime's own errors pass through.
    """
    source = session_source(model)
    if not isinstance(source, bytes):
        return _session_with_weights_aside(model, options, providers, share_weights)
    return _ort().InferenceSession(source, sess_options=options, providers=providers)


def session_source(model: onnx.ModelProto) -> onnx.ModelProto | bytes:
    """What a model's sessions are built from (`create_session` takes either): its serialized bytes where its weights
    are all inside and it is under PROTO_LIMIT, else the proto itself, for `_session_with_weights_aside`.

    `compare` takes it once per model for all of the model's sessions: serializing a 600-node transformer and checking
    its size took 0.14 s per session, a third of an interleaved comparison's time on BERT-L4 (two sessions per model).
    """
    if external_tensors(model):
        return model
    try:
        data = model.SerializeToString()  # once: its length is the size check (ByteSize cost as much again)
    except ValueError:  # protobuf refuses a message over 2 GB
        return model
    return model if len(data) > PROTO_LIMIT else data


PROTO_LIMIT = 2**31 - 1 - 2**20
"""Serialized protos above this (protobuf's 2 GB limit, less a margin) never reach onnxruntime whole."""

_HANDED_MIN_BYTES = 2**20
"""In-proto weights from this size on are handed to onnxruntime separately (`_session_with_weights_aside`)."""


def _session_with_weights_aside(model: onnx.ModelProto, options, providers, share_weights: bool = False):
    """A session for a proto whose weights are not all inside it, built without writing anything to disk.

    onnxruntime maps the external-data files of one folder itself (the session option
    `session.model_external_initializers_file_folder_path`: no start-up cost; the folder holding most of the weights
    is chosen), but each session holds its own copy (2.5 GiB of dense MatMul weights cost 2.5 GiB per session).
    Weights in other folders, and the in-proto weights from _HANDED_MIN_BYTES on (those a rewrite made, or all of a
    proto built in memory), are handed over as OrtValues (`add_external_initializers`; onnxruntime copies those):
    serialized into the proto and parsed again, a candidate's packed projections (335 MB of Qwen3-L8's) took 1-2 s
    more of each session than the input's, and a proto over 2 GB cannot be serialized at all.  With `share_weights`,
    every external tensor is also handed to onnxruntime in place (`add_initializer`, from rlflow's one map of its file,
    `external_array`), so all sessions of the process read the same pages: three sessions of that model took 2.6 GiB in
    all, not 7.7.
    """
    work = onnx.ModelProto()
    work.CopyFrom(model)
    external = [t for t in external_tensors(work) if os.path.isabs(external_info(t)[0])]
    per_folder: Counter = Counter()
    for tensor in external:
        per_folder[os.path.dirname(external_info(tensor)[0])] += external_info(tensor)[2] or 0
    folder = max(per_folder, key=per_folder.get) if per_folder else None
    handed: dict[str, np.ndarray] = {}
    for tensor in work.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            location = external_info(tensor)[0]
            if not os.path.isabs(location) or os.path.dirname(location) == folder:
                continue
            handed[tensor.name] = external_array(tensor)
        elif tensor.HasField("raw_data") and _raw_bytes(tensor) >= _HANDED_MIN_BYTES:
            handed[tensor.name] = numpy_helper.to_array(tensor)
        else:
            continue
        set_external_data(tensor, "handed-over-in-memory")  # onnxruntime only checks that it replaces external data
    # before their locations become relative below
    in_place = {t.name: external_array(t) for t in external if t.name not in handed} if share_weights else {}
    shared = ort_feeds(in_place)
    for tensor in external:  # relative to the folder onnxruntime is told about
        entry = next(e for e in tensor.external_data if e.key == "location")
        if os.path.dirname(entry.value) == folder:
            entry.value = os.path.basename(entry.value)
    if folder is not None:
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", folder)
    values = ort_feeds(handed)
    if values:
        options.add_external_initializers(list(values), list(values.values()))
    for name, value in shared.items():
        options.add_initializer(name, value)
    session = _ort().InferenceSession(work.SerializeToString(), sess_options=options, providers=providers)
    session.rlflow_handed_weights = (handed, values, in_place, shared)  # onnxruntime reads them while it lives
    return session


def _raw_bytes(tensor: onnx.TensorProto) -> int:
    """Bytes of an in-proto tensor's raw data (`tensor_bytes`: from its shape); 0 for element types numpy has no plain
    type for (bfloat16, float8, 4-bit), which stay in the proto."""
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
    return tensor_bytes(tensor) if dtype.kind in "fiub" else 0


def cannot_run(settings: SessionSettings, exc: Exception) -> ProviderError:
    """The one-line error for a model onnxruntime fails to build or run on the settings' provider."""
    return ProviderError(f"onnxruntime ({settings.provider}) cannot run the model: {_first_line(exc)}")


def ort_feeds(feeds: Mapping[str, np.ndarray]) -> dict:
    """Inputs as OrtValues: the only way to hand onnxruntime bfloat16 data from Python."""
    ort = _ort()
    values = {}
    for name, array in feeds.items():
        if str(array.dtype) == "bfloat16":
            values[name] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                np.ascontiguousarray(array).view(np.uint16), onnx.TensorProto.BFLOAT16)
        else:
            values[name] = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array))
    return values


def run_session(session, output_names: Sequence[str], feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Runs a session and returns numpy outputs, bfloat16 included (onnxruntime's own conversion refuses it)."""
    outputs = session.run_with_ort_values(list(output_names), ort_feeds(feeds))
    return [_to_numpy(value) for value in outputs]


def _to_numpy(value) -> np.ndarray:
    if value.data_type() != "tensor(bfloat16)":
        return value.numpy()
    import ml_dtypes

    shape = tuple(value.shape())
    count = int(np.prod(shape)) if shape else 1
    raw = (ctypes.c_uint16 * count).from_address(value.data_ptr()) if count else []
    return np.array(raw, dtype=np.uint16).view(ml_dtypes.bfloat16).reshape(shape)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    # onnxruntime prefixes messages with "[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : " and sometimes a C++ location
    line = line.split(" : ")[-1] if line.startswith("[ONNXRuntimeError]") else line
    return re.sub(r"^/\S+:\d+ .*?\) ", "", line)
