"""ONNX model files: reading and checking them, writing them atomically, and weights kept in external-data files
(memory-mapped, never copied: models over protobuf's 2 GB limit load, measure and save within a small multiple of their
size)."""
from __future__ import annotations

import errno
import functools
import os
import tempfile
import weakref
from pathlib import Path
from typing import Iterable

import numpy as np
import onnx
from onnx import helper

from rlflow.errors import InputError

EXTERNAL_DATA_THRESHOLD = 1_800_000_000
"""Initializer bytes above which a model's weights stay in external-data files, when loaded and when saved (protobuf
messages cannot exceed 2 GB)."""

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


def read_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Parses and checks an ONNX file; external data is read in, as onnx.load does, unless the weights exceed
    EXTERNAL_DATA_THRESHOLD: then they stay on disk and the tensors keep references to their files, with absolute
    locations so that the proto is self-contained (sessions, verification and `save_model` find the weights whatever
    the working directory) and small whatever the weights weigh.

    Raises:
        InputError: as `load`.
    """
    path = Path(path)
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
    if not model.HasField("graph") or not model.opset_import:
        raise InputError(f"{path}: not an ONNX model (no graph or no opset)")
    check_model(str(path))  # on the file: handles external data (and refuses data paths outside the model's folder)
    try:
        resolve_external_data(model, path.parent)
    except InputError as exc:
        raise InputError(f"{path}: {exc}") from None
    if sum(tensor_bytes(t) for t in _initializers(model.graph)) <= EXTERNAL_DATA_THRESHOLD:
        return _with_inline_data(model)
    return model


def save_model(model: onnx.ModelProto, path: str | os.PathLike) -> Path:
    """Writes a model atomically: a temporary file in the same folder, then a rename, so nothing is half-written.

    Models whose weights exceed EXTERNAL_DATA_THRESHOLD are written with their weights in `<name>.data` beside them
    (one tensor at a time, never as one big message); smaller ones are written as one file, external data included.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    weight_bytes = sum(tensor_bytes(t) for t in _initializers(model.graph))
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as tmp:
        tmp_model = Path(tmp) / path.name
        if weight_bytes > EXTERNAL_DATA_THRESHOLD:
            data_name = f"{path.name}.data"
            _write_with_external_data(model, tmp_model, data_name, final=path.parent / data_name)
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


def _write_with_external_data(model: onnx.ModelProto, model_path: Path, data_name: str, final: Path) -> None:
    """Writes `model_path` and, beside it, its weights to `data_name`: tensor by tensor, never as one big message.

    Weights that are external data already are copied file to file (see `_copy_range`), never through memory.
    """
    final = final.resolve()
    sources = {Path(external_info(t)[0]).resolve() for t in external_tensors(model)}
    if final in sources:
        raise InputError(f"{final} holds the input's weights; write the output to another name")
    out = onnx.ModelProto()
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


_PACKED_4BIT = {getattr(onnx.TensorProto, name) for name in ("INT4", "UINT4", "FLOAT4E2M1")
                if hasattr(onnx.TensorProto, name)}
"""Element types stored two to a byte."""


def tensor_bytes(tensor: onnx.TensorProto) -> int:
    """Bytes of a tensor's data: in the proto, or in its file (the recorded length, else computed from its shape)."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        length = external_info(tensor)[2]
        if length is not None:
            return length
    elif tensor.raw_data:
        return len(tensor.raw_data)
    count = int(np.prod(tensor.dims)) if tensor.dims else 1
    if tensor.data_type in _PACKED_4BIT:
        return (count + 1) // 2
    return count * np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize


def check_model(model: onnx.ModelProto | str) -> None:
    """The onnx checker on a model or a file path (models over 2 GB can only be checked from a path)."""
    try:
        if isinstance(model, str):
            onnx.checker.check_model(model)
        else:
            model = _checkable(model)
            if model is not None and model.ByteSize() < 2**31 - 1:
                onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"the onnx checker rejects the model: {first}") from None
    except UnicodeDecodeError:  # the checker's own message quotes a corrupted name
        raise InputError("the onnx checker rejects the model: it holds text that is not valid UTF-8 "
                         "(a corrupted file?)") from None


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


# ------------------------------------------------------------------------------- external data: weights left on disk
_MAPPED: dict[int, tuple[weakref.ref, str, int, tuple]] = {}
"""id(array) -> (weak reference to it, absolute file, byte offset, file identity) for constants mapped from a file."""

_file_maps: "weakref.WeakValueDictionary[tuple, np.memmap]" = weakref.WeakValueDictionary()


def _graphs(graph: onnx.GraphProto) -> Iterable[onnx.GraphProto]:
    """A graph and every subgraph (If, Loop and Scan bodies) inside it."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from _graphs(sub)


