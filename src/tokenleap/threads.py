"""Torch's intra-op thread count beside the kernels' own thread pool.

The compiled kernels run the heavy ops of a forward on their own pool (`kernels/pool.h`: spin,
then yield, then sleep). The general model path (Gemma 3, Qwen3, Mistral) runs many small torch
ops between kernel calls (norms, activations, float32 attention rows for head_dim 256), and with more
than one torch thread each of them may open an OpenMP region whose workers must be woken while
the kernels' pool still holds the cores: a softmax and a product beside a kernel linear took 17 us
with one torch thread and 394 us with two on a busy 2-core machine. So those forwards run torch
single-threaded, every decode and verify forward alike (plain and speculative decoding compute
the same way), and a torch GEMM prefill gets the threads back. The engine runs each whole step
(drafting, sampling, verification) with one torch thread when the kernels are on
(`Engine._step_threads`): `tokenleap/__init__.py` sets OMP_WAIT_POLICY=passive, but a program
that imported torch first has libgomp's default policy, whose workers spin for milliseconds
after each parallel region and took the kernels' cores: plain decoding of the default model ran
at 86-93 tok/s against 190-214 with one torch thread (session 10, quiet machine; with torch
imported after tokenleap one thread is as fast as two, within noise).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with `n` torch intra-op threads (None: leave the setting alone)."""
    old = torch.get_num_threads()
    if n is None or n == old:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
