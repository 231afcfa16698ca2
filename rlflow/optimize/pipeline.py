"""The optimize pipeline: load, search for rewrites, gate the result on verification and measurement, report.

The output is the rewritten model only if it verifies against the input on random data AND is measured faster than
the input (interleaved, on the target provider, the whole confidence interval above 1); otherwise it is the input
unchanged, and the report says why.  A rewrite that is merely "not slower" is not worth handing back: the user would
take a changed graph for no gain it can show.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import Mapping, Sequence

import onnx

from rlflow.errors import InputError
from rlflow.graph.core import Graph
from rlflow.graph.input_shapes import deployed_shapes, fix_dims
from rlflow.graph.input_values import fix_values
from rlflow.graph.model_file import max_ir_version, read_model
from rlflow.measure.accuracy import load_data
from rlflow.measure.gate import Gate, gate_budget, measure_gate
from rlflow.measure.memory import check_fits, peak_rss_bytes, shares_weights, weight_bytes
from rlflow.measure.profile_comparison import export_at
from rlflow.measure.session import SessionSettings, check_capture, resolve_provider
from rlflow.measure.shape_profiles import Profile, arrange, attach, default_profiles, without_fixed
from rlflow.measure.timing import Comparison, Pace, Ratio, Timing, check_and_time
from rlflow.measure.verify import verify
from rlflow.optimize.options import DEFAULT_TIME_LIMITS, Options, default_method, rules_for
from rlflow.optimize.padding import apply_padding, check_mask, unpadded
from rlflow.optimize.padding import record as record_padding
from rlflow.optimize.precision import exact_rules, lower_precision, precision_rules
from rlflow.optimize.result import Result
from rlflow.rewrites import REGISTRY_VERSION, Rule
from rlflow.search.candidates import SearchResult
from rlflow.search.fuse_everything import VARIANTS_MEASURED
from rlflow.search.greedy import GreedyConfig, greedy, step_size
from rlflow.search.random_walk import RandomConfig, random_walk
from rlflow.search.taso import TasoConfig, taso

log = logging.getLogger("rlflow")

def optimize(model: str | os.PathLike | Graph, options: Options | None = None, **settings) -> Result:
    """Optimises a model for the target execution provider.

    Args:
        model: a path to an .onnx file or a Graph.
        options: what to optimise for and how (`Options`; its defaults where None).
        **settings: fields of `Options` to override, e.g. `optimize("m.onnx", method="greedy", time_limit=30)`.

    Raises:
        InputError: the model cannot be loaded, or an option is out of range.
        ProviderError: the provider is unavailable or cannot run the model.
    """
    options = replace(options or Options(), **settings)
    options.check()
    provider, threads, method, time_limit = options.provider, options.threads, options.method, options.time_limit
    input_shapes, seed, rounds, rules = options.input_shapes, options.seed, options.rounds, options.rules
    progress, agent, finetune, ops = options.progress, options.agent, options.finetune, options.ops
    profiles, cuda_graph = options.profiles, options.cuda_graph
    start = time.monotonic()
    graph, given = load_input(model, input_shapes, profiles, options.fix_dims, options.fix_values)
    samples = load_data(options.data, given) if options.data is not None else None  # its mistakes before any work
    if options.padding:
        check_mask(given, *options.padding)
    predicted_peak = check_fits(graph)
    resolved = resolve_provider(provider)
    rules = exact_rules(rules_for(rules, ops, resolved), options.precision)
    lowering = precision_rules(options.precision, resolved) if options.precision else []
    check_capture(resolved, cuda_graph)
    method, method_reason = (method, None) if method is not None else _default_for(resolved, agent, finetune, graph, rules)
    if method == "agent" and agent is None:
        from rlflow.search.agent import shipped_agent

        agent = shipped_agent(resolved)
    limited = time_limit is not None
    settings = SessionSettings(provider=resolved, threads=threads, share_weights=shares_weights(graph),
                               cuda_graph=cuda_graph)
    if settings.share_weights:
        log.info("large weights (%.1f GiB): sessions share them in place, without pre-packing; %.1f GiB predicted for "
                 "weights with candidates measured one at a time", weight_bytes(graph) / 2**30, predicted_peak / 2**30)
    paces, input_timings = _time_input(graph, given, settings, seed)
    input_timing = input_timings[0]
    if time_limit is None:
        time_limit = _default_time_limit(method, paces, _planned_candidates(method, graph, rules))
    gate_seconds = gate_budget(time_limit, paces, rounds)

    policy, adapted = None, None
    if finetune:
        policy, adapted = _finetuned(graph, settings, agent, finetune, seed, rules,
                                     deadline=start + time_limit / 2 if limited else None)
        if limited:
            time_limit = max(0.0, time_limit - (time.monotonic() - start))
    search = _search(graph, settings, method, time_limit, seed, rules, progress, agent, policy)
    candidate = search.graph.to_model(static=False) if search.applied else None
    checked = None if candidate is None else verify(
        given, candidate, seeds=(seed, seed + 1, seed + 2), shapes=verification_shapes(graph),
        fallback=batch_changed_shapes(graph), share_weights=settings.share_weights)
    contract = None
    if options.padding:
        (mask,) = options.padding
        search, checked, contract = apply_padding(graph, given, search, checked, mask, seed)
        if contract.applied:
            candidate = search.graph.to_model(static=False)
            record_padding(candidate, mask)
    lowered = None
    if options.precision:
        search, checked, lowered = lower_precision(
            graph, given, search, checked, settings, precision=options.precision, max_error=options.max_error,
            samples=samples, rules=lowering, seed=seed, progress=progress)
        if lowered.search.applied:
            candidate = search.graph.to_model(static=False)
    recorded = {**settings.as_dict(), "method": method, "method_reason": method_reason, "time_limit": time_limit,
                "seed": seed,
                "input_shapes": {k: list(v) for k, v in graph.input_shapes.items()},
                "fixed_dims": dict(options.fix_dims or {}),
                "fixed_values": dict(options.fix_values or {}),
                "input_repairs": graph.input_repairs,
                "padding": dict(options.padding or {}),
                "profiles": [p.as_dict() for p in graph.profiles],
                "rules": len(rules), "ops": ops, "gate_seconds": gate_seconds, "precision": options.precision,
                "registry_version": REGISTRY_VERSION}
    if method == "agent":
        from rlflow.agents.checkpoint import checkpoint_identity

        recorded["agent"] = checkpoint_identity(agent)
        recorded["finetune"] = adapted.as_dict() if adapted else None
    common = dict(op_counts_before=graph.op_counts(), search_seconds=search.seconds,
                  candidates_measured=search.candidates_measured, candidates_estimated=search.candidates_estimated,
                  candidates_unmeasured=search.candidates_unmeasured,
                  not_reached=list(search.not_reached), cost_table=search.cost_table,
                  candidates_dropped=list(search.candidates_dropped), search_stop=search.stop_reason,
                  search_steps=list(search.steps), settings=recorded, source=graph.source)

    verification, keep, gate = None, False, None
    if not search.applied:
        reason = f"input kept: {search.stop_reason}"
    else:
        verification = checked
        reason = f"input kept: the rewritten model does not verify ({verification.message})"
    measured = None
    if verification is not None and verification.ok:
        timed = (graph, search.graph) if not (contract and contract.applied) else (
            unpadded(graph, contract.mask), unpadded(search.graph, contract.mask))
        measured = measure_gate(*timed, _gate_settings(settings, search.graph), paces, rounds=rounds,
                                budget=gate_seconds, seed=seed)
        gate, keep = measured.ratio, measured.keep
        comparison = measured.comparisons[0]
        if measured.profiles:  # the report's speedup is the decision's: the mean over profiles
            comparison = replace(comparison, ratios=[comparison.ratios[0], gate],
                                 extra={**comparison.extra, "profiles": len(measured.profiles)})
        input_timing = comparison.timings[0]
        reason = _gate_reason(measured)
    if not keep:
        comparison = _unchanged(input_timing, settings, seed)
    output = search.graph if keep else graph
    return Result(output, keep, reason, [str(m) for m in search.applied] if keep else [], comparison, verification,
                  op_counts_after=output.op_counts(), seconds=time.monotonic() - start,
                  output_model=candidate if keep else given, gate=gate,
                  profiles=_profile_rows(graph, input_timings, measured),
                  rejected=[] if keep else [str(m) for m in search.applied],
                  memory={"weights": weight_bytes(graph), "predicted_peak": predicted_peak, "peak": peak_rss_bytes()},
                  precision=lowered.as_dict() if lowered else None,
                  padding=contract.as_dict() if contract else None,
                  **common)


def _default_for(provider: str, agent, finetune: int, graph: Graph, rules) -> tuple[str, str | None]:
    """`default_method`, logged where it is not the agent; `--finetune` adapts the agent, so it asks for it."""
    if finetune:
        return "agent", None
    method, reason = default_method(provider, agent, graph, rules)
    if reason:
        log.info("method %s: %s", method, reason)
    return method, reason


SEARCH_CANDIDATES = {"agent": 1 + VARIANTS_MEASURED, "greedy": 8, "taso": 8, "random": 8}
"""Candidates a method's default time leaves room to measure end to end at least (the agent: its policy's graph and
the fuse-everything variants measured beside it, `VARIANTS_MEASURED`; greedy: two steps the size of its first, where
more, `step_size`): a 1 GB decoder's candidate takes 10-20 s at two cache lengths, and greedy's 60 s then measured
four, too few to reach its second step."""


GREEDY_PLANNED_STEPS = 2
"""Steps of the input's size greedy's default time plans for: its usual run on a decoder is a first step won by every
fusion at once and a second step that measures all of its candidates to find none faster.  Planned for the first
alone, five of the seven decode steps stopped for time: two in their second step, three in their first, where a
candidate took about a fifth longer than planned."""


def _planned_candidates(method: str, graph: Graph, rules: Sequence[Rule]) -> int:
    """SEARCH_CANDIDATES, or greedy's first steps where they build more (GREEDY_PLANNED_STEPS): with eight, greedy ran
    out of time on 30-layer decoder steps where none of its first 14 candidates was faster, so it never said that none
    was."""
    if method != "greedy":
        return SEARCH_CANDIDATES[method]
    return max(SEARCH_CANDIDATES[method], GREEDY_PLANNED_STEPS * step_size(graph, rules))


def _default_time_limit(method: str, paces: Sequence[Pace], candidates: int) -> float:
    """`method`'s default search time (DEFAULT_TIME_LIMITS), raised where measuring `candidates` candidates against
    the input would not fit in it: each built (about one export: a rule applied everywhere on a 3,646-node decoder
    step took 1.3 s, its export 1.0 s), then at every profile the candidate and the input exported, their sessions
    and one block of `GreedyConfig.rounds` rounds.  Without the exports it predicted eight candidates where a decode
    step's search measured three to five."""
    candidate = paces[0].seconds.get("export", 0.0) + sum(p.block_seconds(2, exports=2, rounds=GreedyConfig.rounds)
                                                          for p in paces)
    measuring = candidates * candidate
    if method == "agent":  # its rollouts take the rest of its limit: planned for two candidates whole, the agent's
        # limit measured one of four on Qwen3's 1 GiB decode step
        from rlflow.search.agent import MEASURE_SHARE

        measuring /= MEASURE_SHARE
    return max(DEFAULT_TIME_LIMITS[method], measuring)


