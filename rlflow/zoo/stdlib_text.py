"""The trained section's data (`rlflow.zoo.trained`): the running Python's standard library as bytes, split into
training and held-out files by a hash of each file's relative path, and the held-out loss of any model's logits.

The text is every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` outside ``site-packages`` and the
``test``/``tests``/``idle_test`` folders: on every machine, offline, without a tokenizer (vocabulary 256).  The split
hashes the path rather than counting files, so a file added by another Python version moves no other file.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
from pathlib import Path

SEQUENCE = 128
HELDOUT_SAMPLES = 64
HELDOUT_ONE_IN = 20
SPLIT_RULE = (f"stdlib .py files outside site-packages/test/tests/idle_test, sorted by relative path; held out when "
              f"int(sha256(relative posix path)[:8], 16) % {HELDOUT_ONE_IN} == 0")
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_files(root=None) -> list[tuple[str, Path]]:
    """(relative posix path, path) of the stdlib's ``.py`` files, sorted by relative path."""
    import sysconfig

    root = Path(root or sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for name in filenames:
            path = Path(dirpath) / name
            if name.endswith(".py") and path.is_file():
                found.append((path.relative_to(root).as_posix(), path))
    return sorted(found)


def is_heldout(relative: str) -> bool:
    """Whether a file (by its relative posix path) is held out: a hash of the path, not its place in any list."""
    return int(hashlib.sha256(relative.encode()).hexdigest()[:8], 16) % HELDOUT_ONE_IN == 0


def split(root=None) -> tuple[list[str], list[str]]:
    """(training, held-out) relative paths of the stdlib's files."""
    files = [rel for rel, _ in stdlib_files(root)]
    return [f for f in files if not is_heldout(f)], [f for f in files if is_heldout(f)]


@functools.lru_cache(maxsize=2)
def corpora(root=None) -> tuple:
    """(training bytes, held-out bytes) as uint8 arrays: each part's files concatenated in sorted order."""
    import numpy as np

    parts = {False: [], True: []}
    for rel, path in stdlib_files(root):
        parts[is_heldout(rel)].append(path.read_bytes())
    return tuple(np.frombuffer(b"".join(parts[held]), dtype=np.uint8) for held in (False, True))


def windows(data, samples: int = HELDOUT_SAMPLES, length: int = SEQUENCE):
    """int64 (samples, length): `samples` windows evenly spaced over `data`, first and last included."""
    import numpy as np

    starts = np.linspace(0, len(data) - length, samples).astype(np.int64)
    return data[starts[:, None] + np.arange(length)].astype(np.int64)


def heldout_loss(logits, input_ids) -> float:
    """Mean next-token cross-entropy in nats of `logits` (samples, sequence, vocabulary) on `input_ids` (samples,
    sequence): position t predicts token t + 1.  numpy only, so any runtime's outputs can be scored."""
    import numpy as np

    logits = np.asarray(logits, dtype=np.float64)[:, :-1]
    targets = np.asarray(input_ids)[:, 1:]
    peak = logits.max(axis=-1, keepdims=True)
    log_norm = np.log(np.exp(logits - peak).sum(axis=-1)) + peak[..., 0]
    picked = np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return float((log_norm - picked).mean())


def npz_bytes(arrays: dict) -> bytes:
    """An ``.npz`` of `arrays`, byte-identical from run to run (fixed zip timestamps, no compression)."""
    import zipfile

    import numpy as np

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for name, array in arrays.items():
            with archive.open(zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0)), "w",
                              force_zip64=True) as member:
                np.lib.format.write_array(member, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()
