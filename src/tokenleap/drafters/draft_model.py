"""Two-model speculative decoding (Leviathan et al., 2023; Chen et al., 2023): a small causal LM
sharing the target's tokenizer drafts k tokens autoregressively, with its own KV cache.

Under sampling the drafter samples each token from q, its own distribution after the request's
temperature / top-k / top-p / min-p, and returns q so verification stays lossless; under greedy
it takes the argmax. Its cache follows the request by longest common prefix: each `propose`
truncates the cache to the tokens still in the context (rolling back rejected drafts in O(1))
and feeds only what is new. A draft made of the target's first N layers (`draft_layers`) shares
the target's weights, which is also the simplest form of self-speculation (LayerSkip, Elhoushi
et al., 2024, without its training). With `draft_p_min` > 0 (llama.cpp's `--spec-draft-p-min`) a
draft stops at the first position where the draft model's top probability (its softmax under
greedy requests, q under sampled ones) falls below it, that token not drafted: drafts only get
shorter, so greedy output stays the target's and sampled output keeps its distribution.

A reduced draft vocabulary (`draft_vocab` = N; FR-Spec, Zhao et al., 2025) cuts the draft's LM
head, often the largest matrix of a small model (Qwen2.5-0.5B's 151,936 x 896 is a third of the
bytes a step reads), to its N most frequent tokens plus the tokenizer's special ones. The ranking
needs no corpus: byte-pair vocabularies number their tokens in merge order, most frequent merges
first (sentencepiece ones by score), so the first N ids are the frequent ones. The draft only
chooses among those (its q is zero elsewhere, still a distribution); the target verifies as
always, so output is unchanged. A draft context (`draft_context` = N) has the draft read only a
long prompt's last N tokens. By default the window is sized by what the request can repay: the
draft's prefill is compute-bound (Qwen2.5-Coder-0.5B: ~5 ms a prompt token on 2 cores, a tenth
of the 1.5B target's decode step) and pays back only through the tokens it helps decode, so it
reads at most max(128, 2 x max_tokens) of the prompt (`auto_draft_context`): a 64-token answer to
a 1,500-token document no longer pays 7 s of draft prefill for at most 2 s of savings.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from tokenleap.config import KV_CACHE_ALIASES, KV_CACHE_DTYPES
from tokenleap.drafters.base import Draft, Drafter, DraftRequest, unsure
from tokenleap.drafters.methods import MODEL_FLAGS, MethodRecord, option, options_of
from tokenleap.errors import TokenleapError
from tokenleap.kv.cache import KVCache, common_prefix, resync
from tokenleap.models.base import CausalLM
from tokenleap.sampling import logits_to_probs
from tokenleap.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tokenleap.drafters.spec import SpecConfig

logger = logging.getLogger(__name__)


@dataclass
class _State:
    request: DraftRequest
    kv: KVCache
    cached: list[int] = field(default_factory=list)  # token ids whose K/V are in `kv`
    offset: int = 0  # the context's first token the draft reads (a window over a long prompt)


def same_vocabulary(target_tok: Tokenizer, draft_tok: Tokenizer, target: CausalLM, draft: CausalLM) -> bool:
    """Whether the draft speaks the target's token ids (else `CrossTokenizerDrafter` translates)."""
    return draft.config.vocab_size == target.config.vocab_size and target_tok.hf.get_vocab() == draft_tok.hf.get_vocab()


