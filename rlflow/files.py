"""Atomic file writes: a temporary file in the same folder, then a rename, so no reader sees half a file."""
from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Writes `text` to `path` atomically, creating the folder if needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def cache_dir(part: str) -> Path:
    """rlflow's cache folder for `part`: ``$RLFLOW_CACHE/<part>`` when RLFLOW_CACHE is set, else ``~/.cache/rlflow/<part>``."""
    root = os.environ.get("RLFLOW_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "rlflow") / part
