"""torch's OpenMP wait policy, set for torch without touching the host's environment.

Imported first by `tokenleap/__init__.py`, before torch loads its OpenMP runtime (used here for
prompt prefill only; the decode kernels have their own spin-then-yield-then-sleep pool, see
kernels/pool.h): threads that busy-wait between ops collapse throughput 3-10x when another process
shares the cores, and prefill's few large ops pay little for sleeping. libgomp reads
OMP_WAIT_POLICY once, as torch loads it, so the variable is set to passive for that moment only
(an explicit setting in the environment wins) and the caller's environment is then put back:
child processes inherit the caller's policy (a llama.cpp started from such a process with passive
decoded at ~0.7x). A program that imported torch before tokenleap keeps libgomp's default; the
engine runs its steps on one torch thread for that reason (`tokenleap.threads`).
"""

from __future__ import annotations

import os

_caller = os.environ.get("OMP_WAIT_POLICY")
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
try:
    import torch  # noqa: F401  (its OpenMP runtime reads the policy now)
finally:
    if _caller is None:
        del os.environ["OMP_WAIT_POLICY"]