class DraftModelDrafter:
    name: ClassVar[str] = "draft-model"
    needs_hidden_states: ClassVar[bool] = False
    drafts_with_model: ClassVar[bool] = True  # a chain asks draftless members first (base.DraftsWithModel)

    def __init__(
        self,
        model: CausalLM,
        p_min: float = 0.0,
        vocab: torch.Tensor | None = None,
        context: int | None = None,
        relative_draft_cost: float = 0.0,
    ) -> None:
        self.model = model
        # a draft token's price in target steps (base.HasDraftCost): a decode step reads its
        # weights, so the draft's bytes over the target's (measured 0.283 by time, 0.284 by bytes
        # on the Qwen2.5-Coder pair); the engine's controller refines it from timings, and a
        # chain weighs this member against the draftless ones by it
        self.relative_draft_cost = relative_draft_cost
        self.p_min = p_min  # stop a draft where the draft model's top probability falls below this (0: never)
        self.vocab = vocab  # the token ids of the model's logits' columns (a reduced head), None: all
        # the draft reads a prompt's last `context` tokens only (0: all of it; None: auto_draft_context)
        self.context = context
        self._states: dict[str, _State] = {}

    def _logits(self, hidden: torch.Tensor, row: int) -> torch.Tensor:
        """float32 `[1, V]`: the draft's logits at `row`; a reduced head's columns scattered into
        the whole vocabulary (-inf elsewhere), so sampling and its processors see token ids."""
        logits = self.model.compute_logits(hidden, [row])
        if self.vocab is None:
            return logits
        full = torch.full((1, self.model.config.vocab_size), float("-inf"))
        full[0, self.vocab] = logits[0]
        return full

    def _window(self, request: DraftRequest) -> int:
        """How much of the prompt the draft reads (0: all): `context`, or by default what the
        request's answer can repay (`auto_draft_context`)."""
        return auto_draft_context(request.params.max_tokens) if self.context is None else self.context

    def pending_tokens(self, request: DraftRequest, tokens: Sequence[int]) -> int:
        """Tokens the draft must run before it can draft after `tokens`: its prompt window and
        what followed when it has not begun the request, else the context it has not seen."""
        st = self._states.get(request.request_id)
        if st is None:
            window = self._window(request)
            offset = len(request.prompt_ids) - window if 0 < window < len(request.prompt_ids) else 0
            return max(0, len(tokens) - offset - 1)
        view = tokens[st.offset :]
        common = min(common_prefix(st.cached, view), len(view) - 1)  # what `resync` keeps
        return max(0, len(view) - common - 1)

    def setup_cost(self, request: DraftRequest, tokens: Sequence[int]) -> float:
        """`pending_tokens` in target decode steps (base.HasSetupCost): each costs the draft's
        step price times `PREFILL_SHARE` (a prompt token runs in a batch of rows, a fraction of
        a decode step's weight reads)."""
        return self.relative_draft_cost * PREFILL_SHARE * self.pending_tokens(request, tokens)

    def begin(self, request: DraftRequest) -> None:
        """Register the request and run its prompt through the draft model now, beside the
        target's prefill (llama.cpp does the same): the first draft then costs what any draft
        does, and the adaptive controller, which times drafts per token, does not read a prompt's
        prefill as the price of drafting."""
        st = self._states[request.request_id] = _State(request, self.model.new_kv_cache())
        prompt = list(request.prompt_ids)
        window = self._window(request)
        if 0 < window < len(prompt):
            st.offset = len(prompt) - window
        view = prompt[st.offset :]
        if 0 < len(view) < self.model.max_context:
            self.model.forward(torch.tensor(view), torch.arange(len(view)), st.kv)
            st.cached = view

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        st = self._states[request_id]
        if max_tokens <= 0:
            return Draft()
        window = self._window(st.request)
        if not st.cached and 0 < window < len(tokens):
            st.offset = len(tokens) - window  # its prefill reads the window only: a long prompt costs the draft little
        tokens = tokens[st.offset :]
        new = resync(st.kv, st.cached, tokens)
        room = self.model.max_context - len(tokens)
        max_tokens = min(max_tokens, room)
        if max_tokens <= 0:
            return Draft()
        params, gen = st.request.params, st.request.generator
        drafted: list[int] = []
        qs: list[torch.Tensor] = []
        setup = 0.0
        if len(new) > 2:  # catching up on tokens committed while speculation was off: timed apart (Draft.setup_seconds)
            t0 = time.perf_counter()
            pos = st.kv.length
            self.model.forward(torch.tensor(new[:-1]), torch.arange(pos, pos + len(new) - 1), st.kv)
            st.cached.extend(new[:-1])
            new = new[-1:]
            setup = time.perf_counter() - t0
        for _ in range(max_tokens):
            pos = st.kv.length
            out = self.model.forward(torch.tensor(new), torch.arange(pos, pos + len(new)), st.kv)
            st.cached.extend(new)
            logits = self._logits(out.hidden, len(new) - 1)  # [1, V]
            if params.greedy:
                if unsure(logits[0], self.p_min):
                    break
                tok = int(logits[0].argmax())
            else:
                q = logits_to_probs(logits, params)[0]
                if self.p_min > 0.0 and float(q.max()) < self.p_min:
                    break
                tok = int(torch.multinomial(q, 1, generator=gen))
                qs.append(q)
            drafted.append(tok)
            new = [tok]
        return Draft(drafted, None, torch.stack(qs) if qs else None, setup_seconds=setup)

    def accept(self, request_id: str, tokens: Sequence[int], num_accepted: int) -> None:
        return None  # the next propose re-synchronises by common prefix

    def end(self, request_id: str) -> None:
        st = self._states.pop(request_id, None)
        if st is not None:
            st.kv.free()


# a prompt token's prefill against one draft decode step (Qwen2.5-Coder-0.5B on 2 cores: ~3.4 ms
# a token in a 128-token prefill, ~15 ms a decode step)
PREFILL_SHARE = 0.25
AUTO_CONTEXT_MIN = 128  # prompt tokens the draft reads at least (by default; 256 accepted no more on Spec-Bench)
AUTO_CONTEXT_PER_TOKEN = 2  # and per token the request may generate