def _time_input(graph: Graph, given: onnx.ModelProto, settings: SessionSettings,
                seed: int) -> tuple[list[Pace], list[Timing]]:
    """The input checked and timed at every profile (ProviderError where the provider cannot run it), with the pace
    (export, session and run times) that sets the default time limit and plans the final measurement at each.  The
    primary profile's latency is the report's when the input is kept.

    The input runs as the user has it, except under CUDA graph capture: there it runs as every measurement runs it,
    its static export (with dynamic shapes onnxruntime computes shapes on the CPU and refuses the capture: BERT-L4 on
    an H200)."""
    paces, timings = [], []
    for profile in graph.profiles or [None]:
        pace = Pace()
        with pace.timed("export"):  # as every candidate will be, at each profile (`_default_time_limit`)
            exported = export_at(graph, profile)
        model = exported if settings.cuda_graph else given
        del exported  # not held beside the session's copy of the weights where it is not what runs
        timings.append(check_and_time(model, settings, seed=seed, pace=pace,
                                      shapes=dict(profile.shapes) if profile else graph.input_shapes))
        paces.append(pace)
    return paces, timings


def _gate_settings(settings: SessionSettings, output: Graph) -> SessionSettings:
    """The gate's settings: the search's, but with weights pre-packed where the output holds `MatMulNBits`, whose fast
    CPU path needs its packed weight. Shared in place (a large model's setting), an int4 decode step of Qwen3-0.6B-L8
    measured 0.048x where a deployed session runs it about 4x faster; each session then holds its own packed copy."""
    if settings.share_weights and "MatMulNBits" in output.op_counts():
        return replace(settings, share_weights=False)
    return settings


