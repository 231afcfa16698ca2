"""ONNX model files: reading and checking them, writing them atomically, and weights kept in external-data files
(memory-mapped, never copied: models over protobuf's 2 GB limit load, measure and save within a small multiple of their
size)."""
from __future__ import annotations

import atexit
import errno
import functools
import logging
import os
import shutil
import tempfile
from pathlib import Path

import onnx
from onnx import helper

from rlflow.errors import InputError
from rlflow.files import cache_dir
from rlflow.graph.external_data import (
    _initializers,
    external_info,
    external_tensors,
    resolve_external_data,
    set_external_data,
    tensor_bytes,
)
from rlflow.graph.input_repairs import ort_only_layer_norm, repair

log = logging.getLogger("rlflow")

EXTERNAL_DATA_THRESHOLD = 1_800_000_000
"""Initializer bytes above which a model's weights stay in external-data files, when loaded and when saved (protobuf
messages cannot exceed 2 GB)."""

WEIGHTS_ASIDE_BYTES = 2**28
"""Inline initializer bytes from which `read_model` puts a file's weights aside, in a data file the proto refers to
(`_weights_aside`): every session and every candidate's export then maps them, where a proto holding them had to be
serialized and parsed again for each session (several times slower on a 0.5 GB decoder)."""

_ASIDE: dict[tuple, Path] = {}
"""Model files whose weights this process has put aside: (path, modification time, size) -> the aside model file."""

@functools.lru_cache(maxsize=None)
def max_ir_version() -> int:
    """The newest IR version the installed onnxruntime accepts (onnx 1.23 writes 14; onnxruntime 1.31 takes 13)."""
    try:
        import onnxruntime as ort
    except ImportError:
        return min(onnx.IR_VERSION, 10)
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", [x], [y])
    for ir in range(onnx.IR_VERSION, 6, -1):
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=ir)
        try:
            ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
            return ir
        except Exception:  # noqa: BLE001 - any refusal means "too new"
            continue
    return 7


def read_model(path: str | os.PathLike, *, external: bool = False) -> onnx.ModelProto:
    """Parses and checks an ONNX file; external data is read in, as onnx.load does, unless the weights exceed
    EXTERNAL_DATA_THRESHOLD (or `external` says so): then they stay on disk and the tensors keep references to their
    files, with absolute locations so that the proto is self-contained (sessions, verification and `save_model` find
    the weights whatever the working directory) and small whatever the weights weigh.  Inline weights from
    WEIGHTS_ASIDE_BYTES on are put aside (`_weights_aside`).

    Raises:
        InputError: as `load`.
    """
    path = Path(path)
    if not external and (aside := _ASIDE.get(_file_key(path))) is not None:
        return read_model(aside, external=True)  # read, checked and put aside before: not parsed again
    model = _parse(path)
    repaired = repair(model)
    if not external and not external_tensors(model):
        weights = sum(tensor_bytes(t) for t in _initializers(model.graph))
        if WEIGHTS_ASIDE_BYTES <= weights <= EXTERNAL_DATA_THRESHOLD:
            aside = _weights_aside(model, path)
            if aside is not None:
                return aside
            model = _parse(path)  # the failed write may have moved some of its weights out
    if repaired:
        check_model(model)  # the file itself fails the checker on what was repaired
    else:
        check_model(str(path))  # on the file: handles external data (and refuses data paths outside the model's folder)
    try:
        resolve_external_data(model, path.parent)
    except InputError as exc:
        raise InputError(f"{path}: {exc}") from None
    weights = sum(tensor_bytes(t) for t in _initializers(model.graph))
    if external or weights > EXTERNAL_DATA_THRESHOLD:
        return model
    return _with_inline_data(model)


