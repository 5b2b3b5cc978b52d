"""Server settings: one frozen, validated record (`ServerConfig`) built by the CLI or by tests.

Every knob of `tokenleap serve` lives here (address, API key, batching and queue bounds,
timeouts, body size limit), validated in `__post_init__` with a `TokenleapError` naming the
option, the same way `tokenleap.config` validates the engine's settings.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenleap.config import DEFAULT_MAX_NUM_SEQS, MAX_DRAFT_TOKENS
from tokenleap.errors import TokenleapError

API_KEY_ENV = "TOKENLEAP_API_KEY"


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless asked otherwise
    port: int = 8000
    api_key: str | None = None  # Bearer token required on every route but /health (and /metrics, unless below)
    metrics_api_key_required: bool = False  # /metrics behind the API key too (Prometheus scrapers often have none)
    served_model_name: str | None = None  # default: the model argument given to LLM
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS  # requests running (holding a KV cache) at once, as LLM(max_num_seqs=...)
    max_queue: int = 64  # requests waiting for a batch slot; one more gets 429
    timeout: float | None = None  # seconds from arrival to the last token; None: no limit
    max_request_bytes: int = 1 << 20  # request body limit (413 above)
    shutdown_timeout: float = 10.0  # seconds in-flight requests get to finish on shutdown
    # the largest num_speculative_tokens a request may ask for (default: the server's own cap, else
    # 16); the cost curve is measured for it at start, so serving never stops to measure one
    max_num_speculative_tokens: int | None = None
    max_spec_configs: int = 32  # drafters kept for per-request speculative configs (least recently used let go)
    log_requests: bool = False  # one INFO line per finished request, with speculation stats
    # how JSON schemas (response_format, guided_json, tool arguments) are read: "strict" admits no
    # property a schema does not declare (unless it says additionalProperties) and bounds
    # whitespace; "lenient" reads them as JSON Schema does. A request may name its own
    # (`json_schema_mode`).
    json_schema_mode: str = "strict"
    log_level: str = "info"  # uvicorn's log level

    def __post_init__(self) -> None:
        if not self.host:
            raise TokenleapError("host must not be empty")
        if not 0 <= self.port <= 65535:
            raise TokenleapError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise TokenleapError("the API key must not be empty")
        if isinstance(self.max_num_seqs, bool) or not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise TokenleapError(f"max_num_seqs must be >= 1, got {self.max_num_seqs!r}")
        if self.max_queue < 0:
            raise TokenleapError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.timeout is not None and self.timeout <= 0:
            raise TokenleapError(f"timeout must be > 0 seconds (or None for no limit), got {self.timeout}")
        if self.max_request_bytes < 1024:
            raise TokenleapError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.shutdown_timeout < 0:
            raise TokenleapError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.max_num_speculative_tokens is not None and not 1 <= self.max_num_speculative_tokens <= MAX_DRAFT_TOKENS:
            raise TokenleapError(
                f"max_num_speculative_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {self.max_num_speculative_tokens}"
            )
        if self.max_spec_configs < 1:
            raise TokenleapError(f"max_spec_configs must be >= 1, got {self.max_spec_configs}")
        if self.json_schema_mode not in ("strict", "lenient"):
            raise TokenleapError(f"json_schema_mode must be 'strict' or 'lenient', got {self.json_schema_mode!r}")
        levels = ("critical", "error", "warning", "info", "debug", "trace")
        if self.log_level not in levels:
            raise TokenleapError(f"log_level must be one of {', '.join(levels)}, got {self.log_level!r}")