def auto_draft_context(max_tokens: int | None) -> int:
    """The default draft window: max(128, 2 x max_tokens) prompt tokens (0: all of a request
    without a cap). A prompt token costs the draft ~0.1 of a target decode step to prefill and
    a draft model saves 0.05-0.35 of a step per generated token (open chat to code), so a window
    of twice the answer stays under what drafting can win back where it pays at all, while short
    prompts (most chat and code) are read whole."""
    if not max_tokens:
        return 0
    return max(AUTO_CONTEXT_MIN, AUTO_CONTEXT_PER_TOKEN * max_tokens)


class LoadedModels:
    """Draft models loaded by one registry's drafters, by resolved path, dtype and kernel use:
    drafters for the same model under other settings (another cap, another layer count) share
    one copy of its weights instead of loading another on the engine thread."""

    def __init__(self) -> None:
        self._models: dict[tuple[Path, Any, bool, str | None, str], Any] = {}

    def get(
        self, model: str, *, target: CausalLM, tokenizer: Any, target_path: Any = None, kv_cache_type: str = "auto"
    ) -> tuple[Any, Any]:
        """The draft model, and its tokenizer when its vocabulary differs from the target's
        (None when they share one: the draft then speaks the target's ids). `kv_cache_type`:
        the draft's own KV cache type (llama.cpp's -ctkd / -ctvd), "auto" as the target's loader."""
        from tokenleap.models import loading
        from tokenleap.models.registry import resolve

        source = resolve(model)
        path = source.path.resolve()
        if target_path is not None and path == Path(target_path).resolve():
            if kv_cache_type != "auto":
                raise TokenleapError(
                    "a draft cache type needs a draft model of its own (this draft is the target itself)"
                )
            return target, None  # the target's own weights (shared, not copied)
        # a GGUF draft keeps its blocks quantized when the target does, and is dequantized when it is not
        quantization = (target.quantization or "none") if source.kind == "gguf" else None
        key = (path, target.dtype, target.kernels is not None, quantization, kv_cache_type)
        if key not in self._models:
            draft, draft_tok = loading.load_model(
                source,
                target.dtype,
                use_kernels=target.kernels is not None,
                quantization=quantization,
                kv_cache_type=kv_cache_type,
            )
            same = same_vocabulary(tokenizer, draft_tok, target, draft)
            if not same:
                logger.info(
                    "the draft model %s has another tokenizer than the target: drafting by text re-tokenization",
                    source.name,
                )
            self._models[key] = (draft, None if same else draft_tok)
        return self._models[key]


@dataclass(frozen=True)
class DraftModelOptions:
    """The draft-model method's options: which model, and how many of its layers."""

    model: str | None = option(
        None, help="the draft model (a registered name, a .gguf file or a folder)", flags=MODEL_FLAGS, per_request=False
    )
    draft_layers: int | None = option(
        None,
        help="use only the draft model's first N layers (default: all)",
        flags=("--draft-layers",),
        per_request=False,
    )
    draft_p_min: float = option(
        0.0,
        help="stop a draft where the draft model's top probability falls below this (0: off; llama.cpp's own "
        "default is 0.75); drafts only get shorter, output is unchanged",
        flags=("--spec-draft-p-min", "--draft-p-min"),
        per_request=False,
    )
    draft_context: int | None = option(
        None,
        help="the draft model reads only a prompt's last N tokens (0: all; default: "
        "max(128, 2 x max_tokens), what the answer can repay); output is unchanged",
        flags=("--spec-draft-context", "--draft-context"),
        per_request=False,
    )
    draft_vocab: int = option(
        0,
        help="the draft's LM head scores only its N most frequent tokens and the special ones (FR-Spec; "
        "0: all); a cheaper draft step, output unchanged",
        flags=("--spec-draft-vocab", "--draft-vocab"),
        per_request=False,
    )

    draft_cache_type_k: str | None = option(
        None,
        help=(
            "the draft model's KV cache type: auto, bf16 (f16) or q8_0 (default: auto); "
            "keys and values alike, as the target's"
        ),
        flags=("--cache-type-k-draft", "-ctkd"),
        per_request=False,
    )
    draft_cache_type_v: str | None = option(
        None,
        help="as --cache-type-k-draft (llama.cpp's -ctvd)",
        flags=("--cache-type-v-draft", "-ctvd"),
        per_request=False,
    )

    @property
    def draft_kv_cache_type(self) -> str:
        """The draft's one KV cache type ("auto" unless -ctkd / -ctvd said otherwise)."""
        return self.draft_cache_type_k or self.draft_cache_type_v or "auto"

    def __post_init__(self) -> None:
        for name in ("draft_cache_type_k", "draft_cache_type_v"):
            value = getattr(self, name)
            if value is not None:
                kv = KV_CACHE_ALIASES.get(str(value), str(value))
                if kv not in KV_CACHE_DTYPES:
                    raise TokenleapError(f"{name} must be one of {', '.join(KV_CACHE_DTYPES)} (or f16), got {value!r}")
                object.__setattr__(self, name, kv)
        if (
            None not in (self.draft_cache_type_k, self.draft_cache_type_v)
            and self.draft_cache_type_k != self.draft_cache_type_v
        ):
            raise TokenleapError("a draft's KV cache holds keys and values in one type: draft_cache_type_k "
                                 f"{self.draft_cache_type_k} and draft_cache_type_v {self.draft_cache_type_v} differ")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise TokenleapError(f"draft_layers must be >= 1, got {self.draft_layers}")
        if not 0.0 <= self.draft_p_min <= 1.0:
            raise TokenleapError(f"draft_p_min must be in [0, 1], got {self.draft_p_min}")
        if self.draft_context is not None and self.draft_context < 0:
            raise TokenleapError(f"draft_context must be >= 0 (0: the whole context), got {self.draft_context}")
        if self.draft_vocab < 0:
            raise TokenleapError(f"draft_vocab must be >= 0 (0: the whole vocabulary), got {self.draft_vocab}")