def _parse(path: Path) -> onnx.ModelProto:
    """The file's proto, unchecked; its bytes are dropped once parsed (a 1 GB model would otherwise be held twice).

    Raises:
        InputError: the file is missing, a folder, unreadable, empty or not ONNX.
    """
    if not path.exists():
        raise InputError(f"{path}: no such file")
    if path.is_dir():
        raise InputError(f"{path}: is a directory, not an ONNX file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not data:
        raise InputError(f"{path}: empty file")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception:  # noqa: BLE001 - protobuf raises DecodeError or RuntimeWarning-like errors
        raise InputError(f"{path}: not an ONNX model (the file cannot be parsed; truncated or another format)") from None
    del data
    if not model.HasField("graph") or not model.opset_import:
        raise InputError(f"{path}: not an ONNX model (no graph or no opset)")
    return model


def _file_key(path: Path) -> tuple | None:
    """(absolute path, modification time, size) of a file: a rewritten file is another key; None where there is none."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return str(path.resolve()), stat.st_mtime_ns, stat.st_size


def _weights_aside(model: onnx.ModelProto, path: Path) -> onnx.ModelProto | None:
    """`model` (parsed from `path`, its weights inline; it is consumed) with its weights moved to a data file of this
    process's folder in rlflow's cache (on disk, where /tmp may be memory), removed when the process ends; read back
    as `read_model` reads a file with external data, which also checks it: the aside is the file's graph, and its
    small proto is checked in a fraction of the time the inline file took.  None where it cannot be written."""
    try:
        aside = save_model(model, _aside_folder() / f"{len(_ASIDE)}-{path.name}", external=True, in_place=True)
    except OSError as exc:
        log.warning("could not put %s's weights aside (%s); they are read into memory", path.name, exc)
        return None
    read = read_model(aside, external=True)
    _ASIDE[_file_key(path)] = aside
    return read


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's
        return True
    return True


@functools.lru_cache(maxsize=None)
def _aside_folder() -> Path:
    root = cache_dir("weights-aside")
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.iterdir():  # a process killed before its exit handler ran leaves its folder behind
        pid = stale.name.split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    folder = tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=root)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return Path(folder)


def save_model(model: onnx.ModelProto, path: str | os.PathLike, *, external: bool = False,
               in_place: bool = False) -> Path:
    """Writes a model atomically: a temporary file in the same folder, then a rename, so nothing is half-written.

    Models whose weights exceed EXTERNAL_DATA_THRESHOLD (or all, with `external`: a model handed to another process,
    which maps its weights rather than parse them) are written with their weights in `<name>.data` beside them (one
    tensor at a time, never as one big message); smaller ones are written as one file, external data included.
    `in_place`: the weights written to the data file are moved out of `model` itself rather than out of a copy, for a
    caller that discards it (copying a 1 GB proto cost a second gigabyte and seconds of page faults).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    weight_bytes = sum(tensor_bytes(t) for t in _initializers(model.graph))
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as tmp:
        tmp_model = Path(tmp) / path.name
        if external or weight_bytes > EXTERNAL_DATA_THRESHOLD:
            data_name = f"{path.name}.data"
            _write_with_external_data(model, tmp_model, data_name, final=path.parent / data_name, in_place=in_place)
            if (Path(tmp) / data_name).exists():  # absent when every tensor is small
                os.replace(Path(tmp) / data_name, path.parent / data_name)
        else:
            tmp_model.write_bytes(_with_inline_data(model).SerializeToString())
        os.replace(tmp_model, path)
    return path


_EXTERNAL_MIN_BYTES = 1024
"""Tensors from this size on go to the data file when a model is written with external data (onnx's default)."""

_ALIGNMENT = 4096
"""Offsets of tensors in a written data file are multiples of this, so that onnxruntime and numpy can map them."""


def _write_with_external_data(model: onnx.ModelProto, model_path: Path, data_name: str, final: Path,
                              in_place: bool = False) -> None:
    """Writes `model_path` and, beside it, its weights to `data_name`: tensor by tensor, never as one big message;
    `in_place`: `model` itself becomes the proto written (see `save_model`).

    Weights that are external data already are copied file to file (see `_copy_range`), never through memory.
    """
    final = final.resolve()
    sources = {Path(external_info(t)[0]).resolve() for t in external_tensors(model)}
    if final in sources:
        raise InputError(f"{final} holds the input's weights; write the output to another name")
    out = model if in_place else onnx.ModelProto()
    if not in_place:
        out.CopyFrom(model)  # cheap when the weights are external references (they are for models over 2 GB)
    end = 0
    with open(model_path.parent / data_name, "wb") as data:
        for tensor in _initializers(out.graph):
            offset = end + (-end % _ALIGNMENT)
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                location, start, _ = external_info(tensor)
                length = tensor_bytes(tensor)
                _copy_range(location, start, length, data, offset)
            elif len(raw := tensor.raw_data) >= _EXTERNAL_MIN_BYTES:
                data.seek(offset)
                data.write(raw)
                length = len(raw)
            else:
                continue
            end = offset + length
            set_external_data(tensor, data_name, offset, length)
        data.truncate(end)
    model_path.write_bytes(out.SerializeToString())


_COPY_CHUNK = 64 * 2**20


def _copy_range(source: str, start: int, length: int, out, at: int) -> None:
    """Copies bytes [start, start + length) of the file `source` to offset `at` of the open file `out`.

    In the kernel (copy_file_range) and skipping holes, so weights cost no memory and sparse files stay sparse; in
    chunks through memory where the system cannot (no SEEK_DATA or copy_file_range).
    """
    with open(source, "rb") as src:
        fd, stop = src.fileno(), start + length
        try:
            pos = start
            while pos < stop:
                try:
                    first = os.lseek(fd, pos, os.SEEK_DATA)
                except OSError as exc:
                    if exc.errno == errno.ENXIO:  # nothing but a hole up to the end of the file
                        break
                    raise
                if first >= stop:
                    break
                hole = min(os.lseek(fd, first, os.SEEK_HOLE), stop)
                while first < hole:
                    copied = os.copy_file_range(fd, out.fileno(), hole - first, first, at + first - start)
                    if not copied:
                        raise OSError(errno.EIO, "short copy")
                    first += copied
                pos = hole
        except (OSError, AttributeError):
            src.seek(start)
            out.seek(at)
            for done in range(0, length, _COPY_CHUNK):
                out.write(src.read(min(_COPY_CHUNK, length - done)))


def _with_inline_data(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every external-data tensor read into the proto (a copy; the model itself when there are none)."""
    if not external_tensors(model):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for tensor in external_tensors(out):
        location, offset, _ = external_info(tensor)
        with open(location, "rb") as data:
            data.seek(offset)
            raw = data.read(tensor_bytes(tensor))
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.DEFAULT
        tensor.raw_data = raw
    return out


ONNXRUNTIME_OPS_IN_ONNX_DOMAIN = frozenset({"SimplifiedLayerNormalization"})
"""onnxruntime operators that live in the default ONNX domain without being ONNX operators (onnxruntime registers
them there; in `com.microsoft` it refuses them).  The onnx checker knows no such operator, and a graph holding one runs
on onnxruntime only."""


def check_model(model: onnx.ModelProto | str) -> None:
    """The onnx checker on a model or a file path (models over 2 GB can only be checked from a path).  onnxruntime's
    operators in the default domain (`ONNXRUNTIME_OPS_IN_ONNX_DOMAIN`) are checked as the contrib operators they are."""
    try:
        if isinstance(model, str):
            try:
                onnx.checker.check_model(model)
            except onnx.checker.ValidationError:
                proto = onnx.load(model, load_external_data=False)
                if _as_contrib(proto) is proto:
                    raise
                check_model(proto)  # in memory, its weights as typed inputs and those operators as contrib
        else:
            model = _checkable(model)
            if model is not None and model.ByteSize() < 2**31 - 1:
                onnx.checker.check_model(_as_contrib(model))
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"the onnx checker rejects the model: {first}") from None
    except UnicodeDecodeError:  # the checker's own message quotes a corrupted name
        raise InputError("the onnx checker rejects the model: it holds text that is not valid UTF-8 "
                         "(a corrupted file?)") from None


def _as_contrib(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model`, or a copy with its onnxruntime operators of the default domain moved to `com.microsoft`, where the
    checker leaves their schema alone.  LayerNormalization below opset 17 is one of them (onnxruntime registers it)."""
    ort_ops = ONNXRUNTIME_OPS_IN_ONNX_DOMAIN | ({"LayerNormalization"} if ort_only_layer_norm(model) else set())
    if not any(n.op_type in ort_ops and n.domain in ("", "ai.onnx") for n in model.graph.node):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for node in out.graph.node:
        if node.op_type in ort_ops and node.domain in ("", "ai.onnx"):
            node.domain = "com.microsoft"
    if not any(o.domain == "com.microsoft" for o in out.opset_import):
        out.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return out


def _checkable(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """What the checker can take of an in-memory model: external-data weights become typed inputs, because the
    checker refuses the absolute locations rlflow gives them (it checks them from a path).  None where that cannot be
    done (external data inside a subgraph).
    """
    external = external_tensors(model)
    if not external:
        return model
    if len(external) != sum(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        return None
    out = onnx.ModelProto()
    out.CopyFrom(model)
    names = {t.name for t in external}
    listed = {vi.name for vi in out.graph.input}
    kept = [t for t in out.graph.initializer if t.name not in names]
    out.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in external
                           if t.name not in listed)
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    return out
