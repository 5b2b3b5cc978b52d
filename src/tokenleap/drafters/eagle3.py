"""EAGLE-3 draft heads (Li et al., 2025, "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test") with EAGLE-2 dynamic draft trees (Li et al., 2024).

The head is one Llama decoder layer over the target's own features. At position i it fuses the
target's residual stream entering three layers (`fc`), concatenates the normed token embedding
of x_{i+1} (the target's embedding table, shared) with the normed feature, attends causally over
its own KV cache and predicts x_{i+2} over a reduced draft vocabulary (`lm_head`), mapped back to
target ids by the `d2t` offsets. Later draft steps feed the head's own output (pre-norm) as the
feature.

Runtime contract with the engine (`needs_hidden_states`): the engine asks the target's forward
for `hidden_layers` (the outputs of layers l-1 = the inputs of the aux layers l) in the same
forward that prefills or verifies, and hands the rows of the committed positions to `observe`.
The head's KV cache holds only positions built from the target's true features; draft rows go
past them and are dropped at the next `propose`, which first rebuilds the head's KV for the newly
accepted positions from their true features. Every piece of per-request state is keyed by the
token prefix it was built from, so a step the engine rolls back can never leave stale state.

Checkpoints: the EAGLE / SpecForge layout (`midlayer.*`, `fc`, `d2t`, `t2d`, config with
`draft_vocab_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`), vLLM speculators'
`Eagle3Speculator` (`transformer_layer_config`, top-level aux ids, `layers.0.*` names), and
llama.cpp's `eagle3` GGUF (`eagle3_gguf.py`).
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from tokenleap.drafters.base import Draft, DraftRequest
from tokenleap.errors import TokenleapError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Eagle3Config:
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


@dataclass(frozen=True)
class TreeShape:
    """EAGLE-2 dynamic tree: `topk` children per expanded node and `topk` frontier nodes per
    depth, `depth` levels, then the best nodes by cumulative draft probability (the engine's
    budget) are kept. topk = 1 is a chain."""

    topk: int = 1
    depth: int = 6


def head_rope(theta: float, head_dim: int, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[positions, head_dim]` (NeoX half-split layout, float64 angles) of a draft head."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, dtype=torch.float64) / half))
    angles = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)
    return torch.cat([angles.cos(), angles.cos()], dim=-1).float(), torch.cat([angles.sin(), angles.sin()], dim=-1).float()


HEAD_QTYPE = 8  # GGML type of a head's linears beside a quantized target (Q8_0)


def head_linear(weights: dict[str, torch.Tensor], names: Sequence[str], dtype: torch.dtype, kernels: Any,
                quantize: bool = False) -> Any:
    """The (fused) weight of a draft head's linear in the target's dtype, packed for the kernels
    when they take it; with `quantize` (a target whose linears are kept in their GGUF blocks),
    in Q8_0 blocks instead: half the bytes a draft step reads, and a draft step on a CPU is as
    memory-bound as the target's (drafts only propose: the output stays the target's)."""
    w = torch.cat([weights[n] for n in names]).to(dtype).contiguous()
    if kernels is not None and quantize:
        from tokenleap.kernels import QuantWeight

        out_dim, in_dim = w.shape
        if QuantWeight.fits(HEAD_QTYPE, out_dim, in_dim):
            import gguf

            blocks = gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType(HEAD_QTYPE))
            return QuantWeight.from_blocks(blocks, HEAD_QTYPE, out_dim, in_dim)
    if kernels is not None:
        packed = kernels.pack(w)
        return packed if packed is not None else w
    return w


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The reference choice: the inputs of layers 2, N//2 and N-3."""
    return (2, num_layers // 2, num_layers - 3)


def _config_from_json(raw: dict[str, Any], target_layers: int) -> tuple[Eagle3Config, str]:
    """Parse an EAGLE/SpecForge or speculators config.json; returns the config and the dialect."""
    if "transformer_layer_config" in raw or raw.get("speculators_model_type") == "eagle3":
        layer = dict(raw.get("transformer_layer_config") or {})
        dialect = "speculators"
        aux = raw.get("eagle_aux_hidden_state_layer_ids")
        draft_vocab = raw.get("draft_vocab_size", layer.get("vocab_size"))
        nbr = bool(raw.get("norm_before_residual", False))
        target_h = raw.get("target_hidden_size")
    else:
        layer = raw
        dialect = "eagle"
        aux = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
        draft_vocab = raw.get("draft_vocab_size", raw.get("vocab_size"))
        nbr = bool(raw.get("norm_before_residual", False))
        target_h = raw.get("target_hidden_size")
    try:
        h = int(layer["hidden_size"])
        heads = int(layer["num_attention_heads"])
        cfg = Eagle3Config(
            hidden_size=h,
            intermediate_size=int(layer["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(layer.get("num_key_value_heads", heads)),
            head_dim=int(layer.get("head_dim") or h // heads),
            vocab_size=int(layer["vocab_size"]),
            draft_vocab_size=int(draft_vocab if draft_vocab is not None else layer["vocab_size"]),
            target_hidden_size=int(target_h or h),
            aux_layers=tuple(int(x) for x in aux) if aux is not None else default_aux_layers(target_layers),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-5)),
            rope_theta=float(layer.get("rope_theta", 10000.0)),
            max_position=int(layer.get("max_position_embeddings", 8192)),
            norm_before_residual=nbr,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise TokenleapError(f"EAGLE-3 config.json is missing or has a bad field: {exc}") from exc
    if aux is None:
        logger.warning("EAGLE-3 head names no aux layers; using the default (inputs of layers %s)", cfg.aux_layers)
    return cfg, dialect


_SPECULATORS_RENAMES = (("layers.0.", "midlayer."), ("fusion_fc.", "fc."), ("draft_id_to_target_id", "d2t"))


class Eagle3Head:
    """The head's weights and forward (torch, or the target's bf16 kernels for the linears)."""

    def __init__(self, config: Eagle3Config, weights: dict[str, torch.Tensor], target: Any) -> None:
        c = self.config = config
        self.target = target
        dtype = target.dtype
        self.kernels = target.kernels
        h, ht = c.hidden_size, c.target_hidden_size
        tc = target.config
        if c.num_heads % c.num_kv_heads or c.head_dim % 2:
            raise TokenleapError(
                f"EAGLE-3 head needs num_attention_heads ({c.num_heads}) a multiple of num_key_value_heads "
                f"({c.num_kv_heads}) and an even head_dim ({c.head_dim})"
            )
        if ht != tc.hidden_size:
            raise TokenleapError(f"EAGLE-3 head expects target hidden size {ht} but the target's is {tc.hidden_size}")
        if c.vocab_size != tc.vocab_size:
            raise TokenleapError(f"EAGLE-3 head vocab_size {c.vocab_size} differs from the target's {tc.vocab_size}")
        bad = [layer for layer in c.aux_layers if not 0 <= layer < tc.num_layers]
        if len(c.aux_layers) != 3 or bad:
            raise TokenleapError(
                f"EAGLE-3 aux layer ids {list(c.aux_layers)} do not fit the target: need 3 ids in [0, {tc.num_layers})"
            )
        expect = {
            "fc.weight": (h, 3 * ht),
            "midlayer.input_layernorm.weight": (h,),
            "midlayer.hidden_norm.weight": (h,),
            "midlayer.self_attn.q_proj.weight": (c.num_heads * c.head_dim, 2 * h),
            "midlayer.self_attn.k_proj.weight": (c.num_kv_heads * c.head_dim, 2 * h),
            "midlayer.self_attn.v_proj.weight": (c.num_kv_heads * c.head_dim, 2 * h),
            "midlayer.self_attn.o_proj.weight": (h, c.num_heads * c.head_dim),
            "midlayer.post_attention_layernorm.weight": (h,),
            "midlayer.mlp.gate_proj.weight": (c.intermediate_size, h),
            "midlayer.mlp.up_proj.weight": (c.intermediate_size, h),
            "midlayer.mlp.down_proj.weight": (h, c.intermediate_size),
            "norm.weight": (h,),
            "lm_head.weight": (c.draft_vocab_size, h),
        }
        for name, shape in expect.items():
            if name not in weights:
                raise TokenleapError(f"EAGLE-3 checkpoint lacks tensor {name!r}")
            if tuple(weights[name].shape) != shape:
                raise TokenleapError(f"EAGLE-3 tensor {name!r} has shape {tuple(weights[name].shape)}, expected {shape}")
        if c.draft_vocab_size > c.vocab_size:
            raise TokenleapError(f"draft_vocab_size {c.draft_vocab_size} exceeds the target vocabulary {c.vocab_size}")
        if "d2t" in weights:
            d2t = weights["d2t"].to(torch.int64)
            if tuple(d2t.shape) != (c.draft_vocab_size,):
                raise TokenleapError(f"EAGLE-3 d2t has shape {tuple(d2t.shape)}, expected ({c.draft_vocab_size},)")
            self.d2t_ids = torch.arange(c.draft_vocab_size) + d2t
            if int(self.d2t_ids.min()) < 0 or int(self.d2t_ids.max()) >= c.vocab_size:
                raise TokenleapError("EAGLE-3 d2t maps draft ids outside the target vocabulary")
        elif c.draft_vocab_size < c.vocab_size:
            raise TokenleapError(
                f"EAGLE-3 head has a reduced draft vocabulary ({c.draft_vocab_size} < {c.vocab_size}) but no d2t mapping"
            )
        else:
            self.d2t_ids = torch.arange(c.draft_vocab_size)
        self.d2t_list: list[int] = self.d2t_ids.tolist()
        emb = weights.get("embed_tokens.weight")
        if emb is not None and tuple(emb.shape) == (c.vocab_size, h):
            self.embed = emb.to(dtype).contiguous()
        else:
            if h != tc.hidden_size:
                raise TokenleapError("EAGLE-3 head with its own hidden size needs embed_tokens.weight")
            self.embed = target.embed  # shared, not copied

        def f32(name: str) -> torch.Tensor:
            return weights[name].float().contiguous()

        quantize = bool(getattr(target, "quantization", None))

        def lin(*names: str) -> Any:
            return head_linear(weights, names, dtype, self.kernels, quantize)

        p = "midlayer."
        self.fc = lin("fc.weight")
        self.in_norm = f32(p + "input_layernorm.weight")
        self.hidden_norm = f32(p + "hidden_norm.weight")
        self.wqkv = lin(*(f"{p}self_attn.{n}_proj.weight" for n in "qkv"))
        self.wo = lin(p + "self_attn.o_proj.weight")
        self.post_norm = f32(p + "post_attention_layernorm.weight")
        self.w_gate_up = lin(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        self.w_down = lin(p + "mlp.down_proj.weight")
        self.norm = f32("norm.weight")
        self.lm_head = lin("lm_head.weight")
        self._cos, self._sin = head_rope(c.rope_theta, c.head_dim, max(c.max_position, tc.max_position) + 64)  # [P, hd]
        # the target hidden states the engine must capture: output of layer l-1 = input of layer l
        self.hidden_layers = tuple(sorted({layer - 1 for layer in c.aux_layers if layer > 0})) or (0,)  # never empty: it turns `observe` on

    # ------------------------------------------------------------------ pieces of the forward

    def _linear(self, x: torch.Tensor, w: Any) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.linear(x.contiguous(), w)
        return F.linear(x.to(w.dtype), w).float()

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.config.rms_norm_eps)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [n, heads, hd], NeoX half-split rotary at `positions`."""
        if int(positions.max()) >= self._cos.shape[0]:
            raise TokenleapError(f"EAGLE-3 head positions must be below {self._cos.shape[0]}")
        cos, sin = self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def embed_tokens(self, ids: Sequence[int]) -> torch.Tensor:
        return F.embedding(torch.tensor(list(ids), dtype=torch.long), self.embed).float()

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[n, 3 H_target] concatenated aux states -> the feature g [n, H]."""
        return self._linear(aux, self.fc)

    def aux_from(self, token_ids: Sequence[int], hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """The concatenated aux states of the rows of a target forward."""
        parts = []
        for layer in self.config.aux_layers:
            parts.append(self.target_embed(token_ids) if layer == 0 else hidden[layer - 1].float())
        return torch.cat(parts, dim=-1)

    def target_embed(self, token_ids: Sequence[int]) -> torch.Tensor:
        return F.embedding(torch.tensor(list(token_ids), dtype=torch.long), self.target.embed).float()

    def layer(
        self, g: torch.Tensor, e: torch.Tensor, positions: torch.Tensor, kv: HeadKV, visible: torch.Tensor
    ) -> torch.Tensor:
        """One head step over n rows: features g [n, H], token embeddings e [n, H]. The rows'
        K/V are appended to `kv`; `visible` [n, kv.length + n] says which slots each row sees."""
        c = self.config
        n = g.shape[0]
        gn = self._rms(g, self.hidden_norm)
        x = torch.cat([self._rms(e, self.in_norm), gn], dim=-1)
        residual = gn if c.norm_before_residual else g
        qkv = self._linear(x, self.wqkv)
        qs, ks = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q = self._rope(qkv[:, :qs].view(n, c.num_heads, c.head_dim), positions)
        k = self._rope(qkv[:, qs : qs + ks].view(n, c.num_kv_heads, c.head_dim), positions)
        v = qkv[:, qs + ks :].view(n, c.num_kv_heads, c.head_dim)
        kv.append(k, v)
        keys, values = kv.view()  # [S, kvh, hd]
        kvh, rep, hd = c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim
        # grouped-query attention: query head j reads KV head j // rep
        qg = q.view(n, kvh, rep, hd).permute(1, 0, 2, 3).reshape(kvh, n * rep, hd)
        scores = torch.matmul(qg, keys.permute(1, 2, 0)) * (1.0 / math.sqrt(hd))  # [kvh, n*rep, S]
        mask = visible.unsqueeze(1).expand(n, rep, visible.shape[-1]).reshape(n * rep, -1)
        scores = scores.masked_fill(~mask, float("-inf"))
        a = torch.matmul(scores.softmax(dim=-1), values.transpose(0, 1))  # [kvh, n*rep, hd]
        a = a.view(kvh, n, rep, hd).permute(1, 0, 2, 3).reshape(n, qs)
        h = residual + self._linear(a, self.wo)
        gate, up = self._linear(self._rms(h, self.post_norm), self.w_gate_up).chunk(2, dim=-1)
        return h + self._linear(F.silu(gate) * up, self.w_down)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [n, Vd] of head outputs h (pre-norm)."""
        return self._linear(self._rms(h, self.norm), self.lm_head)


def measure_step_cost(head: Eagle3Head, context: int = 64, repeats: int = 5) -> float:
    """One head draft step (a row through the layer and the draft LM head) relative to a 1-row
    target forward with its LM head, both at `context` cached tokens: the fastest of `repeats`."""
    import time

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
            head.logits(head.layer(h, head.embed_tokens([1]), torch.tensor([context]), hkv, torch.ones(1, context + 1, dtype=torch.bool)))
            t2 = time.perf_counter()
            best_t, best_h = min(best_t, t1 - t0), min(best_h, t2 - t1)
        kv.free()
    return best_h / best_t


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


@dataclass
class _State:
    """A request's head state. Target features arrive as raw aux rows (`observe`, every forward)
    and are fused by the head's `fc` only when a draft needs them (`feature_rows`), in one call
    over every row since the last draft: a request that drafts rarely (a chain whose free member
    usually proposes, a controller keeping the head off) pays a copy per token, not a linear."""

    fuse: Callable[[torch.Tensor], torch.Tensor] | None = None  # aux rows [n, 3H] -> features g [n, H]
    feats: torch.Tensor | None = None  # [capacity, H]: the feature g of positions 0 .. n_fused-1
    n_fused: int = 0
    pending: list[torch.Tensor] = field(default_factory=list)  # raw aux rows of positions n_fused .., in order
    feat_tokens: list[int] = field(default_factory=list)  # input token of each featured position
    kv: HeadKV | None = None
    kv_tokens: list[int] = field(default_factory=list)  # x_0 .. x_{n_kv}: tokens the true KV was built from
    n_kv: int = 0  # head KV slots built from true features (positions 0 .. n_kv-1)

    def truncate(self, length: int) -> None:
        """Forget featured positions from `length` on."""
        del self.feat_tokens[length:]
        if length <= self.n_fused:
            self.n_fused = length
            self.pending.clear()
            return
        keep = length - self.n_fused  # the pending rows of the positions that stay
        if sum(r.shape[0] for r in self.pending) > keep:
            self.pending = [torch.cat(self.pending)[:keep]]

    def feature_rows(self, start: int, end: int) -> torch.Tensor:
        if end > self.n_fused:  # fuse the rows observed since the last draft, in one call
            assert self.fuse is not None
            rows = torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]
            n = end - self.n_fused
            with torch.inference_mode():
                g = self.fuse(rows[:n])
                if self.feats is None or self.feats.shape[0] < end:
                    grown = torch.empty(max(256, 2 * end), g.shape[1])
                    if self.feats is not None:
                        grown[: self.n_fused] = self.feats[: self.n_fused]
                    self.feats = grown
                self.feats[self.n_fused : end] = g
            self.pending = [rows[n:]] if rows.shape[0] > n else []
            self.n_fused = end
        assert self.feats is not None
        return self.feats[start:end]

    def append_aux(self, rows: torch.Tensor) -> None:
        """Raw aux rows of the positions after the featured ones (`feat_tokens` still excludes them);
        kept only until the next draft fuses them."""
        self.pending.append(rows)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):  # the usual case, compared at C speed
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Eagle3Drafter:
    """Drafts chains (topk = 1) or EAGLE-2 dynamic trees from an EAGLE-3 head; greedy argmax
    over the draft vocabulary, deterministic drafts (lossless for sampled requests too)."""

    name: ClassVar[str] = "eagle3"
    needs_hidden_states: ClassVar[bool] = True
    drafts_with_model: ClassVar[bool] = True  # a chain asks draftless members first (base.DraftsWithModel)

    def __init__(self, head: Eagle3Head, tree: TreeShape = TreeShape(), relative_draft_cost: float = 0.0) -> None:
        self.head = head
        self.tree = tree
        # drafting cost per draft token relative to a target step (the engine's draft-length
        # controller adds it to the verify cost)
        self.relative_draft_cost = relative_draft_cost
        self.hidden_layers = head.hidden_layers
        self._states: dict[str, _State] = {}
        self.draft_steps = 0  # head forwards run while drafting (for cost accounting)

    # ---------------------------------------------------------------- lifecycle

    def begin(self, request: DraftRequest) -> None:
        c = self.head.config
        self._states[request.request_id] = _State(fuse=self.head.fuse, kv=HeadKV(c.num_kv_heads, c.head_dim))

    def end(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def accept(self, request_id: str, tokens: Sequence[int], num_accepted: int) -> None:
        return None  # `observe` brings the true features; `propose` re-synchronises by prefix

    def observe(self, request_id: str, start: int, token_ids: Sequence[int], hidden: dict[int, torch.Tensor]) -> None:
        """Target features of positions start .. start+n-1 (input tokens `token_ids`), from the
        forward that prefilled or verified them."""
        st = self._states.get(request_id)
        if st is None or start > len(st.feat_tokens):
            return  # a gap: the missing positions cannot be recovered, drafting stays off
        if start < len(st.feat_tokens):
            st.truncate(start)
        if not len(token_ids):
            return
        with torch.inference_mode():
            st.append_aux(self.head.aux_from(token_ids, hidden))
        st.feat_tokens.extend(int(t) for t in token_ids)

    # ---------------------------------------------------------------- drafting

    def _sync(self, st: _State, tokens: Sequence[int]) -> int:
        """Drop state not built from `tokens`; rebuild the head's true KV up to the last
        featured position. Returns L, the number of featured positions (0 = cannot draft)."""
        c = min(_common_prefix(st.feat_tokens, tokens), len(tokens) - 1)
        if c < len(st.feat_tokens):
            st.truncate(c)
        L = len(st.feat_tokens)
        if L == 0 or L != len(tokens) - 1:
            return 0
        ck = _common_prefix(st.kv_tokens, tokens)
        st.n_kv = max(0, min(st.n_kv, ck - 1, L - 1))  # always re-run position L-1 (its output drafts)
        assert st.kv is not None
        st.kv.truncate(st.n_kv)
        return L

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        st = self._states.get(request_id)
        if st is None or max_tokens <= 0:
            return Draft()
        head = self.head
        with torch.inference_mode():
            L = self._sync(st, tokens)
            if L == 0:
                return Draft()
            room = head.config.max_position - L - 1
            max_tokens = min(max_tokens, room)
            if max_tokens <= 0:
                return Draft()
            kv = st.kv
            assert kv is not None
            s = st.n_kv
            g = st.feature_rows(s, L)
            e = head.embed_tokens(tokens[s + 1 : L + 1])
            n = L - s
            visible = torch.ones(n, s + n, dtype=torch.bool).tril(diagonal=s)
            h = head.layer(g, e, torch.arange(s, L), kv, visible)
            st.n_kv = L
            st.kv_tokens = [int(t) for t in tokens[: L + 1]]
            self.draft_steps += 1
            last = h[-1:]
            if self.tree.topk <= 1:
                return self._chain(last, L, kv, max_tokens)
            return self._tree(last, L, kv, max_tokens)

    def _chain(self, h: torch.Tensor, L: int, kv: HeadKV, k: int) -> Draft:
        head = self.head
        out: list[int] = []
        for j in range(k):
            tok = head.d2t_list[int(head.logits(h)[0].argmax())]
            out.append(tok)
            if j == k - 1:
                break
            visible = torch.ones(1, kv.length + 1, dtype=torch.bool)
            h = head.layer(h, head.embed_tokens([tok]), torch.tensor([L + j]), kv, visible)
            self.draft_steps += 1
        return Draft(out)

    def _tree(self, h: torch.Tensor, L: int, kv: HeadKV, budget: int) -> Draft:
        """EAGLE-2: expand the `topk` best frontier nodes per depth (topk children each), rerank
        every candidate by cumulative log-probability, keep the best `budget` nodes."""
        head, topk, depth = self.head, self.tree.topk, min(self.tree.depth, budget)  # deeper than the budget cannot be kept
        base = kv.length  # = L: the head's true slots
        # candidate nodes: (score, token, parent candidate index or -1, depth)
        scores: list[float] = []
        toks: list[int] = []
        parents: list[int] = []
        depths: list[int] = []
        ancestors: dict[int, list[int]] = {-1: []}  # candidate -> its expanded ancestors' slots incl. itself
        logp = torch.log_softmax(head.logits(h), dim=-1)  # [1, Vd]
        frontier_h = h
        frontier = [-1]
        for d in range(1, depth + 1):
            top = logp.topk(min(topk, logp.shape[-1]), dim=-1)
            children: list[int] = []
            for r, parent in enumerate(frontier):
                ps = scores[parent] if parent >= 0 else 0.0
                for lp, idx in zip(top.values[r].tolist(), top.indices[r].tolist()):
                    scores.append(ps + lp)
                    toks.append(head.d2t_list[idx])
                    parents.append(parent)
                    depths.append(d)
                    children.append(len(scores) - 1)
            if d == depth:
                break
            # the next frontier: the `topk` best new children by cumulative score
            nxt = heapq.nlargest(topk, children, key=lambda i: scores[i])
            rows_h = torch.cat([frontier_h[frontier.index(parents[i])].unsqueeze(0) for i in nxt])
            e = head.embed_tokens([toks[i] for i in nxt])
            start = kv.length
            visible = torch.zeros(len(nxt), start + len(nxt), dtype=torch.bool)
            visible[:, :base] = True
            for r, i in enumerate(nxt):
                ancestors[i] = ancestors[parents[i]] + [start + r]
                visible[r, ancestors[i]] = True
            frontier_h = head.layer(rows_h, e, torch.full((len(nxt),), L - 1 + d), kv, visible)
            self.draft_steps += 1
            logp = torch.log_softmax(head.logits(frontier_h), dim=-1)
            frontier = nxt
        # keep the best `budget` candidates; scores fall along a path, so ties broken by depth
        # keep the set closed under ancestors
        keep = sorted(range(len(scores)), key=lambda i: (-scores[i], depths[i], i))[:budget]
        keep_set = set(keep)
        keep = [i for i in keep if parents[i] < 0 or parents[i] in keep_set]
        order = sorted(keep, key=lambda i: (depths[i], -scores[i], i))
        index = {c: j for j, c in enumerate(order)}
        # a candidate whose parent was dropped (equal scores) is dropped too
        order = [i for i in order if parents[i] < 0 or parents[i] in index]
        index = {c: j for j, c in enumerate(order)}
        kv.truncate(base)
        return Draft([toks[i] for i in order], [index[parents[i]] if parents[i] >= 0 else -1 for i in order])