def _initializers(graph: onnx.GraphProto) -> list[onnx.TensorProto]:
    return [t for g in _graphs(graph) for t in g.initializer]


def external_tensors(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    """The initializers (subgraphs included) whose data lives in a file rather than in the proto."""
    return [t for t in _initializers(model.graph) if t.data_location == onnx.TensorProto.EXTERNAL]


def external_info(tensor: onnx.TensorProto) -> tuple[str, int, int | None]:
    """(location, offset, length or None) of an external-data tensor.

    Raises:
        InputError: the reference has no location or a non-integer offset or length.
    """
    info = {entry.key: entry.value for entry in tensor.external_data}
    try:
        return info["location"], int(info.get("offset", 0)), int(info["length"]) if "length" in info else None
    except (KeyError, ValueError):
        raise InputError(f"tensor '{tensor.name}' has a malformed external data reference") from None


def set_external_data(tensor: onnx.TensorProto, location: str, offset: int | None = None,
                      length: int | None = None) -> None:
    """Makes a tensor an external-data reference (its bytes in the proto, if any, are dropped)."""
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        if value is not None:
            tensor.external_data.add(key=key, value=str(value))


def resolve_external_data(model: onnx.ModelProto, base_dir: str | os.PathLike) -> None:
    """Makes every external-data location absolute and checks that its file holds the bytes, without reading them.

    Raises:
        InputError: a data file is missing, unreadable or too short.
    """
    for tensor in external_tensors(model):
        location, offset, length = external_info(tensor)
        path = os.path.abspath(os.path.join(base_dir, location))
        need = offset + tensor_bytes(tensor)
        try:
            size = os.path.getsize(path)
        except OSError as exc:
            raise InputError(f"cannot read its external data ({location}: {exc.strerror or exc})") from None
        if size < need:
            raise InputError(f"cannot read its external data ({location} holds {size} bytes; tensor "
                             f"'{tensor.name}' needs {need})")
        set_external_data(tensor, path, offset, length)


def external_array(tensor: onnx.TensorProto) -> np.ndarray:
    """The values of an external-data tensor (absolute location), memory-mapped read-only from its file.

    Pages are read on demand and shared with the OS cache and with onnxruntime's own map of the file, so weights of
    any size are loaded, hashed, measured and written without a copy in memory, and the input's data cannot change.
    Packed 4-bit and string tensors are read by onnx instead.
    """
    location, offset, length = external_info(tensor)
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
    shape = tuple(int(d) for d in tensor.dims)
    count = int(np.prod(shape)) if shape else 1
    if tensor.data_type in _PACKED_4BIT or dtype.kind in "OSU" or tensor_bytes(tensor) != count * dtype.itemsize:
        copy = onnx.TensorProto()
        copy.CopyFrom(tensor)
        set_external_data(copy, os.path.basename(location), offset, length)
        return onnx.numpy_helper.to_array(copy, base_dir=os.path.dirname(location))
    if count == 0:
        return np.zeros(shape, dtype)
    stat = os.stat(location)
    identity = (location, stat.st_ino, stat.st_mtime_ns, stat.st_size)  # a rewritten file is mapped afresh
    whole = _file_maps.get(identity)
    if whole is None:
        whole = np.memmap(location, dtype=np.uint8, mode="r")
        _file_maps[identity] = whole
    array = whole[offset: offset + count * dtype.itemsize].view(dtype).reshape(shape)
    if len(_MAPPED) > 100_000:
        for stale in [k for k, (ref, *_) in _MAPPED.items() if ref() is None]:
            del _MAPPED[stale]
    _MAPPED[id(array)] = (weakref.ref(array), location, offset, identity)
    return array


def is_mapped(values) -> bool:
    """True for constant values mapped from a file by `external_array` (their weights cost no memory of their own)."""
    entry = _MAPPED.get(id(values))
    return entry is not None and entry[0]() is values


def external_reference(name: str, values) -> onnx.TensorProto | None:
    """An external-data TensorProto pointing at the file a mapped array comes from, else None."""
    if not is_mapped(values):
        return None
    _, location, offset, _ = _MAPPED[id(values)]
    tensor = onnx.TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(values.dtype), dims=values.shape)
    set_external_data(tensor, location, offset, values.nbytes)
    return tensor




def any_mapped() -> bool:
    """Whether any constant is mapped from a file now (a graph then exports those as references, see `Graph`)."""
    return bool(_MAPPED)


def mapped_place(values) -> tuple | None:
    """(file, offset, file identity) of constant values mapped by `external_array`, else None."""
    return _MAPPED[id(values)][1:] if is_mapped(values) else None
