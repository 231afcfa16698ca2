"""What the command modules share: the command line as typed, which the commands that write results record."""
from __future__ import annotations

import shlex
import sys

import click


def invocation() -> str:
    """The command line as typed (`rlflow costmodel audit m.onnx --out x`), without `--debug`: `rlflow.cli.main`
    keeps its arguments in the root context's `obj`; where the group was invoked otherwise, the process's own."""
    obj = click.get_current_context().find_root().obj
    argv = obj.get("argv") if isinstance(obj, dict) else None
    return shlex.join(["rlflow", *(sys.argv[1:] if argv is None else argv)])
