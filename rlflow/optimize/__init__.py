"""`rlflow optimize`: what it can be asked (`options`), the pipeline that loads, searches, verifies and measures
(`pipeline`), what it hands back (`result`) and the terminal report of it (`report`).  `optimize`, `Options` and
`Result` are re-exported: they are the library's entry point."""
from rlflow.optimize.options import Options
from rlflow.optimize.pipeline import optimize
from rlflow.optimize.result import Result

__all__ = ["Options", "Result", "optimize"]
