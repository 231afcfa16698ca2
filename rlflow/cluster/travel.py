"""What travels with a task on a cluster without a shared disk, and what comes back.

Out: a model as bytes (its external data and the zoo's JSON beside it included) and an agent checkpoint (with its
provenance JSON) go through Ray's object store (`Parcel`); a task writes them into a folder of its own.  The driver's
cost tables go too (`ship_tables`), and a node installs those of its own kind before it measures anything.

Back: a task's results, and what it added to its node's cost tables (`gains`, on the node); the driver merges
that into its own cache (`TableMerger`, by `rlflow.measure.costmodel.merge`'s rule), where the next run starts from
it and ships it again.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import onnx

from rlflow.errors import InputError, RlflowError
from rlflow.graph.external_data import external_info, external_tensors
from rlflow.measure.costmodel.merge import (
    MergeCount,
    Snapshot,
    added_since,
    merge_file,
    of_this_machine,
    read_tables,
    snapshot,
)
from rlflow.measure.costmodel.table import default_cache_dir


@dataclass
class Parcel:
    """A file and the files it needs, as bytes (paths relative to the main file's folder)."""

    name: str
    files: dict[str, bytes] = field(default_factory=dict)

    def unpack(self, folder: str | os.PathLike) -> Path:
        """Writes the files into `folder`; returns the main file's path there."""
        folder = Path(folder)
        for relative, data in self.files.items():
            path = folder / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        return folder / self.name


def _beside(path: Path, relative: str) -> Path:
    """`relative` resolved against `path`'s folder, refused when it leaves that folder (the task writes it there)."""
    if os.path.isabs(relative) or ".." in Path(relative).parts:
        raise InputError(f"{path}: external data at '{relative}' is outside the model's folder: it cannot travel")
    return path.parent / relative


def model_files(path: str | os.PathLike) -> dict[str, Path]:
    """The files a model needs, by their path relative to its folder: the model, its external data files and the
    JSON beside it (`<stem>.json`, where present)."""
    path = Path(path)
    files = _with_json(path)
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - not a model: it travels as it is, and fails to load there as it would here
        return files
    for location in sorted({external_info(t)[0] for t in external_tensors(proto)}):
        files[location] = _beside(path, location)
    return files


def _with_json(path: Path) -> dict[str, Path]:
    files = {path.name: path}
    sidecar = path.with_suffix(".json")
    if sidecar != path and sidecar.is_file():
        files[sidecar.name] = sidecar
    return files


def _packed(name: str, files: dict[str, Path]) -> Parcel:
    return Parcel(name, {relative: file.read_bytes() for relative, file in files.items()})


def pack_model(path: str | os.PathLike) -> Parcel:
    """The model at `path` with every file it needs (`model_files`), as bytes."""
    return _packed(Path(path).name, model_files(path))


def pack_file(path: str | os.PathLike) -> Parcel:
    """The file at `path` and the JSON beside it (`<stem>.json`: a zoo model's or a checkpoint's provenance)."""
    return _packed(Path(path).name, _with_json(Path(path)))


def travel_size(path: str | os.PathLike, model: bool = True) -> int:
    """Bytes `pack_model` (or, with `model` False, `pack_file`) would carry, read from the file sizes alone."""
    files = model_files(path) if model else _with_json(Path(path))
    return sum(file.stat().st_size for file in files.values())


def store_capacity(ray) -> int | None:
    """Bytes of the object store on the driver's node (where `ray.put` places objects), or None when unknown."""
    here = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == here:
            return int(node.get("Resources", {}).get("object_store_memory", 0)) or None
    return None


def check_fits(sizes: dict[str, int], capacity: int | None) -> None:
    """Refuses, before anything is submitted, a file (name -> bytes with what travels with it) larger than the
    object store.

    Raises:
        RlflowError: naming the file, its size and the limit.
    """
    if capacity is None:
        return
    for name, size in sizes.items():
        if size > capacity:
            raise RlflowError(f"{name}: {size / 2**20:.0f} MiB with its data does not fit Ray's object store "
                              f"({capacity / 2**20:.0f} MiB on this node): start the cluster with a larger "
                              f"--object-store-memory, or pass --shared-path if every node reads the models' paths")


# ------------------------------------------------------------------------------------------------- cost tables
ShippedTables = dict
"""Table file name -> (its key, an object reference to the table): the driver's tables, put once per run."""


def ship_tables(ray, cache_dir: str | os.PathLike | None = None) -> ShippedTables:
    """Every cost table of the driver's cache, put into the object store (a node fetches only its own kind's)."""
    tables = read_tables(cache_dir or default_cache_dir())
    return {name: (table["key"], ray.put(table)) for name, table in tables.items()}


def install_tables(ray, shipped: ShippedTables, cache_dir: str | os.PathLike | None = None) -> int:
    """On a node: merges the shipped tables of this node's kind into its cache (before any cost model here reads
    it); returns the measurements the node did not have."""
    installed = MergeCount()
    for name, (key, ref) in shipped.items():
        if of_this_machine(key):
            installed += merge_file(cache_dir or default_cache_dir(), name, ray.get(ref))
    return installed.added


@contextlib.contextmanager
def gains(cache_dir: str | os.PathLike | None = None) -> Iterator[dict]:
    """On a node: yields a dict that holds, once the block is done, `added` (table file name -> the entries the
    block's measurements added to this node's cache)."""
    from rlflow.measure.costmodel.table import live

    cache_dir = Path(cache_dir or default_cache_dir())
    before = snapshot(cache_dir)
    outcome: dict = {}
    yield outcome
    for model in list(live):  # what the task measured, on disk before it is read back
        model.save()
    outcome["added"] = added_since(cache_dir, before)


@contextlib.contextmanager
def tables_home(ray, shipped: ShippedTables, cache_dir: str | os.PathLike | None = None) -> Iterator[dict]:
    """On a node, around one task: `install_tables`, then `gains`; the dict also holds `installed`."""
    installed = install_tables(ray, shipped, cache_dir)
    with gains(cache_dir) as outcome:
        outcome["installed"] = installed
        yield outcome


class TableMerger:
    """On the driver: merges what the tasks' nodes added into the driver's cache, and counts per node.

    Per node: `installed`, measurements a node took from the driver's tables; `added`, new ones it brought back;
    `known_before`, those it took of a group the driver's tables held when the run began (zero when shipping works:
    the node had the group); `measured_twice`, those another node had brought back in this run."""

    def __init__(self, cache_dir: str | os.PathLike | None = None):
        self.cache_dir = Path(cache_dir or default_cache_dir())
        self.before: Snapshot = snapshot(self.cache_dir)
        self.merged: dict[str, set] = {}  # file name -> measurements merged in this run
        self.per_node: dict[str, dict[str, int]] = {}

    def merge(self, node: str, home: dict) -> dict[str, int]:
        """Merges one task's gain (`tables_home`'s outcome); returns its counts (the driver's cache may be the node's
        own, on a cluster started here, so the counts come from the run's record, not from what the file held)."""
        counts = {"installed": home.get("installed", 0), "added": 0, "known_before": 0, "measured_twice": 0}
        for name, gain in home.get("added", {}).items():
            known = self.before.get(name, {}).get("costs", frozenset())
            merged = self.merged.setdefault(name, set())
            for k in gain.get("costs", {}):
                kind = "known_before" if k in known else "measured_twice" if k in merged else "added"
                counts[kind] += 1
                merged.add(k)
            merge_file(self.cache_dir, name, gain)
        totals = self.per_node.setdefault(node, dict.fromkeys(("tasks", *counts), 0))
        totals["tasks"] += 1
        for key, value in counts.items():
            totals[key] += value
        return counts

    def summary(self) -> dict:
        """What results files record: totals and per node."""
        totals = {key: sum(n[key] for n in self.per_node.values())
                  for key in ("added", "known_before", "measured_twice")}
        return {"cache": str(self.cache_dir), **totals, "per_node": self.per_node}


__all__ = ["Parcel", "ShippedTables", "TableMerger", "check_fits", "gains", "install_tables", "model_files", "pack_file",
           "pack_model", "ship_tables", "store_capacity", "tables_home", "travel_size"]
