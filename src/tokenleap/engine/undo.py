"""Undoing a request's part of a failed step, so that one request's failure (a drafter that
raises, a verification that fails) does not take the requests batched with it down.

A step changes a request in two stages: before its commit, only its KV cache (the forward writes
the draft rows past `length`), its random generator (a sampling drafter and the verifier draw
from it) and its draft controller; the commit then tells the drafter and appends tokens. `Undo`
records the first three before the step and `roll_back` restores them, which leaves the request
exactly as it was (O(1): the cache only moves its length back).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenleap.engine.request import Request
from tokenleap.engine.speculation import DraftController


class StepFailures(Exception):
    """Some requests of a batched step failed: each was rolled back to its state before the step;
    the other requests of the batch were stepped."""

    def __init__(self, failures: list[tuple[Request, Exception]]) -> None:
        super().__init__("; ".join(f"{req.request_id}: {type(exc).__name__}: {exc}" for req, exc in failures))
        self.failures = failures


@dataclass(frozen=True)
class Undo:
    """What a step changes in a request before its commit: the cache length, the generator
    (verification and a sampling drafter draw from it) and the draft controller."""

    kv_length: int
    generator_state: torch.Tensor | None
    controller: DraftController | None

    @staticmethod
    def of(req: Request) -> Undo:
        state = None if req.params.greedy else req.generator.get_state()
        ctrl = dataclasses.replace(req.controller) if req.controller is not None else None
        return Undo(req.kv.length, state, ctrl)


def roll_back(reqs: Sequence[Request], undo: Sequence[Undo]) -> None:
    """Restore each request to its `Undo` record."""
    for req, u in zip(reqs, undo):
        if req.kv.length > u.kv_length:
            req.kv.truncate(u.kv_length)
        if u.generator_state is not None:
            req.generator.set_state(u.generator_state)
        req.controller = dataclasses.replace(u.controller) if u.controller is not None else None
