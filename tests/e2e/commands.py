"""The sdflow command line as the e2e tests start it: this interpreter running sdflow.cli."""

from __future__ import annotations

import sys

SDFLOW = [sys.executable, "-m", "sdflow.cli"]
