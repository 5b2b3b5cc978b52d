"""What every draft head is, and the toolkit they share.

A draft head is one small decoder layer over the target's own hidden states. `DraftHead` is what a
head offers the drafter that runs it (`drafters/head_drafter.HeadDrafter`): the target layers it
reads (`hidden_layers`, `FINAL_HIDDEN` = the final normed state), how it turns the rows of a
target forward into features (`aux_from`, then `fuse`), one step of its layer over its own KV cache
(`layer`, `HeadKV`) and its logits over its draft vocabulary (`logits`, `d2t_list` mapping draft ids
to target ids); `measure_step_cost` gives its draft cost relative to a target step. EAGLE-3
(`eagle3.py`, its llama.cpp GGUF in `eagle3_gguf.py`), EAGLE-1/2 (`eagle1.py`) and MTP layers
(`mtp.py`) are DraftHeads; Medusa's parallel heads (`medusa.py`) read the same final state but
draft without a layer of their own, so their drafter is their own.

The toolkit: `HeadShape` (the shape of a head's layer), `head_rope`, `head_linear` (a head's
linear as one `Linear`: in the target's dtype, packed or quantized for the kernels), `linear_on`
(running one on the kernels or torch), `HeadKV` (a request's head
cache), and `LayerHead`, the base class that holds a head's target, kernels and rotary tables and
the pieces of its layer (linear, RMS norm, rotary, grouped-query attention through `o_proj`);
`FinalHiddenHead` is the base of the heads whose feature is the target's final hidden state and
whose logits are the target's LM head (EAGLE-1/2, MTP). `train/` builds its trainable heads on the
same `HeadShape` and `head_rope`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from tokenleap.errors import TokenleapError
from tokenleap.kernels import CpuKernels, Linear, QuantWeight
from tokenleap.models.base import CausalLM

FINAL_HIDDEN = -1  # `hidden_layers` id of the target's final (normed) hidden state


@dataclass(frozen=True)
class HeadShape:
    """The shape of a head's decoder layer and of what it reads: `aux_layers` are the target
    layers whose inputs EAGLE-3 fuses (() for heads over the final hidden state), `vocab_size` the
    target's vocabulary, `draft_vocab_size` the head's (smaller when it maps ids by `d2t`)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position: int = 8192
    norm_before_residual: bool = False


