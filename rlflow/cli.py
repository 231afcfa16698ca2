"""The `rlflow` command: thin wrappers that parse options, call the library and print.

Problems the user can act on print one line on stderr and exit 2; `--debug` (anywhere on the line) shows tracebacks.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click

from rlflow.bench.peers import PEERS
from rlflow.errors import RlflowError

EXIT_BAD_INPUT = 2


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="rlflow")
def cli() -> None:
    """Make ONNX models faster with verified graph rewrites."""


@cli.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("-o", "--output", "--out", "output", type=click.Path(path_type=Path),
              help="Output file [default: MODEL.rlflow.onnx] (--out as `rlflow bench` and `rlflow zoo build` spell it).")
@click.option("--provider", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Execution provider to optimise for.")
@click.option("--threads", type=click.IntRange(min=0), default=1, show_default=True,
              help="onnxruntime intra-op threads for every measurement.")
@click.option("--method", type=click.Choice(["agent", "greedy", "taso", "random"]), default=None,
              help="Search method: the trained agent's rollouts, measured greedy, TASO-style cost-model "
              "backtracking, or random walks [default: agent where the agent was trained for the provider and "
              "knows every rule that matches the model, else greedy].")
@click.option("--agent", "agent", type=click.Path(path_type=Path), default=None,
              help="Policy checkpoint for --method agent [default: the shipped agent].")
@click.option("--finetune", type=click.IntRange(min=0), default=0, show_default=True, metavar="N",
              help="Adapt the agent to MODEL first with N PPO steps: in its world model's dream (the shipped agent) "
                   "or against the cost model (a PPO policy); no measurements; with --time-limit they may use half "
                   "of it.")
@click.option("--time-limit", type=click.FloatRange(min=0), default=None,
              help="Seconds for the search (verification and the final measurement come on top) "
                   "[default: 10 for agent, 60 for the searches].")
@click.option("--input-shape", "input_shapes", multiple=True, metavar="NAME:D0,D1,...",
              help="Fix a dynamic input's dimensions for measurement (repeatable); the output keeps them dynamic.")
@click.option("--fix-dim", "fixed_dims", multiple=True, metavar="NAME=VALUE",
              help="Fix a symbolic input dimension in the output (repeatable), as onnxruntime's "
                   "make_dynamic_shape_fixed does: it then runs at that value only, and rewrites may rely on it "
                   "(batch=1 lets a decoder's attention take its rotary embedding in).")
@click.option("--fix-value", "fixed_values", multiple=True, metavar="NAME=VALUE",
              help="Declare every element of an input to be VALUE (repeatable): the output reads a constant of its "
                   "shape instead, so rewrites may rely on it (attention_mask=1 where nothing is ever padded lets a "
                   "decoder's attention mask itself).")
@click.option("--profile", "profile_specs", multiple=True, metavar="NAME=D0,D1;...[@WEIGHT]",
              help="A shape the model will run at, for every dynamic input, with its share of the traffic "
                   "(repeatable): the output is kept only if faster on the weighted mean and slower at no profile "
                   "[default for a text model with no shapes given: batch 1 at sequence 16 and 128].")
@click.option("--profiles", "profiles_file", type=click.Path(path_type=Path), default=None,
              help="A file of profiles, one per line in the --profile syntax.")
@click.option("--ops", type=click.Choice(["all", "standard"]), default="all", show_default=True,
              help="Operators the output may use: all (onnxruntime's contrib fusions too) or standard (default ONNX "
                   "domain only, for models that must also run on other runtimes).")
@click.option("--cuda-graph", is_flag=True,
              help="CUDA only: measure every model as onnxruntime's captured CUDA graph (enable_cuda_graph, inputs "
                   "and outputs bound on the device), the way to run the output; needs fixed shapes and every node "
                   "on CUDA.")
@click.option("--precision", type=str, default=None, metavar="int4|int8",
              help="After the exact rewrites, store the weights of the layers where it pays in fewer bits, within "
                   "--max-error: int4 (int4 or int8 per layer) or int8 [default: exact].")
@click.option("--max-error", type=float, default=None, metavar="X",
              help="With --precision: the relative error norm ||out - ref|| / ||ref|| each output may reach against "
                   "MODEL [default: 0.10 for int4, 0.02 for int8].")
@click.option("--data", type=click.Path(path_type=Path), default=None, metavar="FILE.npz",
              help="With --precision: arrays named after MODEL's inputs, first axis = samples, to measure the error "
                   "on [default: random inputs, which the report says].")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Also write the report as JSON.")
@click.option("--seed", type=int, default=0, show_default=True, help="Random inputs and measurement order.")
@click.option("--quiet", is_flag=True, help="Print only the output path.")
def optimize(model, output, provider, threads, method, agent, finetune, time_limit, input_shapes, fixed_dims,
             fixed_values, profile_specs, profiles_file, ops, cuda_graph, precision, max_error, data, json_path, seed,
             quiet) -> None:
    """Optimise MODEL and write the verified result."""
    from rlflow.files import write_text_atomic
    from rlflow.graph.input_shapes import parse_fixed_dims, parse_input_shapes
    from rlflow.graph.input_values import parse_fixed_values
    from rlflow.measure.shape_profiles import given_profiles
    from rlflow.optimize.pipeline import optimize as run
    from rlflow.optimize.report import format_report

    output = output or model.with_name(model.name[: -len(".onnx")] + ".rlflow.onnx" if model.name.endswith(".onnx")
                                       else model.name + ".rlflow.onnx")
    if output.resolve() == model.resolve():
        raise RlflowError("the output path is the input path; rlflow never overwrites its input")
    result = run(model, provider=provider, threads=threads, method=method, time_limit=time_limit,
                 input_shapes=parse_input_shapes(input_shapes), fix_dims=parse_fixed_dims(fixed_dims),
                 fix_values=parse_fixed_values(fixed_values), seed=seed,
                 progress=not quiet, agent=agent,
                 finetune=finetune, ops=ops, profiles=given_profiles(profile_specs, profiles_file),
                 cuda_graph=cuda_graph, precision=precision, max_error=max_error, data=data)
    result.save(output)
    if json_path:
        report = {**result.as_dict(), "output": str(output)}
        write_text_atomic(json_path, json.dumps(report, indent=2, default=str) + "\n")
    click.echo(str(output) if quiet else format_report(result) + f"\n  written     {output}")


@cli.command()
@click.option("--model", type=click.Path(path_type=Path), help="Count matches of every rule in this model.")
@click.option("--input-shape", "input_shapes", multiple=True, metavar="NAME:D0,D1,...")
def rules(model, input_shapes) -> None:
    """List the rewrite rules (with --model: how often each matches)."""
    from rlflow.graph.core import load
    from rlflow.graph.input_shapes import parse_input_shapes
    from rlflow.rewrites import RULES, match_counts

    counts = match_counts(load(model, parse_input_shapes(input_shapes))) if model else None
    width = max(len(r.name) for r in RULES)
    for index, rule in enumerate(RULES):
        count = "" if counts is None else f"{counts.get(rule.name, 0):>6}  "
        contrib = " [contrib]" if rule.contrib else ""
        click.echo(f"{index:>3}  {rule.name:<{width}}  {rule.group:<8}  {count}{rule.description}{contrib}")
    if counts is not None:
        click.echo(f"{sum(counts.values())} matches of {sum(c > 0 for c in counts.values())} rules in {model}")


@cli.command()
@click.argument("models", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--methods", default="agent,greedy,taso,random", show_default=True,
              help="Comma-separated search methods.")
@click.option("--peers", is_flag=True,
              help="Also run every peer: onnxsim, onnxoptimizer, onnxslim, the onnxscript optimizer, it with its "
                   "onnxruntime fusions (onnxscript-ort) and onnxruntime's transformers optimizer (optimum's O2; "
                   "transformers only), their settings recorded in the results; and, for a zoo decoder, "
                   "onnxruntime-genai's builder's graph when `make genai-builder` installed it.")
@click.option("--peer", "peer_names", multiple=True, type=click.Choice(PEERS), metavar="NAME",
              help="Run this peer only (repeatable; instead of --peers): " + ", ".join(PEERS) + ".")
@click.option("--provider", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--threads", type=click.IntRange(min=0), default=1, show_default=True)
@click.option("--time-limit", type=click.FloatRange(min=0), default=None,
              help="Seconds of search per model and method [default: each method's own, 10 for agent, 60 for "
                   "the searches].")
@click.option("--rounds", type=click.IntRange(min=3), default=30, show_default=True,
              help="Interleaved rounds per input-vs-output measurement.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--agent", type=click.Path(path_type=Path), default=None,
              help="Method agent's checkpoint (a PPO policy or a world-model agent) [default: the shipped one].")
@click.option("--profile", "profile_specs", multiple=True, metavar="NAME=D0,D1;...[@WEIGHT]",
              help="Measure every model at this shape profile too (repeatable; as in optimize), the peers' outputs "
                   "as rlflow's.")
@click.option("--fix-dim", "fixed_dims", multiple=True, metavar="NAME=VALUE",
              help="Fix a symbolic input dimension of every model first (repeatable; as in optimize): the methods, "
                   "the peers and the input they are compared with all have it fixed.")
@click.option("--fix-value", "fixed_values", multiple=True, metavar="NAME=VALUE",
              help="Declare every element of an input of every model to be VALUE first (repeatable; as in "
                   "optimize): the methods, the peers and the input they are compared with all read it so.")
@click.option("--ray", "ray_address", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS]",
              help="Run each model as one task on a Ray cluster: at ADDRESS (auto, ray://host:10001), or without one "
                   "on a cluster started here; every node needs --resources '{\"rlflow_measurement\": 1}'.")
@click.option("--shared-path", is_flag=True,
              help="With --ray: every node reads the models and --agent at their paths (a shared filesystem), so "
                   "nothing is shipped through Ray's object store.")
@click.option("--cuda-graph", is_flag=True,
              help="CUDA only: every measurement, rlflow's and the peers', runs the models as captured CUDA graphs "
                   "(as `rlflow optimize --cuda-graph`).")
@click.option("--control", is_flag=True,
              help="Also measure a copy of the input as if a method wrote it (row `control`): its speedup strays "
                   "from 1 by what the measurement alone does on that model, the resolution of every other figure.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench-results"), show_default=True)
def bench(models, methods, peers, peer_names, provider, threads, time_limit, rounds, seed, agent, profile_specs,
          fixed_dims, fixed_values, ray_address, shared_path, cuda_graph, control, out) -> None:
    """Benchmark MODELS (files or folders of .onnx) under every method; write JSON, CSV, markdown and plots."""
    from rlflow.bench.run import BenchConfig, find_models, run_bench
    from rlflow.graph.input_shapes import parse_fixed_dims
    from rlflow.graph.input_values import parse_fixed_values

    if peers and peer_names:
        raise click.UsageError("--peers runs every peer: give it or --peer NAME, not both")
    config = BenchConfig(methods=tuple(m.strip() for m in methods.split(",") if m.strip()),
                         peers=PEERS if peers else tuple(dict.fromkeys(peer_names)), references=peers,
                         provider=provider, threads=threads, time_limit=time_limit, rounds=rounds, seed=seed,
                         agent=str(agent) if agent else None, profiles=tuple(profile_specs), ray=ray_address,
                         shared_path=shared_path, cuda_graph=cuda_graph, fix_dims=parse_fixed_dims(fixed_dims) or None,
                         fix_values=parse_fixed_values(fixed_values) or None, control=control)
    if shared_path and ray_address is None:
        raise click.UsageError("--shared-path is for --ray: without a cluster every model is read here")
    if ray_address is not None:
        from rlflow.bench.cluster import run_on_ray

        results = run_on_ray(find_models(models), config, out)
    else:
        results = run_bench(find_models(models), config, out)
    failed = sum(r["status"] != "ok" for r in results["rows"])
    click.echo(f"{len(results['rows'])} runs ({failed} not ok) in {results['seconds']:.0f} s; results in {out}/: "
               "results.json, results.csv, results.md, speedup.png, time.png")


@cli.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []})
@click.option("--algo", type=click.Choice(["ppo", "worldmodel"]), required=True,
              help="ppo: model-free masked PPO; worldmodel: VAE + MDN-RNN with a controller trained in the dream.")
@click.argument("options", nargs=-1, type=click.UNPROCESSED)
def train(algo, options) -> None:
    """Train an agent; every option of the trainer's Config is accepted (`rlflow train --algo ppo --help`)."""
    if algo == "ppo":
        from rlflow.train import ppo as trainer
    else:
        from rlflow.train.worldmodel import loop as trainer
    trainer.main(trainer.parse_args(list(options)))


