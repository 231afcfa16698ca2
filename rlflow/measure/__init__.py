"""Measurement through onnxruntime: sessions, timing, interleaved comparison, profiling and verification."""
from rlflow.measure.session import PROVIDERS, SessionSettings, create_session, resolve_provider
from rlflow.measure.verify import Verification, verify

__all__ = ["PROVIDERS", "SessionSettings", "create_session", "resolve_provider", "Verification", "verify"]
