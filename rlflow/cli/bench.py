"""The benchmarks: `rlflow bench` (every method and peer on a set of models), `bench-precision`, `bench-estimate`,
`bench-builder`, `bench-rules` (the rule library's own speed) and `wallclock` (`rlflow optimize` as users run it)."""
from __future__ import annotations

from pathlib import Path

import click

from rlflow.bench.estimated import METHODS
from rlflow.bench.peers import PEERS
from rlflow.bench.rule_speed import DEFAULT_MODELS
from rlflow.cli.common import invocation


@click.command()
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


@click.command("bench-precision")
@click.argument("models", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--precision", type=click.Choice(["int4", "int8", "fp16", "bf16"]), default="int4", show_default=True,
              help="bf16 needs --provider cuda (onnxruntime's CPU provider has no bfloat16 kernels).")
@click.option("--max-error", type=float, default=None, help="rlflow's error budget [default: the precision's].")
@click.option("--at-peers-error", is_flag=True,
              help="rlflow's budget on each model is the least error any peer reached there (instead of --max-error): "
                   "rlflow at no more error than any peer.")
@click.option("--peers", default="all", show_default=True,
              help="Comma-separated peer quantizers (rlflow.bench.precision_peers), 'all' or 'none'.")
@click.option("--data", type=click.Path(exists=True, dir_okay=False), default=None,
              help="An npz for every model [default: MODEL.heldout.npz beside each model, else random inputs].")
@click.option("--method", type=click.Choice(["agent", "greedy", "taso", "random"]), default=None,
              help="rlflow's exact search before the precision step [default: optimize's].")
@click.option("--time-limit", type=click.FloatRange(min=0), default=None)
@click.option("--provider", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where rlflow searches and every model is timed and its error taken.")
@click.option("--threads", type=click.IntRange(min=0), default=1, show_default=True)
@click.option("--rounds", type=click.IntRange(min=3), default=12, show_default=True,
              help="Interleaved rounds of the comparison of every output with the input.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Folder for results.json and results.md.")
def bench_precision(models, precision, max_error, at_peers_error, peers, data, method, time_limit, provider, threads,
                    rounds, seed, out) -> None:
    """rlflow's --precision beside the quantizers a user would pick instead: speed and error on the same data."""
    from rlflow.bench.precision import PrecisionBench, peer_names, run

    if at_peers_error and max_error is not None:
        raise click.UsageError("--at-peers-error sets rlflow's budget from the peers: give it or --max-error, not both")
    config = PrecisionBench(precision, max_error, peer_names(peers, precision), threads, rounds, seed, method,
                            time_limit, data, provider, at_peers_error)
    run(models, config, out)
    click.echo((out / "results.md").read_text() + f"written {out}/results.json, results.md")


@click.command()
@click.argument("models", nargs=-1, required=True)
@click.option("--out", type=click.Path(path_type=Path), default=Path("docs/results"), show_default=True,
              help="Folder for the results files.")
@click.option("--optimize-args", default="", metavar='"..."',
              help="Extra options passed to every `rlflow optimize` run (one string, split as a shell splits it).")
def wallclock(models, out, optimize_args) -> int:
    """How long `rlflow optimize` takes with every default: a fresh process per model, wall clock.

    MODELS are ONNX files or folders of them.  Writes optimize-wallclock.json and optimize-wallclock.md into --out;
    exits 1 when a run failed."""
    from rlflow.bench.wallclock import wallclock as run

    results = run(models, out, optimize_args, invocation=invocation())
    return 0 if all(row["exit"] == 0 for row in results["rows"]) else 1


@click.command("bench-rules")
@click.option("--models", default=",".join(DEFAULT_MODELS), show_default=True,
              help="Zoo models stacked into one graph (comma-separated).")
@click.option("--models-dir", type=click.Path(path_type=Path), default=Path("models"), show_default=True,
              help="Where built zoo models are read from.")
@click.option("--repeats", type=int, default=5, show_default=True, help="find_matches runs (the median is reported).")
@click.option("--applies", type=int, default=40, show_default=True,
              help="Different matches applied (the median is reported).")
@click.option("--out", default="docs/results/rules-speed.json", show_default=True,
              help="JSON file written ('' for none).")
@click.option("--profile", is_flag=True, help="Also print where apply spends its time (cProfile).")
def bench_rules(models, models_dir, repeats, applies, out, profile) -> None:
    """Speed of the rule library itself: matching every rule, and one apply, on large graphs.

    The named zoo models side by side in one graph of 1,000+ nodes: `find_matches` over every rule, and `apply`."""
    from rlflow.bench.rule_speed import bench_rules as run

    run(models.split(","), models_dir, repeats, applies, out, profile, command=invocation())


@click.command("bench-estimate")
@click.argument("models", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--provider", default="cuda", show_default=True, help="cuda (the shipped table and estimate) or cpu.")
@click.option("--agent", type=click.Path(path_type=Path), default=None,
              help="The agent [default: the one shipped for the provider].")
@click.option("--time-limit", type=float, default=30.0, show_default=True, help="Seconds per search.")
@click.option("--methods", default=",".join(METHODS), show_default=True,
              help=f"Comma-separated, of {', '.join(METHODS)} (the last two do not depend on the agent).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench-estimate"), show_default=True,
              help="Folder for results.json and results.md.")
def bench_estimate(models, provider, agent, time_limit, methods, seed, out) -> None:
    """Each method's graph scored by the cost model of a provider this machine lacks (CUDA without a GPU).

    MODELS are ONNX files.  How the CUDA agent chooses, seen without a GPU: nothing is measured."""
    from rlflow.bench.estimated import bench_estimate as run

    run(models, provider, agent, time_limit, [m.strip() for m in methods.split(",") if m.strip()], seed, out)


@click.command("bench-builder")
@click.argument("models", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--precision", type=click.Choice(["fp32", "fp16"]), default="fp32", show_default=True,
              help="The builder's -p.")
@click.option("--execution-provider", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="The builder's -e, and the provider both graphs are measured on.")
@click.option("--threads", type=int, default=1, show_default=True)  # as `rlflow bench` has them
@click.option("--rounds", type=int, default=30, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--cuda-graph", is_flag=True, help="Measure both with CUDA graph capture (CUDA only).")
@click.option("--out", type=click.Path(path_type=Path), default=Path("builder-reference.json"), show_default=True)
def bench_builder(models, precision, execution_provider, threads, rounds, seed, cuda_graph, out) -> None:
    """onnxruntime-genai's model builder's graph of a zoo decoder step (same weights) against the export.

    MODELS are zoo decoder steps, named as `rlflow zoo build` names them.  Time, nodes after ORT_ENABLE_ALL and
    logits of each, one at a time, into the JSON file --out."""
    from rlflow.bench.builder_reference import bench_builder as run

    run(models, precision, execution_provider, threads, rounds, seed, cuda_graph, out)