@cli.group()
def zoo() -> None:
    """The model zoo: real architectures defined in PyTorch, exported to ONNX offline; its deployment section
    (family deploy) exports Hugging Face transformers models as users do."""


_ZOO_FAMILIES = click.Choice(["cnn", "transformer", "rnn", "deploy", "trained"])


@zoo.command("list")
@click.option("--tiny/--no-tiny", default=False, show_default=True, help="Include the small test variants.")
@click.option("--family", type=_ZOO_FAMILIES, default=None,
              help="Only this family [default: every family; the deployment section last].")
def zoo_list(tiny, family) -> None:
    """Name, parameters, FLOPs, node count and input shapes of every zoo model.

    Models not built yet are built into the cache first, except the deployment section's (family deploy), whose
    figures show once `rlflow zoo build --family deploy` has built them.
    """
    from rlflow import zoo as registry

    listed = registry.names(include_tiny=tiny, family=family)
    if family is None:
        listed += registry.names(include_tiny=tiny, family=registry.DEPLOY)
    width = max([32, *(len(name) + 2 for name in listed)])  # the decoders' names run past 30 characters
    click.echo(f"{'name':<{width}}{'family':<13}{'params':>12}{'GFLOPs':>10}{'nodes':>7}  inputs")
    for name in listed:
        row = registry.summary(name, build_missing=registry.get(name).family != registry.DEPLOY)
        items = [f"{k}:{list(v)}" for k, v in row["input_shapes"].items()]
        shapes = ", ".join(items[:3] + ([f"... ({len(items) - 3} more)"] if len(items) > 3 else []))
        if row["params"] is None:
            figures = f"{'-':>12}{'-':>10}{'-':>7}"
        else:
            figures = f"{row['params']:>12,}{row['flops'] / 1e9:>10.3f}{row['nodes']:>7}"
        click.echo(f"{name:<{width}}{row['family']:<13}{figures}  {shapes}")


