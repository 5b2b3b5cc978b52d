"""tokenleap: a speculative-decoding inference engine for large language models.

Public API: `LLM`, `SamplingParams`, `EngineConfig`, `TokenleapError`; `register_method` and
`MethodRecord` add a speculative method (tokenleap.drafters.methods).
"""

import os

# Before torch loads its OpenMP runtime (used here for prompt prefill only; the decode kernels
# have their own spin-then-yield-then-sleep pool, see kernels.c): threads that busy-wait
# between ops collapse throughput 3-10x when another process shares the cores, and prefill's
# few large ops pay little for sleeping. An explicit setting in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

from tokenleap.config import EngineConfig
from tokenleap.drafters.methods import MethodRecord, register_method
from tokenleap.errors import TokenleapError
from tokenleap.llm import LLM
from tokenleap.sampling import SamplingParams
from tokenleap.types import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "EngineConfig", "TokenleapError", "RequestOutput", "CompletionOutput", "MethodRecord", "register_method"]
__version__ = "0.1.0"
