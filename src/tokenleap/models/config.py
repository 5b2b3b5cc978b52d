"""Architecture description shared by all weight loaders and model implementations.

A frozen record of the hyper-parameters of a decoder-only transformer in the Llama family
(Touvron et al., 2023): RMSNorm, rotary position embeddings (Su et al., 2021), grouped-query
attention (Ainslie et al., 2023) and a SwiGLU MLP, plus the variations of its descendants:
Llama 3.x frequency-dependent RoPE scaling, Qwen2's Q/K/V biases, Qwen3's QK-norm, Mistral's
sliding-window attention (Beltagy et al., 2020), and Gemma 3 (Gemma Team, 2025): scaled
embeddings, QK-norm, pre- and post-norms, GeGLU, interleaved local (sliding-window, own rope
base) and global layers, final logit soft-capping. Loaders fill it from GGUF metadata or a
Hugging Face `config.json`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenleap.errors import TokenleapError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x ("llama3") frequency-dependent scaling of the rotary frequencies."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int


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
    rope_scaling: RopeScaling | None = None
    # linear rope scaling (transformers' "linear", GGUF rope.scaling.type linear): the rotary
    # frequencies divided by this factor, on the layers with `rope_scaling` (Gemma 3 4B+: global layers only)
    rope_linear_factor: float = 1.0
    # GGUF `rope_freqs`: per-frequency divisors of the rotary frequencies (llama.cpp's form of
    # Llama 3.x scaling), as a tuple of head_dim / 2 floats
    rope_freq_factors: tuple[float, ...] | None = None
    qk_norm: bool = False  # RMSNorm over each head of Q and K before RoPE (Qwen3, Gemma 3)
    sliding_window: int | None = None  # local layers attend to the last `sliding_window` positions
    # which layers are local (sliding-window); None with a window: all of them (Mistral)
    sliding_layers: tuple[bool, ...] | None = None
    rope_local_theta: float | None = None  # local layers' rope base (Gemma 3: 10k)
    # Gemma 3 specifics
    embed_scale: float = 1.0  # embeddings are multiplied by this (Gemma: sqrt(hidden_size))
    post_norms: bool = False  # RMSNorm on the attention and MLP outputs before the residual adds
    activation: str = "silu"  # GLU gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    query_scale: float | None = None  # attention scale (None: head_dim ** -0.5)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)

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
        if self.activation not in ("silu", "gelu_tanh"):
            raise TokenleapError(f"MLP activation {self.activation!r} is not supported (supported: silu, gelu_tanh)")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise TokenleapError(
                f"sliding_layers names {len(self.sliding_layers)} layers, the model has {self.num_layers}"
            )
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise TokenleapError(
                f"rope_freqs has {len(self.rope_freq_factors)} factors, expected head_dim / 2 = {self.head_dim // 2}"
            )

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        """Inverse of `dataclasses.asdict` (after a JSON round trip)."""
        raw = dict(raw)
        if raw.get("rope_scaling") is not None:
            raw["rope_scaling"] = RopeScaling(**raw["rope_scaling"])
        for key in ("rope_freq_factors", "sliding_layers"):
            if raw.get(key) is not None:
                raw[key] = tuple(raw[key])
        return cls(**raw)

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends through the sliding window."""
        if self.sliding_window is None:
            return False
        return True if self.sliding_layers is None else self.sliding_layers[layer]

    @property
    def fused_layers(self) -> bool:
        """Whether the fused kernel path (kernels/forward.h) can run the model's block: every
        variation here (biases, QK-norm, post-norms, GeGLU, sliding-window layers with their own
        rope tables, scaled embeddings), a query scale where QK-norm carries it (Gemma 3)."""
        return self.query_scale is None or self.qk_norm

    @property
    def plain_llama(self) -> bool:
        """Whether the model is a plain Llama block (the fused kernel path serves it as is)."""
        return not (
            self.qk_norm or self.sliding_window is not None or self.post_norms or self.activation != "silu"
            or self.embed_scale != 1.0 or self.query_scale is not None
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = (
            d * (self.q_size + 2 * self.kv_size) + self.q_size * d + 3 * d * f + (4 if self.post_norms else 2) * d
        )
        per_layer += 2 * self.head_dim if self.qk_norm else 0
        emb = v * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + d

    def bytes_per_token(self, element_size: int) -> int:
        """Bytes of weights streamed by one decode step (every weight except the embedding
        table rows that are not looked up; the LM head is read in full)."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = d * (self.q_size + 2 * self.kv_size) + self.q_size * d + 3 * d * f + 2 * d
        return element_size * (self.num_layers * per_layer + v * d + d)
