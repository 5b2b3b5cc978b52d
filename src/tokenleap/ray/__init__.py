"""tokenleap on Ray (the `ray` extra): replicated OpenAI serving on Ray Serve (`deployment`,
`tokenleap serve --replicas N`), prefix/session affinity routing (`router`), drafter statistics
shared across replicas (`sharing`) and batch inference with Ray Data (`build_processor`).

Nothing in tokenleap imports this package; importing it without Ray installed raises a
`TokenleapError` naming the extra.
"""

from __future__ import annotations

from typing import Any

from tokenleap.errors import TokenleapError

try:
    import ray  # noqa: F401
    from ray import serve  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise TokenleapError(f"tokenleap.ray needs the 'ray' extra (pip install 'tokenleap[ray]'): {exc}") from None

from tokenleap.ray.config import RayServeConfig


def deployment(*args: Any, **kwargs: Any) -> Any:
    """See `tokenleap.ray.serve.deployment`."""
    from tokenleap.ray.serve import deployment as _deployment

    return _deployment(*args, **kwargs)


def build_processor(*args: Any, **kwargs: Any) -> Any:
    """See `tokenleap.ray.data.build_processor`."""
    from tokenleap.ray.data import build_processor as _build

    return _build(*args, **kwargs)


__all__ = ["RayServeConfig", "build_processor", "deployment"]
