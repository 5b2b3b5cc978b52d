"""tokenleap: a speculative-decoding inference engine for large language models.

Public API: `LLM`, `SamplingParams`, `EngineConfig`, `TokenleapError`.
"""

from tokenleap.config import EngineConfig
from tokenleap.errors import TokenleapError
from tokenleap.llm import LLM
from tokenleap.sampling import SamplingParams
from tokenleap.types import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "EngineConfig", "TokenleapError", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