@zoo.command("build")
@click.argument("names", nargs=-1)
@click.option("--out", type=click.Path(path_type=Path), default=Path("models"), show_default=True)
@click.option("--force", is_flag=True, help="Rebuild even when the definition is unchanged.")
@click.option("--tiny/--no-tiny", default=False, show_default=True, help="With no NAMES: also build tiny variants.")
@click.option("--family", type=_ZOO_FAMILIES, default=None,
              help="With no NAMES: this family only; 'deploy' builds the deployment section (needs the deploy extra).")
def zoo_build(names, out, force, tiny, family) -> None:
    """Build zoo models into --out: NAMES, else every full-size model but the deployment section's.

    A model that fails to build is reported and the others are still built (exit 1 at the end): on the GPU machine
    one export that failed under another transformers version used to leave every model after it unbuilt."""
    from rlflow import zoo as registry

    wanted = list(names or registry.names(include_tiny=tiny, family=family))
    failed = []
    for name in wanted:
        try:
            result = registry.build(name, out, force=force)
        except Exception as exc:  # noqa: BLE001 - one line per model; --debug raises it with its traceback
            if len(wanted) == 1 or logging.getLogger("rlflow").isEnabledFor(logging.DEBUG):
                raise
            click.echo(f"error: {name}: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}", err=True)
            failed.append(name)
            continue
        state = "unchanged" if result.skipped else f"built in {result.seconds:.1f} s"
        click.echo(f"{result.path}  {state}  ({result.nodes} nodes, {result.params:,} params)")
    if failed:
        click.echo(f"error: {len(failed)} of {len(wanted)} models not built: {', '.join(failed)}", err=True)
        raise click.exceptions.Exit(1)


