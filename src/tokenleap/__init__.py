"""tokenleap: a speculative-decoding inference engine for large language models.

Public API: `LLM`, `SamplingParams`, `EngineConfig`, `SpecConfig`, `TokenleapError`;
`register_method` and `MethodRecord` add a speculative method (tokenleap.drafters.registry,
tokenleap.drafters.methods).
"""

from tokenleap import _omp_policy  # noqa: F401  (first: torch's OpenMP runtime reads its wait policy as it loads)
from tokenleap._version import __version__
from tokenleap.config import EngineConfig
from tokenleap.drafters.methods import MethodRecord
from tokenleap.drafters.registry import register_method
from tokenleap.drafters.spec import SpecConfig
from tokenleap.errors import TokenleapError
from tokenleap.llm import LLM
from tokenleap.sampling import SamplingParams
from tokenleap.types import CompletionOutput, RequestOutput

__all__ = [
    "LLM", "SamplingParams", "EngineConfig", "SpecConfig", "TokenleapError", "RequestOutput", "CompletionOutput",
    "MethodRecord", "register_method", "__version__"
]
