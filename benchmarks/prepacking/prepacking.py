"""Does leaving out onnxruntime's pre-packing change what rlflow measures?  Sessions of models of 1 GiB of weights or
more share the weights in place and do not pre-pack them (`SessionSettings.share_weights`), where a user's session
would.  This measures a model's input against its every-fusion graph in one interleaved comparison with pre-packing
(private sessions) and one without (shared), CPU, 1 thread, 12 rounds, and prints both.

    python benchmarks/prepacking/prepacking.py MODEL.onnx
"""
import sys

import rlflow
from rlflow.measure.session import SessionSettings
from rlflow.measure.timing import compare
from rlflow.rewrites import RULES
from rlflow.search.candidates import Candidate, all_fusions

graph = rlflow.load(sys.argv[1])
every = all_fusions(Candidate(graph, (), graph.fingerprint()), RULES)
print("fusions:", len(every.applied), flush=True)
models = [graph.to_model(static=True), every.graph.to_model(static=True)]
for share in (False, True):
    c = compare(models, SessionSettings(threads=1, share_weights=share), rounds=12, seed=0)
    print(f"prepacking {'off' if share else 'on'}: input {c.timings[0].median_ms:.2f} ms, every fusion "
          f"{c.timings[1].median_ms:.2f} ms, speedup {c.ratios[1]}", flush=True)
