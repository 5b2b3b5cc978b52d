"""Importing tokenleap leaves its host's environment as it found it: torch's OpenMP runtime gets
OMP_WAIT_POLICY=passive as it loads, and the variable is gone again afterwards (or the caller's
own setting kept), so child processes inherit the caller's environment."""

from __future__ import annotations

import os
import subprocess
import sys

CHILD = "import os, tokenleap; print(os.environ.get('OMP_WAIT_POLICY'))"


def _import(env: dict[str, str]) -> tuple[str, str]:
    """The environment's policy after `import tokenleap`, and what the OpenMP runtime printed
    of its own settings as it loaded (OMP_DISPLAY_ENV)."""
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          env={**env, "OMP_DISPLAY_ENV": "true"}, check=True, timeout=300)
    return proc.stdout.strip(), proc.stderr


def test_import_sets_the_runtimes_policy_and_leaves_the_environment() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    after, runtime = _import(env)
    assert after == "None"
    if "OMP_WAIT_POLICY" in runtime:  # libgomp prints its settings; other runtimes may not
        assert "OMP_WAIT_POLICY = 'PASSIVE'" in runtime
    after, runtime = _import({**env, "OMP_WAIT_POLICY": "active"})
    assert after == "active"
    if "OMP_WAIT_POLICY" in runtime:
        assert "OMP_WAIT_POLICY = 'ACTIVE'" in runtime
