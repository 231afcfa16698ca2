"""Verification under the padding contract (`rlflow.rewrites.padding`): a padded batch run through the candidate must
give, row by row, what the reference gives on that row alone, unpadded.

Row b of a batch has n_b valid positions (n_b >= S, the step's new tokens): its mask is n_b ones then zeros, its past
cache holds n_b - S valid positions then random values standing for padding, its position ids count from n_b - S.
The reference runs the row at batch 1 with its mask all ones, its cache cut to its valid part; the candidate's
outputs for the row (and its present cache's first n_b positions) must match.  The model's inputs and outputs follow
Hugging Face's names: `past...` inputs and `present...` outputs (the sequence on their second-last axis),
`position_ids` where the model takes it.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx

from rlflow.errors import InputError
from rlflow.measure.inputs import random_inputs
from rlflow.measure.session import SessionSettings, create_session, run_session
from rlflow.measure.verify import OutputCheck, Verification, compare_arrays, worse

PAST, PRESENT, POSITIONS = "past", "present", "position_ids"


def padding_layout(model: onnx.ModelProto, mask: str, shapes: dict[str, Sequence[int]]) -> tuple[int, int]:
    """(S, P): new tokens and past length of a step at `shapes`.

    Raises:
        InputError: the model is no KV-cache step with a 2-D `mask` (the contract needs both).
    """
    names = [i.name for i in model.graph.input]
    if mask not in names or len(shapes.get(mask, ())) != 2:
        raise InputError(f"--padding {mask}=right: {mask} is not a 2-D input of the model")
    past = [n for n in names if n.startswith(PAST)]
    if not past:
        raise InputError(f"--padding {mask}=right: the model has no past_... cache inputs; the contract is for "
                         "KV-cache decoder steps")
    total, previous = shapes[mask][1], shapes[past[0]][-2]
    return total - previous, previous


def verify_padded(reference: onnx.ModelProto, candidate: onnx.ModelProto, mask: str,
                  shapes: Sequence[dict[str, Sequence[int]]], *, seed: int = 0,
                  tolerance: float | None = None) -> Verification:
    """Checks `candidate` on right-padded batches against `reference` row by row, at each set of `shapes` (batch 3
    with rows of full, about half and minimal length; the past length as the shapes give it)."""
    settings = SessionSettings(opt_level="disable")
    ref_session, cand_session = create_session(reference, settings), create_session(candidate, settings)
    outputs = [o.name for o in ref_session.get_outputs()]
    worst: dict[str, OutputCheck] = {}
    used = []
    for index, base in enumerate(shapes):
        new, past = padding_layout(reference, mask, base)
        total = new + past
        lengths = sorted({total, max(new, (total + new) // 2), new}, reverse=True)
        batch = {name: [len(lengths), *dims[1:]] for name, dims in base.items()}
        feeds = random_inputs(reference, seed + index, batch)
        feeds[mask] = np.array([[1] * n + [0] * (total - n) for n in lengths], dtype=feeds[mask].dtype)
        if POSITIONS in feeds:
            feeds[POSITIONS] = np.array([np.arange(n - new, n) for n in lengths], dtype=feeds[POSITIONS].dtype)
        try:
            padded = dict(zip(outputs, run_session(cand_session, outputs, feeds)))
        except Exception as exc:  # noqa: BLE001 - a candidate that fails to run does not verify
            return Verification(False, [], (seed,), used, "disable",
                                f"candidate fails to run on a padded batch: {str(exc).strip().splitlines()[0][:300]}")
        used.append({"batch": batch, "lengths": lengths})
        for row, n in enumerate(lengths):
            alone = {name: value[row:row + 1] for name, value in feeds.items()}
            alone[mask] = alone[mask][:, :n]
            for name in (k for k in alone if k.startswith(PAST)):
                alone[name] = alone[name][..., :n - new, :]
            expected = dict(zip(outputs, run_session(ref_session, outputs, alone)))
            for name in outputs:
                got = padded[name][row:row + 1]
                if name.startswith(PRESENT):
                    got = got[..., :n, :]
                check = compare_arrays(name, np.asarray(expected[name]), np.asarray(got), tolerance)
                if name not in worst or worse(check, worst[name]):
                    worst[name] = check
    checks = [worst[n] for n in outputs]
    bad = [c for c in checks if not c.ok]
    message = "; ".join(f"{c.name} on a padded batch: relative error {c.rel_norm:.2e} > {c.tolerance:.0e}"
                        for c in bad)
    return Verification(not bad, checks, (seed,), used, "disable", message, {"padding": {mask: "right"}})
