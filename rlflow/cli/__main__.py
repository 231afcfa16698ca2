"""`python -m rlflow.cli`: the `rlflow` command, as its console script runs it."""
import sys

from rlflow.cli import main

sys.exit(main())
