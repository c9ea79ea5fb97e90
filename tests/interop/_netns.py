"""Running an interop script in a private network namespace (Dynamo's planes bind addresses of
their own choosing): used by the test files that start Dynamo's processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path


def netns_missing() -> str | None:
    """Why a private network namespace cannot be made here (None: it can)."""
    if shutil.which("unshare") is None or shutil.which("ip") is None or os.geteuid() != 0:
        return "needs root, unshare and ip for a private network namespace"
    return None


def run_in_netns(script: Path, *args: object) -> dict:
    """``script args...`` in its own network namespace (loopback up); its last stdout line, the
    JSON tallies. Fails the test with the script's stderr when it fails."""
    run = subprocess.run(
        ["unshare", "-n", "sh", "-c",
         f"ip link set lo up && exec {sys.executable} {script} "
         + " ".join(str(a) for a in args)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "DYN_LOG": "error"})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
