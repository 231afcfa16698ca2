"""The terminal report of `rlflow optimize`: the decision and why, latencies, speedup (per shape profile too),
verification, rewrites, operator counts, time and settings."""
from __future__ import annotations

import re
from collections import Counter

from rlflow.optimize.result import Result


def format_report(result: Result) -> str:
    """The terminal report: decision, latency, rewrites, op counts, verification and settings."""
    lines = [f"rlflow optimize: {result.source or 'in-memory graph'}", f"  result      {result.reason}"]
    before, after = result.comparison.timings
    lines.append(f"  latency     {before.median_ms:.3f} ms -> {after.median_ms:.3f} ms (medians, IQR "
                 f"{before.iqr_ms:.3f} / {after.iqr_ms:.3f} ms)")
    if result.comparison.extra.get("unchanged"):
        lines.append("  speedup     1x: the output is the input (its latency timed alone)")
    elif result.profiles:
        lines.append(f"  speedup     {result.speedup} (weighted geometric mean of the profiles' speedups and of their "
                     f"{int(result.speedup.confidence * 100)}% bootstrap bounds)")
    else:
        lines.append(f"  speedup     {result.speedup} ({int(result.speedup.confidence * 100)}% bootstrap interval, "
                     f"{result.comparison.rounds} interleaved rounds)")
    lines += _profile_lines(result.profiles)
    if result.verification is None:
        lines.append("  verified    output is the input file unchanged")
    else:
        v = result.verification
        over = (f"on {v.extra['samples']}" if "samples" in v.extra else
                f"over seeds {list(v.seeds)} and {len(v.shapes)} input shape set(s)"
                + (f"; {len(v.extra['skipped_shapes'])} skipped, the input itself failing to run there"
                   if v.extra.get("skipped_shapes") else ""))
        lines.append(f"  verified    {'yes' if v.ok else 'NO'}: relative error norm ||out - ref|| / ||ref|| at most "
                     f"{v.max_rel_norm:.2e} {over}")
        groups: dict[tuple, list] = {}  # a decoder's 60 present states: one line per name pattern
        for check in v.outputs:
            groups.setdefault((re.sub(r"\d+", "#", check.name), check.tolerance), []).append(check)
        for checks in groups.values():
            together = len(checks) > 1 and len(_collapsed([c.name for c in checks])) == 1
            most = "at most " if together else ""
            for part in [checks] if together else [[c] for c in checks]:
                lines.append(f"              {_collapsed([c.name for c in part])[0]}: max abs {most}"
                             f"{max(c.max_abs for c in part):.2e}, rel-norm {most}{max(c.rel_norm for c in part):.2e} "
                             f"(tolerance {part[0].tolerance:.0e})")
    lines += _precision_lines(result.precision)
    lines += _padding_lines(result.padding)
    lines.append(f"  rewrites    {len(result.applied)}" + (": " + _by_rule(result.applied) if result.applied else "")
                 + (f" (not kept: {_by_rule(result.rejected)})" if result.rejected else ""))
    ops = sorted(set(result.op_counts_before) | set(result.op_counts_after))
    lines.append("  operators   " + f"{'op':<24}{'before':>8}{'after':>8}")
    for op in ops:
        b, a = result.op_counts_before.get(op, 0), result.op_counts_after.get(op, 0)
        lines.append(f"              {op:<24}{b:>8}{a:>8}" + ("" if a == b else "  *"))
    lines.append(f"              {'total':<24}{sum(result.op_counts_before.values()):>8}"
                 f"{sum(result.op_counts_after.values()):>8}")
    lines.append(f"  runs on     {result.runs_on}")
    s = result.settings
    if result.memory:
        m = result.memory
        lines.append(f"  memory      peak {m['peak'] / 2**30:.2f} GiB resident for {m['weights'] / 2**30:.2f} GiB of "
                     f"weights (predicted for the weights: {m['predicted_peak'] / 2**30:.2f} GiB)"
                     + ("; sessions shared the weights in place, without pre-packing" if s.get("share_weights") else ""))
    limit = f" of a {s['time_limit']:.0f} s limit" if s.get("time_limit") is not None else ""
    lines.append(f"  time        {result.seconds:.1f} s total, {result.search_seconds:.1f} s search{limit}, "
                 f"{result.candidates_measured} candidates measured end to end, "
                 f"{result.candidates_estimated} estimated")
    if result.search_stop:
        steps = f"{len(result.search_steps)} step(s), " if result.search_steps else ""
        lines.append(f"  search      {steps}stopped: {result.search_stop}")
    if result.not_reached:
        lines.append(f"  not reached {'; '.join(result.not_reached)}")
    lines += _dropped_lines(result.candidates_dropped)
    tuned = s.get("finetune")
    if tuned:
        where = tuned.get("environment", "cost model")
        span = "at the first update, {} at the last" if where == "dream" else "in the first quarter, {} in the last"
        lines.append(f"  finetune    {tuned['steps']} {where} steps, {tuned['updates']} PPO updates in "
                     f"{tuned['seconds']:.1f} s ({tuned['stop_reason']}); mean episode return "
                     f"{_signed(tuned['mean_return_first'])} " + span.format(_signed(tuned['mean_return_last'])))
    if s.get("input_repairs"):
        lines.append(f"  repaired    {'; '.join(s['input_repairs'])} (docs/robustness.md)")
    capture = ", CUDA graph capture" if s.get("cuda_graph") else ""
    lines.append(f"  settings    {s['provider']}{capture}, {s['threads']} thread(s), "
                 f"graph optimisation '{s['opt_level']}', "
                 f"method {s['method']}{_why(s.get('method_reason'))}{_agent(s.get('agent'))}, "
                 f"operators {s.get('ops', 'all')}, "
                 f"seed {s['seed']}, "
                 f"input shapes {_shapes_text(s['input_shapes'])}"
                 + "".join(f", {name} fixed to {value}" for name, value in (s.get("fixed_dims") or {}).items())
                 + "".join(f", every {name} {value:g}" for name, value in (s.get("fixed_values") or {}).items()))
    return "\n".join(lines)


