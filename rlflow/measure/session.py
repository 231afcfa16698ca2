"""onnxruntime sessions with explicit settings, on a named or auto-detected execution provider."""
from __future__ import annotations

import ctypes
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import onnx

from rlflow.errors import ProviderError

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


@dataclass(frozen=True)
class SessionSettings:
    """Everything that changes how fast a session runs; recorded with every measurement.

    Attributes:
        provider: onnxruntime execution provider name.
        threads: intra-op threads (1 is the quiet setting on small shared machines).
        opt_level: onnxruntime graph optimisation level; `all` is the baseline every user already has.
        execution_mode: `sequential` or `parallel`.
    """

    provider: str = "CPUExecutionProvider"
    threads: int = 1
    opt_level: str = "all"
    execution_mode: str = "sequential"

    def __post_init__(self) -> None:
        if self.opt_level not in OPT_LEVELS:
            raise ValueError(f"opt_level must be one of {OPT_LEVELS}")
        if self.threads < 0:
            raise ValueError("threads must be >= 0 (0 lets onnxruntime choose)")

    def as_dict(self) -> dict:
        return asdict(self)


def session_options(settings: SessionSettings, profile_prefix: str | None = None):
    """onnxruntime SessionOptions for the settings."""
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
    if profile_prefix:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    return options


def create_session(model: onnx.ModelProto | bytes | str | os.PathLike, settings: SessionSettings | None = None,
                   *, provider: str | None = None, profile_prefix: str | None = None):
    """An InferenceSession for a model proto, serialized bytes or a path.

    Models over protobuf's 2 GB limit are written to a temporary folder with external data first.

    Raises:
        ProviderError: onnxruntime cannot build a session (an operator the provider cannot run, a bad model...).
    """
    ort = _ort()
    settings = settings or SessionSettings(provider=provider or "CPUExecutionProvider")
    options = session_options(settings, profile_prefix)
    providers = [settings.provider] + (["CPUExecutionProvider"] if settings.provider != "CPUExecutionProvider" else [])
    try:
        if isinstance(model, onnx.ModelProto):
            if model.ByteSize() > 2**31 - 1 - 1024:
                return _session_from_large_model(model, options, providers)
            model = model.SerializeToString()
        if isinstance(model, (str, os.PathLike)):
            model = str(model)
        return ort.InferenceSession(model, sess_options=options, providers=providers)
    except ProviderError:
        raise
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises several private exception types
        raise ProviderError(f"onnxruntime ({settings.provider}) cannot run the model: {_first_line(exc)}") from None


def _session_from_large_model(model: onnx.ModelProto, options, providers):
    ort = _ort()
    with tempfile.TemporaryDirectory(prefix="rlflow-") as tmp:
        path = Path(tmp) / "model.onnx"
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        onnx.save_model(copy, str(path), save_as_external_data=True, location="model.onnx.data")
        return ort.InferenceSession(str(path), sess_options=options, providers=providers)


def check_runs(model: onnx.ModelProto, settings: SessionSettings, seed: int = 0) -> None:
    """Raises ProviderError unless onnxruntime builds a session for the model AND runs it once on random inputs.

    Some models pass session creation and fail only when run (a Reshape to an impossible shape, say).
    """
    from rlflow.measure.inputs import random_inputs

    session = create_session(model, settings)
    try:
        run_session(session, [o.name for o in session.get_outputs()], random_inputs(model, seed))
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises several private exception types
        raise ProviderError(f"onnxruntime ({settings.provider}) cannot run the model: {_first_line(exc)}") from None


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
