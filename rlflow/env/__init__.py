"""The rewrite environment `rlflow/Rewrite-v0` (Gymnasium): a real ONNX graph, rewritten one (rule, location) or
one rule wherever it matches per step, rewarded by the cost model; the graph features it observes (`features`) and
the helpers that read its observation (`observation`).
"""
