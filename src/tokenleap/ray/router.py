"""Session / prefix affinity routing for Ray Serve (its custom request-router interface,
`ray.serve.request_router.RequestRouter.choose_replicas`).

The ingress computes an affinity key per request (`affinity_key`): the `x-session-id` header
when the client sends one, else a hash of the conversation's first messages (chat) or of the
prompt's first characters (completions), so the turns of one conversation share a key. The key
is the first argument of the call to the engine replicas, where `AffinityRouter` reads it.

For a key the router prefers, in order: the replica that served the key last (its per-request
caches and drafter state are warm), else the replica the key hashes to (rendezvous hashing,
Thaler & Ravishankar 1998, which moves few keys when replicas come and go). If that replica is
full (its queue length at `max_ongoing_requests`) the next rank is two random replicas, of
which Ray Serve takes the less loaded (power of two choices, Mitzenmacher 2001). Requests
without a key go straight to power of two choices.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

SESSION_HEADER = "x-session-id"
MAX_REMEMBERED = 65536  # keys whose last replica the router remembers (least recently used let go)
_PREFIX_MESSAGES = 2  # a conversation's first messages: system prompt and first user turn
_PREFIX_CHARS = 512


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=12).hexdigest()


def affinity_key(path: str, headers: Mapping[str, str], body: bytes) -> str | None:
    """The request's affinity key (None: route by load only)."""
    session = headers.get(SESSION_HEADER)
    if session:
        return "s:" + session[:256]
    if not path.endswith(("/chat/completions", "/completions")) or not body:
        return None
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    messages = obj.get("messages")
    if isinstance(messages, list) and messages:
        return "m:" + _digest(json.dumps(messages[:_PREFIX_MESSAGES], sort_keys=True, default=str))
    prompt = obj.get("prompt")
    if isinstance(prompt, str) and prompt:
        return "p:" + _digest(prompt[:_PREFIX_CHARS])
    if isinstance(prompt, list) and prompt:
        return "p:" + _digest(json.dumps(prompt[:_PREFIX_CHARS], default=str))
    return None


def rendezvous(key: str, replica_ids: list[str]) -> str:
    """The replica id `key` hashes to (highest random weight)."""
    return max(replica_ids, key=lambda rid: hashlib.blake2b(f"{key}|{rid}".encode(), digest_size=8).digest())


def key_of(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None or not pending_request.args:
        return None
    key = pending_request.args[0]
    return key if isinstance(key, str) and key else None


class AffinityRouter(RequestRouter):
    """See the module docstring."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._last: OrderedDict[str, ReplicaID] = OrderedDict()

    def _remember(self, key: str, replica_id: ReplicaID) -> None:
        last = getattr(self, "_last", None)
        if last is None:
            self.initialize_state()
            last = self._last
        last[key] = replica_id
        last.move_to_end(key)
        while len(last) > MAX_REMEMBERED:
            last.popitem(last=False)

    def preferred(self, key: str, candidates: list[RunningReplica]) -> RunningReplica:
        by_id = {r.replica_id: r for r in candidates}
        last = getattr(self, "_last", {}).get(key)
        if last in by_id:
            return by_id[last]
        chosen = rendezvous(key, sorted(r.replica_id.unique_id for r in candidates))
        return next(r for r in candidates if r.replica_id.unique_id == chosen)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ranks: list[list[RunningReplica]] = []
        key = key_of(pending_request)
        if key is not None:
            first = self.preferred(key, candidate_replicas)
            if self.select_available_replicas([first]):
                ranks.append([first])
        others = candidate_replicas if len(candidate_replicas) <= 2 else random.sample(candidate_replicas, 2)
        ranks.append(list(others))
        return ranks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        key = key_of(pending_request)
        if key is not None:
            self._remember(key, replica_id)
