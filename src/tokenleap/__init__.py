"""tokenleap: a speculative-decoding inference engine for large language models.

Public API: `LLM`, `SamplingParams`, `EngineConfig`, `TokenleapError`.
"""

import os

# Before torch loads its OpenMP runtime (which tokenleap's kernels share): threads that
# busy-wait between ops collapse throughput ~5-10x when another process shares the cores, and
# sleeping waiters cost little otherwise. An explicit setting in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

from tokenleap.config import EngineConfig
from tokenleap.errors import TokenleapError
from tokenleap.llm import LLM
from tokenleap.sampling import SamplingParams
from tokenleap.types import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "EngineConfig", "TokenleapError", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
