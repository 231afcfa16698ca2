"""Whether re-measuring takes the artifact of returns-check.md out: the GELU groups of DistilBERT's and DeiT-tiny's
dynamo exports (as exported, and after mul-add-distribute) measured five times again and their medians written into
this machine's cost table (`CostModel.set_cost`, as `rlflow costmodel audit --refresh` does; an idle machine only),
then mul-add-distribute's return priced before and after.  Run several times: each run's "after" is the next one's
"before", and they swing (README.md).

    python benchmarks/agent-deploy/decoders-340/refresh_gelu.py      # prints the two returns per model
"""
from __future__ import annotations

import statistics

from returns_check import play  # this folder's script, on sys.path when run as one

from rlflow.measure.costmodel.model import CostModel
from rlflow.measure.session import SessionSettings

MODELS = ("models/distilbert-base-s16-dynamo.onnx", "models/deit-tiny-b1-dynamo.onnx")
RULE = "mul-add-distribute"


def main() -> None:
    settings = SessionSettings(threads=1)
    for model in MODELS:
        cost_model = CostModel(settings)
        before = play(cost_model, settings, [RULE], model)[1]
        for sequence in ([], [RULE]):
            graph, _ = play(cost_model, settings, sequence, model)
            for group in cost_model.groups(graph):
                key = cost_model.cached_key(graph, group)
                if key and "Erf" in {n.op for n in group.members}:
                    cost_model.set_cost(key, statistics.median(cost_model.remeasure(graph, group, 5)))
        cost_model.save()
        after = play(CostModel(settings), settings, [RULE], model)[1]
        print(f"{model}: {RULE}'s return {before:+.2f} before the refresh, {after:+.2f} after")


if __name__ == "__main__":
    main()
