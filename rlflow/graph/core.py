"""The graph layer: load ONNX models as found in the wild, edit them through onnx-graphsurgeon, save them safely.

A `Graph` wraps an editable onnx-graphsurgeon graph in which every tensor has a static shape: dynamic input dimensions
are fixed for measurement (from `input_shapes`, else the deployed shapes the model's metadata gives, else 1 with a
warning).  It also remembers the model's original
interface (input and output names, element types, dynamic dimensions) so that a written model keeps it.

Parts live beside it: the input shapes a model is measured at (`rlflow.graph.input_shapes`), shape inference
(`rlflow.graph.shape_inference`), the structural hash that tells graphs apart (`rlflow.graph.fingerprint`) and quicker versions of
onnx-graphsurgeon's copy and sort (`rlflow.graph.copy_and_sort`).
"""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper
from onnx_graphsurgeon.ir.tensor import LazyValues

from rlflow.errors import InputError
from rlflow.graph import shape_inference as _shapes
from rlflow.graph.copy_and_sort import copy_graph, toposort
from rlflow.graph.editing import Editing
from rlflow.graph.external_data import any_mapped, external_array, external_reference, resolve_external_data
from rlflow.graph.fingerprint import fingerprint as _fingerprint
from rlflow.graph.input_repairs import REPAIRS_KEY, convert_opset, parse_repairs, repair
from rlflow.graph.input_shapes import deployed_shapes, fix_input_dims
from rlflow.graph.model_file import check_model, max_ir_version, read_model, save_model

log = logging.getLogger("rlflow")


def load(path: str | os.PathLike, input_shapes: Mapping[str, Sequence[int]] | None = None) -> "Graph":
    """Loads an ONNX model file (external data included) as a Graph with static shapes.

    The weights of models over EXTERNAL_DATA_THRESHOLD stay in their external-data files, memory-mapped (see
    `external_array`), so models over protobuf's 2 GB limit load without a copy of their weights.

    Raises:
        InputError: the file is missing, unreadable, empty, not ONNX, or the onnx checker rejects the model.
    """
    return Graph.from_model(read_model(path), input_shapes, source=str(path), checked=True)