def head_rope(theta: float, head_dim: int, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[positions, head_dim]` (NeoX half-split layout, float64 angles) of a draft head."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, dtype=torch.float64) / half))
    angles = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)
    return torch.cat([angles.cos(), angles.cos()], dim=-1).float(), torch.cat(
        [angles.sin(), angles.sin()], dim=-1
    ).float()


HEAD_QTYPE = 8  # GGML type of a head's linears beside a quantized target (Q8_0)


def head_linear(weights: dict[str, torch.Tensor], names: Sequence[str], dtype: torch.dtype, kernels: CpuKernels | None,
                quantize: bool = False) -> Linear:
    """The (fused) weight of a draft head's linear in the target's dtype, packed for the kernels
    when they take it; with `quantize` (a target whose linears are kept in their GGUF blocks),
    in Q8_0 blocks instead: half the bytes a draft step reads, and a draft step on a CPU is as
    memory-bound as the target's (drafts only propose: the output stays the target's)."""
    w = torch.cat([weights[n] for n in names]).to(dtype).contiguous()
    if kernels is not None and quantize:
        out_dim, in_dim = w.shape
        if QuantWeight.fits(HEAD_QTYPE, out_dim, in_dim):
            import gguf

            blocks = gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType(HEAD_QTYPE))
            return Linear(QuantWeight.from_blocks(blocks, HEAD_QTYPE, out_dim, in_dim))
    return kernels.prepare(w) if kernels is not None else Linear(w)


def linear_on(kernels: CpuKernels | None, x: torch.Tensor, w: Linear, b: torch.Tensor | None = None) -> torch.Tensor:
    """A head's linear `x @ w.T + b` (fp32 out) on the target's kernels, or in torch in `w`'s dtype."""
    if kernels is not None:
        return kernels.linear(x.contiguous(), w, b)
    t = w.dense()
    y = F.linear(x.to(t.dtype), t).float()
    return y + b if b is not None else y


class HeadKV:
    """The head's K/V for one request: `length` slots, growable, truncatable in O(1)."""

    def __init__(self, kv_heads: int, head_dim: int, capacity: int = 256) -> None:
        self.k = torch.empty(capacity, kv_heads, head_dim)
        self.v = torch.empty(capacity, kv_heads, head_dim)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[0]
        if self.length + n > self.k.shape[0]:
            cap = max(2 * self.k.shape[0], self.length + n)
            for name in ("k", "v"):
                old = getattr(self, name)
                new = torch.empty(cap, *old.shape[1:])
                new[: self.length] = old[: self.length]
                setattr(self, name, new)
        self.k[self.length : self.length + n] = k
        self.v[self.length : self.length + n] = v
        self.length += n

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[: self.length], self.v[: self.length]

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


@runtime_checkable
class DraftHead(Protocol):
    """What a draft head offers the drafter that runs it (chains or EAGLE-2 trees)."""

    config: HeadShape
    target: CausalLM  # the model whose hidden states it reads (embedding, LM head, forward for timing)
    hidden_layers: tuple[int, ...]  # target layer outputs it reads; FINAL_HIDDEN = the final normed state
    d2t_list: list[int]  # draft vocabulary id -> target id

    def aux_from(self, token_ids: Sequence[int], hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """The raw feature rows [n, *] of a target forward's positions (its `hidden_layers` rows)."""
        ...

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """Raw rows -> the head's features g [n, H] (deferred by the drafter until a draft needs them)."""
        ...

    def embed_tokens(self, ids: Sequence[int]) -> torch.Tensor:
        """Token embeddings [n, H] as the head reads them."""
        ...

    def layer(
        self, g: torch.Tensor, e: torch.Tensor, positions: torch.Tensor, kv: HeadKV, visible: torch.Tensor
    ) -> torch.Tensor:
        """One head step over n rows (features g, embeddings e of the next tokens): the rows' K/V
        are appended to `kv`, `visible` [n, kv.length + n] says which slots each row sees; returns
        the outputs, which are the next step's features."""
        ...

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [n, Vd] of outputs h."""
        ...


class LayerHead:
    """The base of the one-decoder-layer heads: the target, its kernels, the shape, the rotary
    tables, and the pieces of a layer. A subclass validates its checkpoint, calls this
    `__init__`, sets `wqkv` / `wo` (and `bqkv` when its attention has biases) and writes `layer`."""

    kind: ClassVar[str] = "draft"  # what error messages call the head
    wqkv: Linear
    wo: Linear
    bqkv: torch.Tensor | None = None
    hidden_layers: tuple[int, ...]
    d2t_list: list[int]

    def __init__(self, config: HeadShape, target: CausalLM, embed: torch.Tensor | None = None) -> None:
        self.config = config
        self.target = target
        self.kernels = target.kernels
        self.embed = embed if embed is not None else target.embed  # the target's: shared, not copied
        self._cos, self._sin = head_rope(
            config.rope_theta, config.head_dim, max(config.max_position, target.config.max_position) + 64
        )

    def _linear(self, x: torch.Tensor, w: Linear, b: torch.Tensor | None = None) -> torch.Tensor:
        return linear_on(self.kernels, x, w, b)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.config.rms_norm_eps)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [n, heads, hd], NeoX half-split rotary at `positions`."""
        if int(positions.max()) >= self._cos.shape[0]:
            raise TokenleapError(f"{self.kind} head positions must be below {self._cos.shape[0]}")
        cos, sin = self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def _attention(self, x: torch.Tensor, positions: torch.Tensor, kv: HeadKV, visible: torch.Tensor) -> torch.Tensor:
        """Self-attention of the rows `x` over the head's cache (their K/V appended; `visible`
        [n, kv.length + n] the slots each row sees), through o_proj."""
        c = self.config
        n = x.shape[0]
        qkv = self._linear(x, self.wqkv, self.bqkv)
        qs, ks = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q = self._rope(qkv[:, :qs].view(n, c.num_heads, c.head_dim), positions)
        k = self._rope(qkv[:, qs : qs + ks].view(n, c.num_kv_heads, c.head_dim), positions)
        kv.append(k, qkv[:, qs + ks :].view(n, c.num_kv_heads, c.head_dim))
        keys, values = kv.view()  # [S, kvh, hd]
        kvh, rep, hd = c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim
        # grouped-query attention: query head j reads KV head j // rep
        qg = q.view(n, kvh, rep, hd).permute(1, 0, 2, 3).reshape(kvh, n * rep, hd)
        scores = torch.matmul(qg, keys.permute(1, 2, 0)) * (1.0 / math.sqrt(hd))  # [kvh, n*rep, S]
        mask = visible.unsqueeze(1).expand(n, rep, visible.shape[-1]).reshape(n * rep, -1)
        # [kvh, n*rep, hd]
        a = torch.matmul(scores.masked_fill(~mask, float("-inf")).softmax(dim=-1), values.transpose(0, 1))
        a = a.view(kvh, n, rep, hd).permute(1, 0, 2, 3).reshape(n, qs)
        return self._linear(a, self.wo)

    def embed_tokens(self, ids: Sequence[int]) -> torch.Tensor:
        return F.embedding(torch.tensor(list(ids), dtype=torch.long), self.embed).float()


def final_hidden_shape(raw: dict[str, Any], target_config: Any, what: str, rms_norm_eps: float = 1e-5) -> HeadShape:
    """The shape of a layer over the target's final hidden state (EAGLE-1/2, MTP) from its
    Llama-style config.json: the target's hidden size and full vocabulary, no aux layers."""
    tc = target_config
    try:
        h = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        return HeadShape(
            hidden_size=h,
            intermediate_size=int(raw["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads", heads)),
            head_dim=int(raw.get("head_dim") or h // heads),
            vocab_size=int(raw.get("vocab_size", tc.vocab_size)),
            draft_vocab_size=tc.vocab_size,
            target_hidden_size=h,
            aux_layers=(),
            rms_norm_eps=float(raw.get("rms_norm_eps", rms_norm_eps)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            max_position=int(raw.get("max_position_embeddings", tc.max_position)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise TokenleapError(f"{what} config.json is missing or has a bad field: {exc}") from exc


class FinalHiddenHead(LayerHead):
    """A layer head whose feature is the target's final (normed) hidden state and whose logits
    are the target's own LM head over the full vocabulary (EAGLE-1/2, MTP)."""

    def __init__(self, config: HeadShape, target: CausalLM, embed: torch.Tensor | None = None) -> None:
        super().__init__(config, target, embed)
        self.d2t_list = list(range(config.vocab_size))
        self.hidden_layers = (FINAL_HIDDEN,)

    def aux_from(self, token_ids: Sequence[int], hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        return hidden[FINAL_HIDDEN].float()

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        return aux  # the feature is the target's final hidden state itself

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The target's LM head on the head's output, full vocabulary."""
        return self.target.compute_logits(h)


def measure_step_cost(head: DraftHead, context: int = 64, repeats: int = 5) -> float:
    """One head draft step (a row through the layer and the draft LM head) relative to a 1-row
    target forward with its LM head, both at `context` cached tokens: the fastest of `repeats`."""
    target = head.target
    c = head.config
    context = max(1, min(context, target.max_context - 2, c.max_position - 2))
    with torch.inference_mode():
        kv = target.new_kv_cache(context + 2)
        target.forward(torch.arange(context) % c.vocab_size, torch.arange(context), kv)
        hkv = HeadKV(c.num_kv_heads, c.head_dim, context + 2)
        head.layer(torch.zeros(context, c.hidden_size), head.embed_tokens([1] * context), torch.arange(context), hkv,
                   torch.ones(context, context, dtype=torch.bool).tril())
        h = torch.zeros(1, c.hidden_size)
        best_t = best_h = float("inf")
        for _ in range(repeats + 1):
            kv.truncate(context)
            t0 = time.perf_counter()
            target.compute_logits(target.forward(torch.tensor([1]), torch.tensor([context]), kv).hidden)
            t1 = time.perf_counter()
            hkv.truncate(context)
            head.logits(head.layer(h, head.embed_tokens([1]), torch.tensor([context]), hkv,
                                   torch.ones(1, context + 1, dtype=torch.bool)))
            t2 = time.perf_counter()
            best_t, best_h = min(best_t, t1 - t0), min(best_h, t2 - t1)
        kv.free()
    return best_h / best_t