def _build(
    config: SpecConfig,
    *,
    target: Any,
    tokenizer: Any,
    target_path: Any = None,
    models: LoadedModels | None = None,
    **_: Any,
) -> Drafter:
    from tokenleap.drafters.cross_tokenizer import CrossTokenizerDrafter

    opts = options_of(config, "draft-model", DraftModelOptions)
    model, draft_tok = (models or LoadedModels()).get(
        str(opts.model),
        target=target,
        tokenizer=tokenizer,
        target_path=target_path,
        kv_cache_type=opts.draft_kv_cache_type,
    )
    if opts.draft_layers is not None:
        model = model.with_layers(opts.draft_layers)
    if draft_tok is not None:
        if opts.draft_vocab:
            raise TokenleapError("draft_vocab needs a draft model with the target's tokenizer")
        return CrossTokenizerDrafter(model, draft_tok, tokenizer, p_min=opts.draft_p_min)
    vocab = None
    if 0 < opts.draft_vocab < model.config.vocab_size:
        model, vocab = model.with_vocab(frequent_tokens(tokenizer, model.config.vocab_size, opts.draft_vocab))
    return DraftModelDrafter(
        model,
        p_min=opts.draft_p_min,
        vocab=vocab,
        context=opts.draft_context,
        relative_draft_cost=step_price(model, target),
    )


def step_price(draft: CausalLM, target: CausalLM) -> float:
    """A draft token's price in target decode steps: the bytes of weights each step reads
    (decoding is memory-bound at batch 1). The target's first N layers (`draft_layers`) cost
    those layers and the LM head."""
    target_bytes = target.weight_bytes_per_token()
    return draft.weight_bytes_per_token() / target_bytes if target_bytes > 0 else 0.0


def frequent_tokens(tokenizer: Any, vocab_size: int, n: int) -> torch.Tensor:
    """The `n` most frequent token ids by the vocabulary's own order (byte-pair merges are
    numbered most frequent first), with every special and added token (end of turn, tool
    markers) whatever its id: a reduced draft vocabulary without a corpus."""
    hf = tokenizer.hf
    special = (
        set(getattr(hf, "all_special_ids", []) or [])
        | set((hf.get_added_vocab() or {}).values())
        | set(tokenizer.eos_token_ids)
    )
    ordinary = [i for i in range(vocab_size) if i not in special][:n]
    return torch.tensor(sorted({*ordinary, *(i for i in special if 0 <= i < vocab_size)}), dtype=torch.long)


def _loaded_models(registry: Any) -> dict[str, Any]:
    return {"models": LoadedModels()}  # one copy of each draft model per registry


METHOD = MethodRecord(
    "draft-model",
    _build,
    "a smaller LM; with the target's tokenizer it returns q for lossless sampling, with another it drafts through text",
    options=DraftModelOptions,
    aliases=("draft_model", "draft", "draft-simple"),
    per_request=False,
    needs_model="a draft model",
    shared=_loaded_models,
    doc=(
        "a smaller LM; with the target's tokenizer it samples and returns q for lossless sampling, with another "
        "tokenizer it drafts greedily through text ([models.md](models.md), Draft models with another tokenizer)"
    ),
)
