"""Cost tables that travel between machines of one kind (`rlflow bench --ray`, `rlflow train --ray`): the tables a
cache holds, what a table gained while a task ran, and merging that gain into another copy of the same kind's table.

The merge keeps one measurement per group: an entry the table already holds is kept, a group it lacks is added, and
where two nodes of one kind measured the same group in one run, the first to come back is kept.  Every entry of a
table is then one measurement taken by the same procedure (`CACHE_VERSION`'s median over session pairs, scaled by
the gauge), as on one machine.  Averaging two nodes' entries would give some groups another estimator than the rest,
and keeping the smaller would favour whichever measurement caught a quiet moment; rewards compare groups with each
other, so a table must not mix estimators.

Kinds are told apart by the table's key (machine, onnxruntime, provider, settings, `CACHE_VERSION`), which names its
file (`table_file_name`): the same kind has the same file name in every cache.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from rlflow.measure.costmodel.table import CACHE_VERSION, SECTIONS, empty_table, machine_id, write_table

Snapshot = dict[str, dict[str, frozenset]]
"""Table file name -> section -> the keys it held."""


@dataclass
class MergeCount:
    """Measurements (`costs` entries) a merge added, and those it dropped because the table already had them."""

    added: int = 0
    measured_again: int = 0

    def __iadd__(self, other: "MergeCount") -> "MergeCount":
        self.added += other.added
        self.measured_again += other.measured_again
        return self


def read_tables(cache_dir: str | os.PathLike) -> dict[str, dict]:
    """File name -> table for every cost table in `cache_dir` (unreadable files skipped)."""
    tables = {}
    for path in sorted(Path(cache_dir).glob("costmodel-*.json")):
        try:
            table = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(table, dict) and isinstance(table.get("key"), dict):
            tables[path.name] = table
    return tables


def of_this_machine(key: dict) -> bool:
    """Whether a table of kind `key` holds here: same machine, onnxruntime and table version."""
    import onnxruntime as ort

    return (key.get("machine") == machine_id() and key.get("onnxruntime") == ort.__version__
            and key.get("version") == CACHE_VERSION)


def snapshot(cache_dir: str | os.PathLike) -> Snapshot:
    """The keys each table in `cache_dir` holds now."""
    return {name: {section: frozenset(table.get(section, {})) for section in SECTIONS}
            for name, table in read_tables(cache_dir).items()}


def added_since(cache_dir: str | os.PathLike, before: Snapshot) -> dict[str, dict]:
    """File name -> {"key", and per section the entries added} for every table of `cache_dir` that gained
    measurements since `before`."""
    gained = {}
    for name, table in read_tables(cache_dir).items():
        known = before.get(name, {})
        added = {section: {k: v for k, v in table.get(section, {}).items() if k not in known.get(section, ())}
                 for section in SECTIONS}
        if any(added.values()):
            gained[name] = {"key": table["key"], **added}
    return gained


def merge_into(table: dict, added: dict) -> MergeCount:
    """Adds to `table` (in place) the entries of `added` it lacks; existing entries are kept (the module's rule)."""
    count = MergeCount()
    for section in SECTIONS:
        target = table.setdefault(section, {})
        for k, v in added.get(section, {}).items():
            if k in target:
                count.measured_again += section == "costs"
            else:
                target[k] = v
                count.added += section == "costs"
    return count


def merge_file(cache_dir: str | os.PathLike, name: str, added: dict) -> MergeCount:
    """Merges `added` (a table's gain, or a whole table) into the file `name` of `cache_dir`, creating it."""
    path = Path(cache_dir) / name
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = empty_table(added["key"])
    if table.get("key") != added["key"]:  # a file of another version under this name: the newer key starts over
        table = empty_table(added["key"])
    size = sum(len(table.get(section, {})) for section in SECTIONS)
    count = merge_into(table, added)
    if sum(len(table[section]) for section in SECTIONS) > size or not path.exists():
        write_table(path, table)
    return count


__all__ = ["MergeCount", "Snapshot", "added_since", "merge_file", "merge_into", "of_this_machine", "read_tables",
           "snapshot"]
