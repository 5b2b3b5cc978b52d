"""Settings of a Ray Serve deployment of tokenleap: one frozen, validated record (`RayServeConfig`).

How many engine replicas (fixed, or autoscaled between `min_replicas` and `max_replicas` on Ray
Serve's `target_ongoing_requests`), how many threads each replica's model uses (default: the
machine's cores split evenly between replicas), whether replicas share drafter statistics, and
which Ray cluster to join.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tokenleap.errors import TokenleapError


@dataclass(frozen=True)
class RayServeConfig:
    replicas: int = 2  # fixed replica count (the initial one when autoscaling)
    min_replicas: int | None = None  # autoscaling: set min and/or max to let Ray Serve scale
    max_replicas: int | None = None
    target_ongoing_requests: float = 4.0  # autoscaling target per replica
    max_ongoing_requests: int | None = None  # per replica; default: the server's max_num_seqs + max_queue
    threads_per_replica: int | None = None  # default: cpu count // replicas (at least 1)
    share_stats: bool = True  # replicas' drafters learn from every replica's answers
    share_queue: int = 1024  # answers the sharing hub keeps (oldest dropped first)
    share_period: float = 0.5  # seconds between a replica's pulls of others' answers
    ray_address: str | None = None  # join this cluster ("auto", "ray://host:10001", ...); None: local
    app_name: str = "tokenleap"
    route_prefix: str = "/"

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise TokenleapError(f"--replicas must be >= 1, got {self.replicas}")
        lo, hi = self.min_replicas, self.max_replicas
        if lo is not None and lo < 0:
            raise TokenleapError(f"--min-replicas must be >= 0, got {lo}")
        if hi is not None and hi < 1:
            raise TokenleapError(f"--max-replicas must be >= 1, got {hi}")
        if lo is not None and hi is not None and lo > hi:
            raise TokenleapError(f"--min-replicas ({lo}) is above --max-replicas ({hi})")
        if self.target_ongoing_requests <= 0:
            raise TokenleapError(f"--target-ongoing-requests must be > 0, got {self.target_ongoing_requests}")
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < 1:
            raise TokenleapError(f"max_ongoing_requests must be >= 1, got {self.max_ongoing_requests}")
        if self.threads_per_replica is not None and self.threads_per_replica < 1:
            raise TokenleapError(f"threads per replica must be >= 1, got {self.threads_per_replica}")
        if self.share_queue < 1 or self.share_period <= 0:
            raise TokenleapError("share_queue must be >= 1 and share_period > 0")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    def autoscaling_config(self) -> dict[str, float | int] | None:
        if not self.autoscaling:
            return None
        lo = self.min_replicas if self.min_replicas is not None else 1
        hi = self.max_replicas if self.max_replicas is not None else max(lo, self.replicas)
        return {"min_replicas": lo, "max_replicas": hi, "initial_replicas": min(max(self.replicas, lo), hi),
                "target_ongoing_requests": self.target_ongoing_requests}

    def threads(self) -> int:
        """Threads of one replica's model: given, else this machine's cores split between replicas."""
        if self.threads_per_replica is not None:
            return self.threads_per_replica
        n = self.max_replicas if self.max_replicas is not None else self.replicas
        return max(1, (os.cpu_count() or 1) // max(1, n))
