"""Measurement through onnxruntime: sessions, timing, interleaved comparison, profiling and verification."""
from rlflow.measure.kernel_profile import NodeTime, profile_nodes
from rlflow.measure.session import PROVIDERS, SessionSettings, create_session, resolve_provider
from rlflow.measure.timing import Comparison, Ratio, Timing, compare, time_model
from rlflow.measure.verify import Verification, verify

__all__ = ["PROVIDERS", "SessionSettings", "create_session", "resolve_provider", "Comparison", "Ratio", "Timing",
           "compare", "time_model", "NodeTime", "profile_nodes", "Verification", "verify"]