def _agent(identity: dict | None) -> str:
    return f" ({identity['path']}, SHA-256 {identity['sha256'][:12]})" if identity else ""


def _by_rule(rewrites: list[str]) -> str:
    """`rule@node` rewrites as `rule x N` per rule, in order of first use (a decoder's fusion applies in every layer)."""
    counts = Counter(r.split("@")[0] for r in rewrites)
    return ", ".join(rule if n == 1 else f"{rule} x{n}" for rule, n in counts.items())


def _shapes_text(shapes: dict) -> str:
    """`name [dims]` per input; inputs of one shape whose names differ in one number only are given once
    (`past_key_values.{0..29}.key [1, 3, 128, 64]`): a decoder's cache has 60 of them."""
    groups: dict[tuple, list[str]] = {}
    for name, dims in shapes.items():
        groups.setdefault((re.sub(r"\d+", "#", name), tuple(dims)), []).append(name)
    return ", ".join(f"{name} {list(dims)}" for (_, dims), names in groups.items() for name in _collapsed(names))


def _collapsed(names: list[str]) -> list[str]:
    """Names alike but for their numbers, as one name with a set in place of the one number that varies."""
    pieces = [re.split(r"(\d+)", n) for n in names]  # numbers at odd places
    varying = [k for k in range(1, len(pieces[0]), 2) if len({p[k] for p in pieces}) > 1]
    if len(varying) != 1:
        return names
    values = sorted({int(p[varying[0]]) for p in pieces})
    contiguous = values == list(range(values[0], values[-1] + 1))
    span = f"{{{values[0]}..{values[-1]}}}" if contiguous else "{" + ",".join(map(str, values)) + "}"
    return ["".join(span if k == varying[0] else piece for k, piece in enumerate(pieces[0]))]


def _profile_lines(profiles: list[dict]) -> list[str]:
    """One line per shape profile: weight share, the input's latency, and the output's with the speedup when the
    final measurement ran (the latency line above is the first profile's)."""
    total = sum(p["weight"] for p in profiles)
    lines = []
    for k, p in enumerate(profiles):
        head = "  profiles    " if k == 0 else " " * 14
        line = f"{head}{p['label']} ({p['weight'] / total:.0%} of traffic): input {p['input_ms']:.3f} ms"
        if p["speedup"] is not None:
            r = p["speedup"]
            line += f", output {p['output_ms']:.3f} ms, {r['median']:.3f}x [{r['low']:.3f}, {r['high']:.3f}]"
        lines.append(line)
    return lines


def _why(reason: str | None) -> str:
    """A default choice's reason, in brackets after it."""
    return f" ({reason})" if reason else ""


def _signed(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.2f}"


def _dropped_lines(dropped: list[dict]) -> list[str]:
    """The candidates onnxruntime could not run, counted by the rules that made them, and its first message."""
    if not dropped:
        return []
    counts = Counter(d["rules"] for d in dropped)
    made_by = "; ".join(f"{rules} ({n})" if n > 1 else rules for rules, n in counts.most_common())
    return [f"  dropped     {len(dropped)} candidate(s) onnxruntime could not run, made by: {made_by}",
            f"              first error: {dropped[0]['error']}"]


def _padding_lines(p: dict | None) -> list[str]:
    """What the declared padding contract changed, and the padded batches it was verified on."""
    if not p:
        return []
    if not p["applied"]:
        return [f"  padding     {p['mask']} right-padded (declared): nothing changed: {p['reason']}"]
    lengths = " and ".join(str(x) for x in p["verified_lengths"])
    return [f"  padding     {p['mask']} right-padded (declared): {p['applied']} GroupQueryAttention read the rows' "
            f"lengths; verified on padded batches, rows of lengths {lengths}, each against the row alone"]


def _precision_lines(p: dict | None) -> list[str]:
    """What `--precision` lowered, within which budget, measured on what, and what it cost in error."""
    if not p:
        return []
    budget = f"max error {p['max_error']:g} ({p['max_error_source']})"
    layers = ", ".join(f"{name} x{n}" for name, n in p["layers"].items()) or "no quantizable layer"
    lines = [f"  precision   {p['precision']} within {budget}, measured on {p['samples']}: {layers}",
             f"              {p['stop_reason']}"]
    mib = p["weight_bytes"]
    lines.append(f"              weights {mib['before'] / 2**20:.2f} MiB -> {mib['after'] / 2**20:.2f} MiB")
    error = p.get("error")
    if error:
        worst = max(error["checks"], key=lambda c: c["rel_norm"])
        line = f"              error {worst['rel_norm']:.2e} ({worst['name']}, the largest)"
        logits = error.get("logits") or {}
        if logits:
            line += f"; next-token agreement {logits['agreement']:.1%}, KL {logits['kl']:.2e} nats"
            if "loss_reference" in logits:
                ref, cand = logits["loss_reference"], logits["loss_candidate"]
                line += f", loss {ref:.4f} -> {cand:.4f} nats ({(cand - ref) / ref:+.2%})"
        lines.append(line)
    if p.get("already"):
        ops = ", ".join(f"{op} x{n}" for op, n in p["already"].items())
        lines.append(f"              already in low precision in the input, left as they are: {ops}")
    if p.get("exact_note"):
        lines.append(f"              {p['exact_note']}")
    if p["random_inputs"]:
        lines.append("              the error is measured on random inputs, not on data: give --data FILE.npz")
    return lines