@cli.command("bench-precision")
@click.argument("models", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--precision", type=click.Choice(["int4", "int8"]), default="int4", show_default=True)
@click.option("--max-error", type=float, default=None, help="rlflow's error budget [default: the precision's].")
@click.option("--peers", default="all", show_default=True,
              help="Comma-separated peer quantizers (rlflow.bench.precision_peers), 'all' or 'none'.")
@click.option("--data", type=click.Path(exists=True, dir_okay=False), default=None,
              help="An npz for every model [default: MODEL.heldout.npz beside each model, else random inputs].")
@click.option("--method", type=click.Choice(["agent", "greedy", "taso", "random"]), default=None,
              help="rlflow's exact search before the precision step [default: optimize's].")
@click.option("--time-limit", type=click.FloatRange(min=0), default=None)
@click.option("--threads", type=click.IntRange(min=0), default=1, show_default=True)
@click.option("--rounds", type=click.IntRange(min=3), default=12, show_default=True,
              help="Interleaved rounds of the comparison of every output with the input.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Folder for results.json and results.md.")
def bench_precision(models, precision, max_error, peers, data, method, time_limit, threads, rounds, seed, out) -> None:
    """rlflow's --precision beside the quantizers a user would pick instead: speed and error on the same data."""
    from rlflow.bench.precision import PrecisionBench, peer_names, run

    config = PrecisionBench(precision, max_error, peer_names(peers, precision), threads, rounds, seed, method,
                            time_limit, data)
    run(models, config, out)
    click.echo((out / "results.md").read_text() + f"written {out}/results.json, results.md")


_PASSTHROUGH = {"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []}
"""Settings of the commands whose options their module's own parser reads (its `--help` lists them)."""


def _passthrough(group: click.Group, name: str, module: str, summary: str) -> None:
    """Registers `rlflow [GROUP] NAME ARGS...`: `module.main(ARGS)`, whose argparse parser documents the options.
    A main that returns an int returns it as the exit code; one that returns its results (a dict) exits 0."""

    @group.command(name, context_settings=_PASSTHROUGH, help=summary + "  Options: `--help`.")
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def command(args) -> int:
        import importlib

        done = importlib.import_module(module).main(list(args))
        return done if type(done) is int else 0


@cli.group()
def costmodel() -> None:
    """The cost model's table: check it against measurement, audit its entries, fit the GPU estimate."""


_passthrough(cli, "ship", "rlflow.train.ship", "Turn a training run's checkpoint into a shipped agent.")
_passthrough(cli, "evaluate", "rlflow.train.evaluate",
             "A trained policy against the random-walk baseline, measured end to end.")
_passthrough(cli, "wallclock", "rlflow.bench.wallclock",
             "How long `rlflow optimize` takes with every default: a fresh process per model, wall clock.")
_passthrough(cli, "bench-rules", "rlflow.bench.rule_speed",
             "Speed of the rule library itself: matching every rule, and one apply, on large graphs.")
_passthrough(cli, "bench-estimate", "rlflow.bench.estimated",
             "Each method's graph scored by the cost model of a provider this machine lacks (CUDA without a GPU).")
_passthrough(cli, "bench-builder", "rlflow.bench.builder_reference",
             "onnxruntime-genai's model builder's graph of a zoo decoder step (same weights) against the export.")
_passthrough(cli, "simulate-cluster", "rlflow.cluster.simulated",
             "A Ray cluster of several nodes on this machine, each with its own cache, for trying --ray.")
_passthrough(zoo, "build-large", "rlflow.zoo.large_models",
             "Build a model over protobuf's 2 GB limit (its weights in an external-data file).")
_passthrough(costmodel, "check", "rlflow.measure.costmodel.check",
             "Rank correlation of the cost model's estimates with interleaved end-to-end measurements.")
_passthrough(costmodel, "audit", "rlflow.measure.costmodel.audit",
             "Measure a model's fusion groups again and list the cached costs the new measurements do not confirm.")
_passthrough(costmodel, "fit", "rlflow.measure.costmodel.gpu_estimate",
             "Fit the estimate of a GPU's group costs to a table measured on it, and report its held-out error.")


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
        code = cli.main(args=argv, prog_name="rlflow", standalone_mode=False)
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


if __name__ == "__main__":
    sys.exit(main())
