"""Weights left on disk: ONNX tensors whose data lives in an external file, read by memory-mapping that file, never
copied, so that models over protobuf's 2 GB limit load, measure and save within a small multiple of their size; and
which arrays came from such a mapping, so that a save or a fingerprint can refer to the file instead of the bytes."""
from __future__ import annotations

import os
import weakref
from typing import Iterable

import numpy as np
import onnx
from onnx import helper

from rlflow.errors import InputError

_PACKED_4BIT = {getattr(onnx.TensorProto, name) for name in ("INT4", "UINT4", "FLOAT4E2M1")
                if hasattr(onnx.TensorProto, name)}
"""Element types stored two to a byte."""


def tensor_bytes(tensor: onnx.TensorProto) -> int:
    """Bytes of a tensor's data: in the proto, or in its file (the recorded length, else computed from its shape).

    In-proto raw data is sized from the shape too: reading `raw_data` copies it (a gigabyte of page faults for a 1 GB
    model's weights)."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        length = external_info(tensor)[2]
        if length is not None:
            return length
    count = int(np.prod(tensor.dims)) if tensor.dims else 1
    if tensor.data_type in _PACKED_4BIT:
        return (count + 1) // 2
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
    if dtype.kind in "OSU":  # strings: no fixed size
        return len(tensor.raw_data) if tensor.HasField("raw_data") else sum(len(s) for s in tensor.string_data)
    return count * dtype.itemsize


_MAPPED: dict[int, tuple[weakref.ref, str, int, tuple]] = {}
"""id(array) -> (weak reference to it, absolute file, byte offset, file identity) for constants mapped from a file."""

_file_maps: "weakref.WeakValueDictionary[tuple, np.memmap]" = weakref.WeakValueDictionary()


def graphs_within(graph: onnx.GraphProto) -> Iterable[onnx.GraphProto]:
    """A graph and every subgraph (If, Loop and Scan bodies) inside it."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from graphs_within(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from graphs_within(sub)


def _initializers(graph: onnx.GraphProto) -> list[onnx.TensorProto]:
    return [t for g in graphs_within(graph) for t in g.initializer]


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