class Graph(Editing):
    """An ONNX model being rewritten: an onnx-graphsurgeon graph with static shapes plus the model's interface.

    Rules edit `self.gs` through the helpers below; `rlflow.rewrites.apply` clones first, so a Graph handed to a user is
    never modified by a rewrite.
    """

    def __init__(self, gs_graph: gs.Graph, *, interface: tuple[list, list], input_shapes: dict[str, tuple[int, ...]],
                 model_info: dict, source: str | None = None):
        self.gs = gs_graph
        self.interface = interface
        self.input_shapes = input_shapes
        self.profiles: tuple = ()  # rlflow.measure.shape_profiles.Profile, when measured at several shapes (see measure.profiled)
        self.model_info = model_info
        self.source = source
        # facts by tensor name that hold for the graph's clones and rewrites too: entry -> (stamp, {tensor name: fact})
        self.lineage_cache: dict[str, tuple[object, Mapping[str, object] | None]] = {}

    # ----------------------------------------------------------------------------------------------- construction
    @classmethod
    def from_model(cls, model: onnx.ModelProto, input_shapes: Mapping[str, Sequence[int]] | None = None,
                   source: str | None = None, checked: bool = False) -> "Graph":
        """Builds a Graph from an in-memory model (which is not modified); `checked`: the checker already passed."""
        work = onnx.ModelProto()
        work.CopyFrom(model)  # small even for huge models: external data stays on disk (see read_model)
        resolve_external_data(work, os.path.dirname(source) if source else os.getcwd())
        if not checked:
            repair(work)
            check_model(work)
        work = _converted(work)
        initializer_names = {t.name for t in work.graph.initializer}
        real_inputs = [vi for vi in work.graph.input if vi.name not in initializer_names]
        interface = ([_copy(vi) for vi in real_inputs], [_copy(vi) for vi in work.graph.output])
        fixed = fix_input_dims(real_inputs, {**deployed_shapes(work, real_inputs), **dict(input_shapes or {})})
        # IR < 4 lists initializers as inputs; they are weights, not part of the interface.
        kept = [vi for vi in work.graph.input if vi.name not in initializer_names]
        del work.graph.input[:]
        work.graph.input.extend(kept)
        del work.graph.value_info[:]
        info = {
            "ir_version": work.ir_version,
            "opset_import": [(o.domain, o.version) for o in work.opset_import],
            "producer_name": work.producer_name,
            "producer_version": work.producer_version,
            "doc_string": work.doc_string,
            "metadata_props": [(p.key, p.value) for p in work.metadata_props],
            "functions": [_copy(f) for f in work.functions],
        }
        graph = cls(gs.import_onnx(work), interface=interface, input_shapes=fixed, model_info=info, source=source)
        graph._map_external_constants()
        graph._name_nodes()
        graph._lower_constant_nodes()
        toposort(graph.gs.cleanup(remove_unused_graph_inputs=False))
        graph.infer_shapes()
        return graph

    def clone(self) -> "Graph":
        """A deep copy of the structure; constant arrays are shared (rules never edit arrays in place).

        `lineage_cache` is carried over (its entries are replaced, never edited): its facts are keyed by tensor name,
        and a name keeps its value along the lineage, since a rewrite keeps the value of every tensor it keeps the name
        of and `fresh_name` never hands out a name a fact is held for (`rlflow.graph.dynamic_axes.dynamic_axes`)."""
        copy = Graph(copy_graph(self.gs), interface=self.interface, input_shapes=dict(self.input_shapes),
                     model_info=self.model_info, source=self.source)
        copy.profiles = self.profiles
        copy.lineage_cache = dict(self.lineage_cache)
        return copy

    def _subgraphs(self) -> list[gs.Graph]:
        """The graph and every subgraph (If, Loop and Scan bodies) inside it."""
        return [self.gs, *self.gs.subgraphs(recursive=True)]

    def _map_external_constants(self) -> None:
        """Backs every constant stored as external data with a read-only map of its file (see `external_array`)."""
        for graph in self._subgraphs():
            for tensor in graph.tensors().values():
                if isinstance(tensor, gs.Constant) and tensor.data_location == onnx.TensorProto.EXTERNAL:
                    # gs imports every initializer as LazyValues around its TensorProto; reading it would copy the data.
                    tensor.values = external_array(tensor._values.tensor)
                    tensor.data_location = None

    @contextmanager
    def _weights_as_references(self):
        """Within the `with`, constants mapped from a file are external-data references instead of bytes, for export.

        The exported proto then stays small whatever the weights weigh (onnx's C++ tools and onnxruntime refuse protos
        over 2 GB) and holds no copy of them.  They are swapped in place and put back after: a copy of the graph to
        swap them in was half of each export's time on a 3,646-node decoder step (0.5 s of 1.0 s).
        """
        swapped = []
        if any_mapped():
            for graph in self._subgraphs():
                for tensor in graph.tensors().values():
                    # a subgraph lists the outer constants it reads: swapped once
                    if isinstance(tensor, gs.Constant) and not isinstance(tensor._values, LazyValues):
                        reference = external_reference(tensor.name, tensor.values)
                        if reference is not None and _exports_as_is(tensor):
                            swapped.append((tensor, tensor.values))
                            tensor.values = LazyValues(reference)  # gs exports a LazyValues' TensorProto as it is
        try:
            yield
        finally:
            for tensor, values in swapped:
                tensor.values = values

    def _name_nodes(self) -> None:
        """Gives every node a unique name: matches refer to nodes by name."""
        seen: set[str] = set()
        for i, node in enumerate(self.gs.nodes):
            name = node.name or f"{node.op}_{i}"
            while name in seen:
                name = f"{name}_{i}"
            node.name = name
            seen.add(name)

    def _lower_constant_nodes(self) -> None:
        """Turns Constant nodes into constant tensors, so rules see weights one way whatever the exporter did."""
        for node in list(self.gs.nodes):
            if node.op != "Constant" or node.domain not in (None, "", "ai.onnx") or len(node.attrs) != 1:
                continue
            (key, value), = node.attrs.items()
            if key == "value" and isinstance(value, gs.Constant):
                array = value.values
            elif key in ("value_float", "value_int"):
                array = np.array(value, dtype=np.float32 if key == "value_float" else np.int64)
            elif key in ("value_floats", "value_ints"):
                array = np.array(value, dtype=np.float32 if key == "value_floats" else np.int64)
            else:
                continue
            out = node.outputs[0]
            node.outputs.clear()
            out.to_constant(np.asarray(array))

    # ------------------------------------------------------------------------------------------------- shapes
    def infer_shapes(self) -> None:
        """Refreshes the shape and element type of every tensor at the fixed input shapes (`rlflow.graph.shape_inference`)."""
        _shapes.infer_shapes(self)

    def shape(self, tensor: gs.Tensor) -> tuple[int, ...] | None:
        """The static shape of a tensor, or None where inference could not tell."""
        shape = tensor.shape
        if shape is None or any(not isinstance(d, (int, np.integer)) for d in shape):
            return None
        return tuple(int(d) for d in shape)

    # ------------------------------------------------------------------------------------------------- export
    def opset_imports(self) -> list[onnx.OperatorSetIdProto]:
        """The model's opset imports, com.microsoft added where a rule emitted a contrib operator."""
        versions = dict(self.model_info["opset_import"])
        for node in self.gs.nodes:  # rules may emit contrib operators
            if node.domain == "com.microsoft":
                versions.setdefault("com.microsoft", 1)
        return [helper.make_opsetid(domain, version) for domain, version in versions.items()]

    @property
    def input_repairs(self) -> list[str]:
        """What rlflow repaired or converted on the way from the model to this graph (`rlflow.graph.input_repairs`)."""
        return parse_repairs(dict(self.model_info["metadata_props"]).get(REPAIRS_KEY, ""))

    @property
    def opset(self) -> int:
        """The default-domain opset version."""
        return dict(self.model_info["opset_import"]).get("", dict(self.model_info["opset_import"]).get("ai.onnx", 0))

    def to_model(self, *, static: bool = True) -> onnx.ModelProto:
        """Exports an onnx model.

        Args:
            static: True gives the measurement model (inputs fixed to `input_shapes`, every shape recorded); False gives
                the model to write, whose inputs and outputs are the original interface with dynamic dimensions.
        """
        with self._weights_as_references():
            model = gs.export_onnx(self.gs, do_type_check=False)
        info = self.model_info
        del model.opset_import[:]
        model.opset_import.extend(self.opset_imports())
        model.ir_version = max_ir_version()
        model.producer_name = info["producer_name"] or "rlflow"
        model.producer_version = info["producer_version"]
        model.doc_string = info["doc_string"]
        for key, value in info["metadata_props"]:
            model.metadata_props.add(key=key, value=value)
        model.functions.extend(info["functions"])
        if not static:
            inputs, outputs = self.interface
            extra = [vi for vi in model.graph.input if vi.name not in {i.name for i in inputs}]
            del model.graph.input[:]
            model.graph.input.extend([_copy(vi) for vi in inputs] + extra)
            del model.graph.output[:]
            model.graph.output.extend(_copy(vi) for vi in outputs)
            del model.graph.value_info[:]
        return model

    def save(self, path: str | os.PathLike, *, static: bool = False) -> Path:
        """Writes the model atomically (temporary file, then rename); see `save_model`."""
        return save_model(self.to_model(static=static), path)

    def check(self) -> None:
        """Raises InputError unless the onnx checker accepts the model (whether onnxruntime runs it is for
        `rlflow.measure`, which imports this module: a graph never imports measurement)."""
        check_model(self.to_model(static=True))

    # ----------------------------------------------------------------------------------------------- identity
    def fingerprint(self) -> str:
        """A structural hash: equal for graphs that differ only in node and tensor names (or commutative operand order;
        `rlflow.graph.fingerprint`)."""
        return _fingerprint(self)

    # ------------------------------------------------------------------------------------------------- summary
    def op_counts(self) -> dict[str, int]:
        """Number of nodes per operator type."""
        counts: dict[str, int] = {}
        for node in self.gs.nodes:
            counts[node.op] = counts.get(node.op, 0) + 1
        return dict(sorted(counts.items()))

    def __len__(self) -> int:
        return len(self.gs.nodes)

    def __repr__(self) -> str:
        return f"Graph({self.source or 'in-memory'}, {len(self)} nodes, opset {self.opset})"


# ----------------------------------------------------------------------------------------------------- helpers
def _exports_as_is(tensor: gs.Constant) -> bool:
    """Whether gs would export a constant with its values' own element type (not a requested export type)."""
    export = tensor.export_dtype
    try:
        return not isinstance(export, int) and np.dtype(export) == tensor.values.dtype
    except TypeError:
        return False


def _converted(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` at the opset rules expect (`convert_opset`), or as it is where the conversion does not pass the checker."""
    converted = convert_opset(model)
    if converted is model:
        return model
    try:
        check_model(converted)
    except InputError as exc:
        log.warning("opset conversion kept back: the converted model fails the checker (%s)", exc)
        return model
    return converted


def _copy(proto):
    clone = type(proto)()
    clone.CopyFrom(proto)
    return clone
