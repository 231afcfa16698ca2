"""The `rlflow` command: thin wrappers that parse options, call the library and print.

The command layer is the one place that reads a command line: the library's modules expose functions, and each
subcommand here parses its options and calls one.  The group and the entry point live here (`main`, the console
script; `python -m rlflow.cli` runs it too, from `__main__.py`), the subcommands in the modules beside it by concern.
Problems the user can act on print one line on stderr and exit 2; `--debug` (anywhere on the line) shows tracebacks.
"""
from __future__ import annotations

import logging
import sys

import click

from rlflow.cli import bench, cluster, costmodel, optimize, train, zoo
from rlflow.errors import RlflowError

EXIT_BAD_INPUT = 2


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="rlflow")
def cli() -> None:
    """Make ONNX models faster with verified graph rewrites."""


for _command in (optimize.optimize, optimize.rules, bench.bench, bench.bench_precision, bench.bench_estimate,
                 bench.bench_builder, bench.bench_rules, bench.wallclock, train.train, train.evaluate, train.ship,
                 zoo.zoo, costmodel.costmodel, cluster.simulate_cluster):
    cli.add_command(_command)


def _interrupted() -> int:
    """Ctrl-C: one line and exit 130.  Further presses are ignored from here on: exiting still saves the cost table
    (atexit), and a second press during that used to end the process by the signal instead (exit -2)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    click.echo("interrupted; nothing was written", err=True)
    return 130


def main(argv: list[str] | None = None) -> int:
    """Entry point: runs the click group and turns errors into one line and an exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format="%(levelname)s: %(message)s",
                        stream=sys.stderr)
    logging.getLogger("rlflow").setLevel(logging.DEBUG if debug else logging.INFO)
    for noisy in ("onnx_graphsurgeon", "onnxscript", "torch"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        # without standalone mode click returns a command's `Exit(code)` instead of raising it
        code = cli.main(args=argv, prog_name="rlflow", standalone_mode=False, obj={"argv": argv})
        return code if type(code) is int else 0
    except click.exceptions.Abort:
        return _interrupted()
    except click.exceptions.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except RlflowError as exc:
        if debug:
            raise
        click.echo(f"error: {exc}", err=True)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return _interrupted()
    except Exception as exc:  # noqa: BLE001 - no traceback without --debug
        if debug:
            raise
        click.echo(f"error: internal error ({type(exc).__name__}: {exc}); run again with --debug for details", err=True)
        return 1