def _gate_reason(gate: Gate) -> str:
    over = f" (weighted geometric mean over {len(gate.profiles)} profiles)" if gate.profiles else ""
    if gate.keep:
        return "rewritten: measurably faster" + over
    if gate.slower_at:
        at = gate.profiles.index(gate.slower_at[0])
        return (f"input kept: the rewritten model is measurably slower at profile {gate.slower_at[0].label} "
                f"({gate.comparisons[at].ratios[1]})")
    return f"input kept: the rewritten model is not measurably faster ({gate.ratio}{over})"


def _profile_rows(graph: Graph, input_timings: Sequence[Timing], gate: Gate | None) -> list[dict]:
    """Per profile: its shapes and weight, the input's latency and, when the gate ran, the speedup measured there."""
    rows = []
    for i, (profile, timing) in enumerate(zip(graph.profiles, input_timings)):
        comparison = gate.comparisons[i] if gate else None
        rows.append({**profile.as_dict(), "label": profile.label,
                     "input_ms": (comparison.timings[0] if comparison else timing).median_ms,
                     "output_ms": comparison.timings[1].median_ms if comparison else None,
                     "speedup": comparison.ratios[1].as_dict() if comparison else None})
    return rows


def _finetuned(graph: Graph, settings: SessionSettings, agent, steps: int, seed: int, rules: Sequence[Rule],
               deadline: float | None):
    """The agent adapted to this graph (`rlflow.train.finetune`), and what adaptation did."""
    from rlflow.agents.actor import WorldModelActor
    from rlflow.search.agent import known_rules, load_agent
    from rlflow.train.finetune import finetune, finetune_in_dream  # the one way from optimize to a trainer

    loaded = load_agent(agent)
    adapt = finetune_in_dream if isinstance(loaded, WorldModelActor) else finetune
    policy, report = adapt(loaded, graph, steps, settings=settings, rules=known_rules(loaded, rules), seed=seed,
                           deadline=deadline)
    log.info("finetuned the agent: %d steps, %d updates in %.1f s (%s)", report.steps, report.updates, report.seconds,
             report.stop_reason)
    return policy, report


