"""The cost model's table on disk: one JSON file per machine kind (provider, session settings, CPU and GPU model,
onnxruntime version), so a table is only ever read where its measurements hold; saved atomically and merged with
what another process wrote meanwhile, at exit too; and the tables shipped with rlflow (`TABLES`), from which a
machine of a kind the project has measured starts instead of an empty table."""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import platform
import tempfile
import weakref
from pathlib import Path

from rlflow.measure.costmodel.size_estimate import TABLES

CACHE_VERSION = 4
"""Bump when what a table entry means changes (grouping, measurement procedure): old tables are then ignored.
The constants and `Gauge` named below are `rlflow.measure.costmodel.group_timing`'s.

2: the per-call overhead is timed alongside each group (version 1 timed it once per input/output count and cached
it; one such entry timed 84 us against a true 48 us and floored 39% of a table's groups).
3: each entry is the fastest over `SESSION_PAIRS` freshly built session pairs (version 2 used one: a Reshape of
4 KB stayed at 32.6 us against 0.8-1.7 us re-measured, and made one attention-unfuse on vit-b-16-tiny cost 55% of
the model's estimate where end-to-end measurement puts the two graphs within a few percent of each other).
4: a group faster than `REPLICA_TARGET_S` is timed as up to `MAX_REPLICAS` copies in one model, and each entry is the
median over three session pairs (version 3 timed one copy, whose few microseconds were the size of the noise of the
per-call overhead subtracted from them: on nasrnn-tiny a Gemm+Tanh+Add+Sigmoid+Add+Tanh+Mul+Tanh group was cached
at 33.1 us against 2.6-13.3 us measured again, a phantom reward of -36.6% for one rewrite and +37.6% for the next.
Four one-copy measurements of a group spread by 2.7-3.3 us (median over 30
groups), replicated ones by 0.4-0.7 us); and each difference is scaled by the machine's slowdown at the time it was
taken, read from a reference model timed beside it (`Gauge`: in stretches when everything ran 1.6-2x slower, a
group's difference doubled while its ratio to the probe held)."""


def machine_id() -> str:
    """CPU model name and core count (plus the GPU name where one is visible): what a cost table is valid on."""
    name = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine()
    text = f"{name} x{os.cpu_count()}"
    gpus = sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")) if Path("/proc/driver/nvidia/gpus").exists() else []
    for info in gpus[:1]:
        try:
            model = next(line.split(":", 1)[1].strip() for line in info.read_text().splitlines() if line.startswith("Model"))
            text += f" + {model}"
        except (OSError, StopIteration):
            pass
    return text


def table_file_name(key: dict) -> str:
    """The file a table of machine kind `key` is kept in: the same name in every cache, on every machine."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return f"costmodel-{digest}.json"


def default_cache_dir() -> Path:
    """``$RLFLOW_CACHE/costmodel`` when RLFLOW_CACHE is set, else ``~/.cache/rlflow/costmodel``."""
    from rlflow.files import cache_dir

    return cache_dir("costmodel")


class TableStorage:
    """Loading and saving `CostModel`'s table (a mixin: the model sets `key`, `path`, `cache_dir`, `_table`, `_new`
    and `_lock`)."""

    def save(self) -> None:
        """Writes the table atomically, merged with whatever another process wrote to the same file meanwhile."""
        with self._lock:
            if self._table is None or not self._new:
                return
            on_disk = self._read()
            for section in SECTIONS:
                on_disk[section].update(self._table[section])
            write_table(self.path, on_disk)
            self._table = on_disk
            self._new = 0

    def __del__(self) -> None:
        try:
            self.save()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    def __len__(self) -> int:
        """Number of measured configurations in the table."""
        return len(self.table["costs"])

    @property
    def table(self) -> dict:
        """The table, loaded from disk on first use."""
        if self._table is None:
            with self._lock:
                if self._table is None:
                    self._table = self._read()
        return self._table

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            data = shipped_table(self.key) or empty_table(self.key)
        if data.get("key") != self.key:
            return empty_table(self.key)
        for section in SECTIONS:
            data.setdefault(section, {})
        return data


SECTIONS = ("groups", "costs", "ops")
"""A table's parts: group key -> canonical key, canonical key -> cost (ms; the measurements), canonical key -> ops."""


def empty_table(key: dict) -> dict:
    return {"key": key, **{section: {} for section in SECTIONS}}


def write_table(path: Path, table: dict) -> None:
    """Writes `table` to `path` atomically (a uniquely named temporary file beside it, so writers never collide)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=0, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def shipped_table(key: dict) -> dict | None:
    """A table shipped in `TABLES` measured under exactly `key` (machine, onnxruntime, provider, settings), or None.

    TASO measures each configuration once per device; a machine of a kind the project has measured (the GPU kit's H100)
    then starts from that table instead of an empty one, and searches spend their time on configurations it lacks.
    """
    for path in sorted(TABLES.glob("*.json")):
        if path.name.endswith(".estimate.json"):
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if data.get("key") == key:
            return data
    return None


live: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _save_all() -> None:
    for model in list(live):
        try:
            model.save()
        except Exception:  # noqa: BLE001 - never fail interpreter exit
            pass
