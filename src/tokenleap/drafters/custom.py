"""Method `custom`: a user's object implementing the Drafter protocol, passed in
`speculative_config['drafter']` (library only; keyed by the object's identity)."""

from __future__ import annotations

from typing import Any

from tokenleap.drafters.base import Drafter, check_drafter
from tokenleap.drafters.methods import MethodRecord


def _build(config: Any, **_: Any) -> Drafter:
    return check_drafter(config.drafter)


METHOD = MethodRecord(
    "custom",
    _build,
    "any object with begin/propose/accept/end (tokenleap.drafters.base.Drafter), in speculative_config['drafter']",
    fields=("drafter",),
    per_request=False,
    doc=(
        "any object with `begin/propose/accept/end` (`tokenleap.drafters.base.Drafter`); its `Draft` may be a token "
        "tree (`parents`), verified as a tree for greedy and sampled requests"
    ),
    knobs="`drafter`",
)