def _search(graph: Graph, settings: SessionSettings, method: str, time_limit: float, seed: int,
            rules: Sequence[Rule], progress: bool, agent: str | os.PathLike | None = None,
            policy=None) -> SearchResult:
    if method == "agent":
        from rlflow.search.agent import AgentConfig, agent_search

        return agent_search(graph, settings, AgentConfig(agent=agent, time_limit=time_limit, seed=seed), rules,
                            policy=policy, progress=progress)
    if method == "taso":
        return taso(graph, settings, TasoConfig(time_limit=time_limit, seed=seed), rules, progress=progress)
    if method == "random":
        return random_walk(graph, settings, RandomConfig(time_limit=time_limit, seed=seed), rules, progress=progress)
    return greedy(graph, settings, GreedyConfig(time_limit=time_limit, seed=seed), rules, progress=progress)


def verification_shapes(graph: Graph) -> list[dict[str, tuple[int, ...]]]:
    """The measurement shapes, plus a second set with every dynamic dimension changed, so baked shapes are caught,
    plus the shapes of the graph's other profiles."""
    fixed, other = dict(graph.input_shapes), _grown(graph, leading_only=False)
    profiled = [dict(p.shapes) for p in graph.profiles[1:]]
    return ([fixed] if other == fixed else [fixed, other]) + profiled


