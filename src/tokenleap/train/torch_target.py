"""A plain-PyTorch forward of a Llama-family target on any torch device (CUDA, MPS or the CPU),
for training drafter heads off the runtime's CPU kernels: the target's aux states, final hidden
states and logits over padded batches (one forward a batch), and batched greedy generation with a
key/value cache (self-distillation; left-padded prompts, finished rows dropped as they end).

The same weights (canonical names from `models.loaders`) and the same decoder block as the
runtime's (`models.layers.decoder_layer`, run here on torch ops over padded batches): RMSNorm,
half-split rotary embeddings (Su et al., 2021; Llama 3.x / linear scaling through `rope_tables`),
grouped-query attention (Ainslie et al., 2023) via `F.scaled_dot_product_attention` over this
module's own cache, SwiGLU; Qwen2's biases and Qwen3's QK-norm. Gemma 3 and sliding-window targets
are refused with a message (their heads train on the CPU path).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from tokenleap.errors import TokenleapError
from tokenleap.kernels import Linear
from tokenleap.models.config import ModelConfig
from tokenleap.models.layers import (
    BlockOps,
    LayerWeights,
    apply_rope,
    decoder_layer,
    rms_norm,
    rope_tables,
    torch_linear,
    torch_qk_norm,
    torch_residual,
)


def check_supported(config: ModelConfig) -> None:
    """Refuse what this forward does not implement (rather than train a head on wrong features)."""
    unsupported = [
        name
        for name, bad in (
            (
                "Gemma 3 (scaled embeddings, post-norms, GeGLU, soft-capping)",
                config.architecture == "gemma3"
                or config.post_norms
                or config.embed_scale != 1.0
                or config.activation != "silu"
                or config.final_logit_softcap is not None
                or config.query_scale is not None,
            ),
            ("sliding-window attention", config.sliding_window is not None),
        )
        if bad
    ]
    if unsupported:
        raise TokenleapError(f"training on a torch device does not support {' or '.join(unsupported)} "
                             f"({config.architecture}); train this target's head on the CPU (--device cpu)")


class TorchTarget:
    """The target's weights on `device` in `dtype` (norms and rotary tables in float32)."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, max_positions: int = 4096) -> None:
        check_supported(config)
        self.config = c = config
        self.device = torch.device(device)
        self.dtype = dtype

        def w(name: str) -> torch.Tensor:
            return weights[name].to(self.device, dtype)

        def f32(name: str) -> torch.Tensor:
            return weights[name].to(self.device, torch.float32)

        def f32_opt(name: str) -> torch.Tensor | None:
            return f32(name) if name in weights else None

        self.embed = w("embed")
        self.lm_head = w("lm_head") if "lm_head" in weights and not c.tie_word_embeddings else self.embed
        self.norm = weights["norm"].to(self.device, torch.float32)
        self.layers: list[LayerWeights] = []
        for i in range(c.num_layers):
            p = f"layers.{i}."
            biases = [weights.get(p + n + "_bias") for n in ("q", "k", "v")]
            bqkv = None
            if any(b is not None for b in biases):
                sizes = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim)
                bqkv = torch.cat([b if b is not None else torch.zeros(n) for b, n in zip(biases, sizes)]).to(
                    self.device, dtype
                )
            self.layers.append(
                LayerWeights(
                    attn_norm=f32(p + "attn_norm"),
                    wqkv=Linear(
                        torch.cat([weights[p + "q"], weights[p + "k"], weights[p + "v"]]).to(self.device, dtype)
                    ),
                    bqkv=bqkv,
                    q_norm=f32_opt(p + "q_norm"),
                    k_norm=f32_opt(p + "k_norm"),
                    wo=Linear(w(p + "o")),
                    mlp_norm=f32(p + "mlp_norm"),
                    w_gate_up=Linear(torch.cat([weights[p + "gate"], weights[p + "up"]]).to(self.device, dtype)),
                    w_down=Linear(w(p + "down")),
                )
            )
        positions = min(max_positions, c.max_position)
        cos, sin = rope_tables(c, c.rope_theta, positions, scaled=True)
        self.cos, self.sin = cos.to(self.device), sin.to(self.device)

    @classmethod
    def load(cls, model: Any, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
             max_positions: int = 4096) -> TorchTarget:
        """A registered model name, a GGUF file or a Hugging Face folder (or a resolved
        `ModelSource`), dequantized to `dtype` on `device`."""
        from tokenleap.models.loaders import load_gguf, load_hf_folder
        from tokenleap.models.registry import resolve

        source = resolve(model) if isinstance(model, str) else model
        config, weights = load_gguf(source.path) if source.kind == "gguf" else load_hf_folder(source.path)
        return cls(config, weights, device, dtype, max_positions)

    @property
    def max_positions(self) -> int:
        return int(self.cos.shape[0])

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None, cache_len: int = 0,
                return_hidden: Sequence[int] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """ids / positions [B, T]; `mask` [B, T, S] (True: may attend; S = cache_len + T) or None
        for plain causal attention. With `cache` ([B, kvh, capacity, hd] per layer) the new keys
        and values are written at slots cache_len..cache_len+T-1. Returns the final normed hidden
        states [B, T, H] (float32) and the outputs of the layers in `return_hidden`."""
        c = self.config
        b, t = ids.shape
        nq, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        eps = c.rms_norm_eps
        cos = self.cos[positions].unsqueeze(2)  # [B, T, 1, hd]
        sin = self.sin[positions].unsqueeze(2)
        attn_mask = mask.unsqueeze(1) if mask is not None else None

        def attention(qkv: torch.Tensor, idx: int) -> torch.Tensor:
            q = apply_rope(qkv[..., : nq * hd].view(b, t, nq, hd), cos, sin)
            k = apply_rope(qkv[..., nq * hd : (nq + nkv) * hd].view(b, t, nkv, hd), cos, sin)
            v = qkv[..., (nq + nkv) * hd :].view(b, t, nkv, hd)
            q, k, v = (z.transpose(1, 2).to(self.dtype) for z in (q, k, v))  # [B, heads, T, hd]
            if cache is not None:
                ck, cv = cache[idx]
                ck[:, :, cache_len : cache_len + t] = k
                cv[:, :, cache_len : cache_len + t] = v
                k, v = ck[:, :, : cache_len + t], cv[:, :, : cache_len + t]
            if nkv != nq:
                k, v = k.repeat_interleave(nq // nkv, dim=1), v.repeat_interleave(nq // nkv, dim=1)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None)
            return a.transpose(1, 2).reshape(b, t, nq * hd)

        ops = BlockOps(
            lambda x, w, norm: torch_linear(x, w, norm, eps),
            lambda qkv, layer: torch_qk_norm(qkv, layer, c),
            attention,
            lambda x, y, norm: torch_residual(x, y, norm, eps),
        )
        x = F.embedding(ids, self.embed).float()
        hidden: dict[int, torch.Tensor] = {}
        for idx, layer in enumerate(self.layers):
            x = decoder_layer(x, layer, idx, c, ops)
            if idx in return_hidden:
                hidden[idx] = x
        return rms_norm(x, self.norm, eps), hidden

    def logits(self, hidden: torch.Tensor, lm_head: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits of normed hidden states (over the rows of `lm_head`, default the whole vocabulary)."""
        w = self.lm_head if lm_head is None else lm_head
        return F.linear(hidden.to(w.dtype), w).float()

    @torch.inference_mode()
    def features(self, ids: torch.Tensor, aux_layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ids [B, T] -> the aux states [B, T, 3H] (the input of each aux layer, as
        the runtime's EAGLE-3 head reads them; no aux layers: the final hidden states) and the
        final normed hidden states [B, T, H], float32. Pad rows are garbage (causal attention keeps
        them out of the real rows)."""
        b, t = ids.shape
        if t > self.max_positions:
            raise TokenleapError(f"sequence of {t} tokens is longer than the rotary tables ({self.max_positions})")
        pos = torch.arange(t, device=self.device).expand(b, t)
        need = sorted({layer - 1 for layer in aux_layers if layer > 0})
        out, states = self.forward(ids, pos, None, return_hidden=need)
        parts = [F.embedding(ids, self.embed).float() if layer == 0 else states[layer - 1] for layer in aux_layers]
        return (torch.cat(parts, dim=-1) if parts else out), out

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_ids: Sequence[int], *,
                 batch_tokens: int = 1 << 18, max_batch: int = 1024, deadline: float | None = None,
                 on_batch: Callable[[list[int], list[list[int]]], Any] | None = None) -> dict[int, list[int]]:
        """Greedy answers (each up to and including its EOS token, or `max_new_tokens` long) of
        `prompts`, batched by length (left-padded: a row's first real token sits at rotary
        position 0). `on_batch(indices, answers)` is called after each batch; past `deadline`
        (time.monotonic()) no new batch starts. Returns {prompt index: answer ids}."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        eos = torch.tensor(sorted(set(eos_ids)) or [-1], device=self.device)
        done: dict[int, list[int]] = {}
        start = 0
        while start < len(order):
            if deadline is not None and time.monotonic() >= deadline:
                break
            longest = len(prompts[order[min(len(order) - 1, start + max_batch - 1)]])
            n = max(1, min(max_batch, batch_tokens // (longest + max_new_tokens), len(order) - start))
            idx = order[start : start + n]
            start += n
            answers = self._generate_batch([prompts[i] for i in idx], max_new_tokens, eos)
            done.update(zip(idx, answers))
            if on_batch is not None:
                on_batch(idx, answers)
        return done

    def _generate_batch(self, prompts: Sequence[Sequence[int]], max_new: int, eos: torch.Tensor) -> list[list[int]]:
        c = self.config
        b = len(prompts)
        lp = max(len(p) for p in prompts)
        cap = lp + max_new
        if cap > self.max_positions:
            raise TokenleapError(
                f"prompt of {lp} tokens + {max_new} new is longer than the rotary tables ({self.max_positions})"
            )
        pads = torch.tensor([lp - len(p) for p in prompts], device=self.device)
        ids = torch.zeros(b, lp, dtype=torch.long, device=self.device)
        for r, p in enumerate(prompts):
            ids[r, lp - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        slots = torch.arange(cap, device=self.device)
        valid = slots[None, :] >= pads[:, None]  # [B, cap] key slots holding real tokens
        cache = [
            (
                torch.zeros(b, c.num_kv_heads, cap, c.head_dim, device=self.device, dtype=self.dtype),
                torch.zeros(b, c.num_kv_heads, cap, c.head_dim, device=self.device, dtype=self.dtype),
            )
            for _ in self.layers
        ]
        pos = (slots[None, :lp] - pads[:, None]).clamp(min=0)
        causal = slots[:lp, None] >= slots[None, :lp]
        mask = causal[None] & valid[:, None, :lp]
        mask |= ~valid[:, :lp, None]  # pad rows attend to something (their output is never read)
        hidden, _ = self.forward(ids, pos, mask, cache, 0)
        nxt = self.logits(hidden[:, -1]).argmax(-1)
        out = torch.empty(b, max_new, dtype=torch.long, device=self.device)
        lengths = torch.full((b,), max_new, dtype=torch.long, device=self.device)
        live = torch.arange(b, device=self.device)  # the batch row of each live row
        alive = torch.ones(b, dtype=torch.bool, device=self.device)
        for step in range(max_new):
            out[live, step] = nxt  # rows already ended write past their length: never read
            ended = alive & torch.isin(nxt, eos)
            lengths[live[ended]] = step + 1
            alive &= ~ended
            if step + 1 == max_new or not bool(alive.any()):
                break
            if step % 8 == 7 and not bool(alive.all()):  # drop ended rows (a copy of the cache: not every step)
                sel = alive.nonzero().squeeze(1)
                live, nxt, alive, pads, valid = live[sel], nxt[sel], alive[sel], pads[sel], valid[sel]
                cache = [(k.index_select(0, sel), v.index_select(0, sel)) for k, v in cache]
            length = lp + step
            hidden, _ = self.forward(
                nxt.unsqueeze(1), (length - pads).unsqueeze(1), valid[:, None, : length + 1], cache, length
            )
            nxt = self.logits(hidden[:, -1]).argmax(-1)
        host = out.cpu().tolist()
        return [row[: int(n)] for row, n in zip(host, lengths.cpu().tolist())]
