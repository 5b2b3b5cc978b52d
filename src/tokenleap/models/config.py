"""Architecture description shared by all weight loaders and model implementations.

A frozen record of the hyper-parameters of a decoder-only transformer in the Llama family
(Touvron et al., 2023): RMSNorm, rotary position embeddings (Su et al., 2021), grouped-query
attention (Ainslie et al., 2023) and a SwiGLU MLP. Loaders fill it from GGUF metadata or a
Hugging Face `config.json`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenleap.errors import TokenleapError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise TokenleapError(
                f"architecture {self.architecture!r} is not supported by the native runtime yet "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if self.num_heads % self.num_kv_heads:
            raise TokenleapError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise TokenleapError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = d * (self.q_size + 2 * self.kv_size) + self.q_size * d + 3 * d * f + 2 * d
        emb = v * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + d

    def bytes_per_token(self, element_size: int) -> int:
        """Bytes of weights streamed by one decode step (every weight except the embedding
        table rows that are not looked up; the LM head is read in full)."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = d * (self.q_size + 2 * self.kv_size) + self.q_size * d + 3 * d * f + 2 * d
        return element_size * (self.num_layers * per_layer + v * d + d)