def batch_changed_shapes(graph: Graph) -> dict[str, tuple[int, ...]] | None:
    """The measurement shapes with only each input's leading dimension changed, where it is dynamic: verification's
    stand-in for the second set on a model that binds its dynamic dimensions together (a decode step's mask spans
    the cache and the new tokens, so changing all three apart gives inputs the model itself cannot run); None where
    no leading dimension is dynamic."""
    changed = _grown(graph, leading_only=True)
    return None if changed == dict(graph.input_shapes) else changed


def _grown(graph: Graph, leading_only: bool) -> dict[str, tuple[int, ...]]:
    """The measurement shapes with each dynamic dimension one larger (each input's leading one alone, or all)."""
    grown = {}
    for vi in graph.interface[0]:
        shape = list(graph.input_shapes[vi.name])
        for k, dim in enumerate(vi.type.tensor_type.shape.dim[:1] if leading_only else vi.type.tensor_type.shape.dim):
            if not (dim.HasField("dim_value") and dim.dim_value > 0):
                shape[k] += 1
        grown[vi.name] = tuple(shape)
    return grown


def load_input(model: str | os.PathLike | Graph, input_shapes: Mapping[str, Sequence[int]] | None,
               profiles: Sequence[Profile] | None = None,
               fixed: Mapping[str, int] | None = None,
               values: Mapping[str, float] | None = None) -> tuple[Graph, onnx.ModelProto]:
    """The graph to optimise, and the model as the user has it: their file (at an IR version onnxruntime accepts),
    else the graph's export; with `fixed` dimensions (--fix-dim) and input `values` (--fix-value), those fixed in both.

    The given model is the reference every output is verified against, so verification also covers rlflow's own
    loading, and it is what is written, unchanged, when no rewrite is kept.  Its external data stays on disk (see
    `read_model`).  A file is read and checked once for both (reading GPT-2 small's 500 MB again took 1.8 s).
    """
    if profiles and input_shapes:
        raise InputError("give shapes either as --input-shape or as --profile, not both")
    if isinstance(model, Graph):
        given = read_model(model.source) if model.source else model.to_model(static=False)
        profiles = list(profiles or model.profiles)
        graph = model if not profiles or list(model.profiles) == profiles else None
        source = model.source
    else:
        given = read_model(model)
        graph, source = None, str(model)
    if fixed:
        fix_dims(given, fixed)
        profiles = [without_fixed(p, fixed) for p in profiles or []]
        if graph is not None and any(d.dim_param in fixed for vi in graph.interface[0]
                                     for d in vi.type.tensor_type.shape.dim):
            graph = None  # built again from the fixed model; a graph given fixed (the bench's) is kept
    if values:
        fix_values(given, values)
        tensors = graph.gs.tensors() if graph is not None else {}
        readers = [n for name in values for n in getattr(tensors.get(name), "outputs", [])]
        if any(n.op != "Shape" for n in readers):
            graph = None  # as for --fix-dim
    if not isinstance(model, Graph) and not profiles and not input_shapes and not deployed_shapes(given):
        profiles = default_profiles(given)
    if profiles:
        profiles = arrange(profiles, given)
        input_shapes = profiles[0].shapes
    if graph is None:
        graph = Graph.from_model(given, input_shapes, source=source, checked=True)  # as `load`, which copies
    attach(graph, profiles or [])
    given.ir_version = min(given.ir_version, max_ir_version())
    return graph, given


def _unchanged(timing: Timing, settings: SessionSettings, seed: int) -> Comparison:
    """The report's comparison when the output is the input: speedup exactly 1, the input's latency timed once.

    Comparing a model with itself would only show session noise, and with few rounds its interval can lie wholly on one
    side of 1: a report must not call the very same file slower (or faster).  The timing is the input check's, or a
    rejected gate measurement's (on a large model another timing costs seconds).
    """
    same = Ratio(1.0, 1.0, 1.0, 0.95)
    return Comparison([timing, timing], [same, same], rounds=0, runs_per_round=1, warmup=timing.warmup,
                      settings=settings.as_dict(), seed=seed, extra={"unchanged": True})
