"""The decoding engine: prefill, then one target forward per step, until a stop condition.

A step forwards the last committed token (plus, once speculation lands, the draft tokens)
through the target model, turns the logits into tokens and commits them to the request:

    schedule -> [drafter.propose] -> target forward -> sample / verify -> kv.truncate -> emit

A draft is a chain, or (`Draft.parents`) a token tree, verified in the same one forward under a
tree mask, keeping the accepted path's cache slots (`kv.compact`): greedy requests follow the
target's argmax, sampled ones every branch by multi-candidate rejection sampling
(`verify/tree_sampling.py`; `SpecConfig.sampled_tree="first-path"` reduces the tree to its first
root path and verifies that chain instead).

Drafters that read the target's hidden states (`needs_hidden_states`: EAGLE and Medusa heads)
get the rows of the committed positions from the same prefill and verify forwards (`observe`),
never from an extra target forward; those that read its logits (`needs_logits`: Token Recycling)
get the raw rows computed anyway (`observe_logits`).

A step is transactional per request (`engine/undo.py`): one whose drafter or verification
raises is rolled back and reported (`StepFailures`) while the others of the batch go on.

Plain decoding is the same step with an empty draft, so both paths share one code path and
(thanks to the row-invariant kernels) compute every committed token's logits identically: greedy
speculative output is token-for-token the plain output. `Engine.run` / `stream` drive one request;
`step_batch` steps many together, driven by the scheduler (`engine/scheduler.py`), which both
`LLM.generate` and the server's engine loop use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import cast

import torch

from tokenleap.attention import tree_mask
from tokenleap.config import DEFAULT_DRAFT_TOKENS
from tokenleap.drafters.base import (
    Draft,
    Drafter,
    DraftRequest,
    MemberStatistics,
    ReadsHiddenStates,
    ReadsLogits,
    WeighsCost,
    draft_cost_of,
    hidden_layers_of,
)
from tokenleap.drafters.spec import SpecConfig
from tokenleap.engine.request import Request
from tokenleap.engine.speculation import CostCurve, DraftController, cached_cost_curve, plan_batch_drafts
from tokenleap.engine.trace import SpecTrace
from tokenleap.engine.undo import StepFailures, Undo, roll_back
from tokenleap.errors import TokenleapError
from tokenleap.models.base import CausalLM, ModelOutput, SeqInput
from tokenleap.processors import needs_processing, process_rows, row_prefixes, token_logprobs
from tokenleap.sampling import SamplingParams, check_token_ids, make_generator, sample_next
from tokenleap.structured import GrammarState, GrammarTokenizer
from tokenleap.threads import torch_threads
from tokenleap.tokenizer import IncrementalDetokenizer, Tokenizer
from tokenleap.types import Logprob, RequestMetrics
from tokenleap.verify.chain import verify_chain
from tokenleap.verify.tree import check_parents, first_path, tree_depths, verify_tree_greedy
from tokenleap.verify.tree_sampling import verify_tree_sampled
from tokenleap.verify.typical import verify_tree_typical

logger = logging.getLogger(__name__)

_EMPTY = Draft()


def hidden_layers(drafter: Drafter | None) -> tuple[int, ...]:
    """The target layers whose output hidden states `drafter` reads (`observe`), if any; -1 is
    the final hidden state (after the final norm, what the LM head reads)."""
    return hidden_layers_of(drafter)


def _with_final(out: ModelOutput, layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """The forward's hidden states, plus the final one under -1 when asked for."""
    if -1 not in layers:
        return out.hidden_states
    return {**out.hidden_states, -1: out.hidden}


class Engine:
    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer,
        max_model_len: int | None = None,
        spec: SpecConfig | None = None,
        drafter: Drafter | None = None,
        drafter_factory: Callable[[SpecConfig], Drafter] | None = None,
        prefill_chunk: int = 256,
        cost_curve: CostCurve | None = None,
        max_drafters: int = 32,
        trace: SpecTrace | None = None,
    ) -> None:
        if prefill_chunk < 1:
            raise TokenleapError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if max_drafters < 1:
            raise TokenleapError(f"max_drafters must be >= 1, got {max_drafters}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_context = min(max_model_len or model.max_context, model.max_context)
        self.spec = spec
        self.drafter = drafter if spec is not None else None
        self._drafter_factory = drafter_factory
        # Prompts are prefilled in chunks of this many tokens at fixed offsets (0, chunk, ...),
        # so a server can interleave them with decode steps and every path computes the same
        # prompt cache: batched or not, a request's output is the library's output.
        self.prefill_chunk = prefill_chunk
        # one drafter per `SpecConfig.drafter_key` (the config fields its method reads), shared by the
        # requests that use it (global state such as the suffix tree over earlier outputs or the
        # ngram-mod pool lives there); beside the engine's own, the `max_drafters` most recently
        # used are kept and older ones let go (their running requests keep them to the end)
        self.max_drafters = max_drafters
        self._drafters: OrderedDict[tuple[Hashable, ...], Drafter] = OrderedDict()
        if spec is not None and self.drafter is not None:
            self._drafters[spec.drafter_key()] = self.drafter
        self._ids = itertools.count()
        # llguidance's view of the tokenizer, built on first use
        self._grammar_tokenizer: GrammarTokenizer | None = None
        self._cost_curve = cost_curve  # measured on first need unless given (engines on one model can share one)
        # TOKENLEAP_SPEC_TRACE=FILE: one line per verified draft
        self._trace = trace if trace is not None else SpecTrace.from_env()

    def cost_curve(self, cap: int | None = None) -> CostCurve:
        """Relative cost of verifying k drafts. Measured once, on first need, for drafts up to
        the larger of `cap` and the engine's cap (default 16), and never again: a later, larger
        cap extrapolates it, because a measurement stalls every running request for seconds. A
        server measures it before serving (`ensure_cost_curve`) for the largest cap it allows."""
        if self._cost_curve is None:
            own = self.spec.num_speculative_tokens if self.spec is not None else DEFAULT_DRAFT_TOKENS
            self._cost_curve = cached_cost_curve(self.model, max(cap or 0, own))
        return self._cost_curve

    def ensure_cost_curve(self, cap: int) -> CostCurve:
        """Measure the cost curve now unless it already covers drafts of `cap` tokens."""
        if self._cost_curve is None or len(self._cost_curve.relative) <= cap:
            self._cost_curve = cached_cost_curve(self.model, cap)
        return self._cost_curve

    def drafters(self) -> list[Drafter]:
        """Every drafter this engine holds now (its own and those of per-request configs)."""
        return list(self._drafters.values())

    def drafter_for(self, spec: SpecConfig) -> Drafter:
        """The drafter serving `spec` (and every config with its `SpecConfig.drafter_key`), created on first use."""
        key = spec.drafter_key()
        drafter = self._drafters.get(key)
        if drafter is not None:
            self._drafters.move_to_end(key)
            return drafter
        if self._drafter_factory is None:
            raise TokenleapError("this engine cannot create drafters for per-request speculative configs")
        drafter = self._drafters[key] = self._drafter_factory(spec)
        others = [k for k, d in self._drafters.items() if d is not self.drafter]  # oldest first, `key` last
        for old in others[: max(0, len(others) - self.max_drafters)]:
            logger.info("letting go of the least recently used drafter %r (more than %d)", old[0], self.max_drafters)
            del self._drafters[old]
        return drafter

    def check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        """The prompt as a list of ints, or a `TokenleapError` if this engine cannot run it
        (empty, token ids outside the vocabulary, no room left in the context). No allocation:
        callers with many prompts check them all before starting any."""
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise TokenleapError("the prompt is empty")
        check_token_ids(prompt_ids, self.model.config.vocab_size)
        if len(prompt_ids) >= self.max_context:
            raise TokenleapError(
                f"the prompt has {len(prompt_ids)} tokens but the context length is {self.max_context}: "
                "no room left to generate"
            )
        return prompt_ids

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        request_id: str | None = None,
        speculative: SpecConfig | bool = True,
    ) -> Request:
        """A new request. `speculative`: True uses the engine's speculative config (if any),
        False decodes plainly, a `SpecConfig` overrides the engine's for this request."""
        prompt_ids = self.check_prompt(prompt_ids)
        metrics = RequestMetrics(arrival_time=time.time(), num_prompt_tokens=len(prompt_ids))
        spec = self.spec if speculative is True else (speculative or None)
        drafter = self.drafter_for(spec) if spec is not None else None
        controller = None
        # A seeded sampled request keeps a fixed draft length: adaptive lengths come from a
        # timed cost curve, and another length would consume the random stream differently,
        # so the same seed would give different text on another machine.
        if spec is not None and spec.adaptive and (params.greedy or params.seed is None):
            controller = DraftController(
                self.cost_curve(spec.num_speculative_tokens),
                spec.num_speculative_tokens,
                spec.draft_min,
                draft_cost=draft_cost_of(drafter),
            )
        grammar = None
        if params.structured_outputs is not None:
            if self._grammar_tokenizer is None:
                self._grammar_tokenizer = GrammarTokenizer(self.tokenizer.hf, self.model.config.vocab_size)
            grammar = GrammarState(self._grammar_tokenizer, params.structured_outputs, self.tokenizer.eos_token_ids)
        return Request(
            grammar=grammar,
            request_id=request_id or f"req-{next(self._ids)}",
            prompt=prompt,
            prompt_ids=prompt_ids,
            params=params,
            generator=make_generator(params.seed),
            detok=IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
            kv=self.model.new_kv_cache(self.max_context),
            eos_token_ids=self.tokenizer.eos_token_ids,
            max_context=self.max_context,
            metrics=metrics,
            controller=controller,
            spec=spec,
            drafter=drafter,
        )

    def prefill(self, req: Request) -> None:
        """Run the whole prompt; sample the first token from the last prompt position."""
        while not self.prefill_step(req):
            pass

    def _step_threads(self) -> contextlib.AbstractContextManager[None]:
        """Torch's threads for a step's small torch ops (sampling, verification, a head's layer)
        between kernel calls: one with the kernels (see threads.py: torch's OpenMP workers
        otherwise spin beside the kernels' pool; when torch was imported before tokenleap, so
        OMP_WAIT_POLICY=passive never applied, they made decoding 2.2x slower), else torch's."""
        return torch_threads(1) if self.model.kernels is not None else contextlib.nullcontext()

    def prefill_step(self, req: Request) -> bool:
        """Run the next chunk of the prompt (`prefill_chunk` tokens); after the last one, sample
        the first token. Returns whether the prompt is done."""
        with self._step_threads():
            return self._prefill_step(req)

    def _prefill_step(self, req: Request) -> bool:
        t0 = time.perf_counter()
        start = req.kv.length
        end = min(len(req.prompt_ids), start + self.prefill_chunk)
        ids = torch.tensor(req.prompt_ids[start:end], dtype=torch.long)
        layers = hidden_layers(req.drafter)
        out = self.model.forward(
            ids, torch.arange(start, end), req.kv, return_hidden=[layer for layer in layers if layer >= 0]
        )
        if layers:  # a head drafter reads the prompt's target features (same forward)
            features = _with_final(out, layers)
            # layers non-empty: it reads them
            cast(ReadsHiddenStates, req.drafter).observe(req.request_id, start, req.prompt_ids[start:end], features)
            if req.params.n > 1:  # the forked samples' drafters read them too (`fork`)
                req.prompt_features.append(
                    (start, req.prompt_ids[start:end], {k: v.clone() for k, v in features.items()})
                )
        done = end == len(req.prompt_ids)
        if done:
            raw = self.model.compute_logits(out.hidden, [end - start - 1])
            if getattr(req.drafter, "needs_logits", False):  # the last prompt position's row, computed anyway
                cast(ReadsLogits, req.drafter).observe_logits(req.request_id, req.prompt_ids[-1:], raw)
            if req.grammar is not None:
                raw = req.grammar.masked(raw, [])
            if req.params.n > 1:
                req.prompt_logits = raw  # the siblings' first tokens come from it (`fork`)
            tok = sample_next(self._processed(req, raw, [[]])[0], req.params, req.generator)
            entries = self._logprobs(req, raw, [tok])
            self._append(req, [tok], entries)
            req.metrics.first_token_time = time.time()
        req.metrics.prefill_seconds += time.perf_counter() - t0
        return done

    def fork(self, parent: Request, sample_index: int, *, request_id: str | None = None) -> Request:
        """Sample `sample_index` of a prompt whose first sample (`parent`) has just been prefilled
        (parallel sampling, `params.n > 1`): the prompt's KV cache is copied, not recomputed, and
        the first token is sampled from the parent's last prompt row with this sample's own
        generator (seed + `sample_index` when seeded). A drafter reading the target's hidden
        states is given the prompt's, kept from the parent's prefill. On an error nothing is left
        allocated."""
        if parent.prompt_logits is None or parent.kv.length != len(parent.prompt_ids):
            raise TokenleapError("fork needs a request just prefilled with params.n > 1")
        t0 = time.perf_counter()
        p = parent.params
        params = dataclasses.replace(p, seed=None if p.seed is None else p.seed + sample_index)
        child = self.add_request(parent.prompt_ids, params, prompt=parent.prompt, request_id=request_id,
                                 speculative=parent.spec if parent.spec is not None else False)
        try:
            child.kv.free()
            child.kv = parent.kv.fork()
            child.sample_index = sample_index
            self.begin(child)
            if child.drafter is not None and hidden_layers(child.drafter):
                for start, ids, features in parent.prompt_features:
                    cast(ReadsHiddenStates, child.drafter).observe(child.request_id, start, ids, features)
            raw = parent.prompt_logits
            tok = sample_next(self._processed(child, raw, [[]])[0], child.params, child.generator)
            entries = self._logprobs(child, raw, [tok])
            self._append(child, [tok], entries)
        except BaseException:
            self.finish(child, "abort")
            raise
        child.metrics.first_token_time = time.time()
        child.metrics.prefill_seconds += time.perf_counter() - t0
        return child

    def _draft_budget(self, req: Request) -> int:
        """The most draft tokens this step may verify: the cap, bounded by what is left to
        generate and by the context."""
        if req.spec is None or req.drafter is None:
            return 0
        left = req.params.max_tokens - len(req.output_ids) - 1
        room = self.max_context - req.kv.length - 1
        return max(0, min(req.spec.num_speculative_tokens, left, room))

    def _draft_lengths(self, reqs: Sequence[Request]) -> list[int]:
        """How many draft tokens to ask of each request's drafter this step. One request: its
        controller's choice. Several: `plan_batch_drafts` over the batch, so that speculation
        shrinks as the batch fills the forward."""
        budgets = [self._draft_budget(r) for r in reqs]
        if len(reqs) == 1:
            req = reqs[0]
            return [
                req.controller.choose(budgets[0], req.kv.length)
                if req.controller is not None and budgets[0]
                else budgets[0]
            ]
        if not any(budgets):
            return budgets
        alphas = [r.controller.alpha if r.controller is not None else None for r in reqs]
        floors = [r.spec.draft_min if r.spec is not None else 0 for r in reqs]
        curve = self.cost_curve(max(r.spec.num_speculative_tokens for r in reqs if r.spec))
        context = sum(r.kv.length for r in reqs) // len(reqs)
        ks = plan_batch_drafts(curve, alphas, budgets, floors, context=context)
        for i, req in enumerate(reqs):
            if req.controller is not None and budgets[i]:
                if ks[i]:
                    req.controller.steps_off = 0
                else:
                    ks[i] = req.controller.off_step(budgets[i])
        return ks

    def _propose(self, req: Request, budget: int) -> Draft:
        if req.grammar is not None and req.spec is not None:
            forced = req.grammar.forced()[: max(0, min(req.spec.num_speculative_tokens, self._draft_budget(req)))]
            if forced:  # the grammar leaves no choice: these are accepted whatever the target says
                return Draft(forced)
        if budget == 0 or req.drafter is None or req.spec is None:
            return _EMPTY
        t0 = time.perf_counter()
        draft = req.drafter.propose(req.request_id, req.prompt_ids + req.output_ids, budget)
        req.metrics.spec.draft_seconds += time.perf_counter() - t0
        req.metrics.spec.num_propose_calls += 1
        as_tree = (req.params.greedy or req.spec.sampled_tree == "full") and req.grammar is None
        shaped = _shape_draft(draft, budget, req.spec.draft_min, as_tree)
        if req.grammar is not None and len(shaped):  # never verify a token the grammar forbids
            allowed = req.grammar.cut(shaped.tokens)
            shaped = Draft(
                allowed,
                None,
                None if shaped.probs is None else shaped.probs[: len(allowed)],
                shaped.source,
                shaped.setup_seconds,
            )
        return shaped

    def begin(self, req: Request) -> None:
        """Register a request with its drafter (before its prefill)."""
        if req.drafter is not None:
            # a chain weighing its members' drafts
            if isinstance(req.drafter, WeighsCost) and req.controller is not None:
                req.drafter.use_cost_curve(req.controller.curve)
            t0 = time.perf_counter()
            req.drafter.begin(DraftRequest(req.request_id, req.prompt_ids, req.params, req.generator))
            req.metrics.spec.begin_seconds += time.perf_counter() - t0
            req.metrics.spec.num_begin_calls += 1
            if isinstance(req.drafter, MemberStatistics):  # a chain: its members' counters, kept current by it
                req.metrics.spec.members = req.drafter.member_statistics(req.request_id)

    def start(self, req: Request) -> None:
        """Begin a request: register it with its drafter, run the prompt, sample a first token."""
        self.begin(req)
        self.prefill(req)

    def step(self, req: Request) -> None:
        """One decoding step of one request (see `step_batch`)."""
        self.step_batch([req])

    def step_batch(self, reqs: Sequence[Request]) -> None:
        """One decoding step for every running request (none finished): draft, then one target
        forward over each request's last committed token plus its draft (all requests batched),
        verify, commit the verified tokens and roll each KV cache back past the rejected ones.
        The kernels compute each row independently of the others, so a request's output does not
        depend on what it is batched with.

        Transactional: a request whose drafting, verification or commit raises is rolled back to
        its state before the step (`Undo`: its cache, generator and draft controller; nothing
        appended; its drafter not told of the step) and the others are stepped, then
        `StepFailures` names the failed ones (a lone request: its own exception). When the
        batched forward itself raises, every request is rolled back and the exception goes up:
        stepping them one by one tells which one fails."""
        if not reqs:
            return
        with self._step_threads():
            self._step_batch(reqs)

    def _step_batch(self, reqs: Sequence[Request]) -> None:
        t0 = time.perf_counter()
        undo = [Undo.of(req) for req in reqs]
        failures: dict[int, Exception] = {}
        drafts: list[Draft | None] = []
        try:
            lengths = self._draft_lengths(reqs)
        except Exception:
            roll_back(reqs, undo)
            raise
        for i, (req, k) in enumerate(zip(reqs, lengths)):
            try:
                drafts.append(self._propose(req, k))
            except Exception as exc:
                failures[i] = exc
                drafts.append(None)
        t1 = time.perf_counter()
        live = [i for i, d in enumerate(drafts) if d is not None]
        try:
            logits, hidden = (
                self._forward([reqs[i] for i in live], [d for d in drafts if d is not None]) if live else (None, {})
            )
        except Exception:
            roll_back(reqs, undo)
            raise
        t_fwd = time.perf_counter() - t1
        row = 0
        for i in live:
            req, draft = reqs[i], drafts[i]
            assert draft is not None and logits is not None
            n = len(draft) + 1
            try:
                rows_hidden = {layer: hidden[layer][row : row + n] for layer in hidden_layers(req.drafter)}
                self._commit(req, draft, logits[row : row + n], undo[i].kv_length, rows_hidden)
            except Exception as exc:
                failures[i] = exc
            row += n
        roll_back([reqs[i] for i in failures], [undo[i] for i in failures])
        t2 = time.perf_counter()
        for i in live:
            if i not in failures:
                reqs[i].metrics.spec.verify_seconds += t2 - t1
                reqs[i].metrics.decode_seconds += t2 - t0
        ctrl = reqs[0].controller
        if len(reqs) == 1 and ctrl is not None and live and not failures:  # calibrate its cost model on this step
            draft = drafts[0]
            setup = draft.setup_seconds if draft is not None else 0.0  # not a draft token's price
            ctrl.observe_timing(
                t_fwd, t2 - t0 - setup, t1 - t0 - setup, len(draft) if draft is not None else 0, undo[0].kv_length
            )
        if failures:
            if len(reqs) == 1:
                raise failures[0]
            raise StepFailures([(reqs[i], exc) for i, exc in sorted(failures.items())])

    def _forward(
        self, reqs: Sequence[Request], drafts: Sequence[Draft]
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Logits of every request's last committed token and draft, in one batched forward, and
        the target hidden states (rows alike) that the requests' head drafters read."""
        layers = sorted({layer for req in reqs for layer in hidden_layers(req.drafter)})
        seqs = []
        for req, draft in zip(reqs, drafts):
            pos = req.kv.length
            ids = torch.tensor([req.output_ids[-1], *draft.tokens])
            if draft.parents is None:
                seqs.append(SeqInput(ids, torch.arange(pos, pos + len(ids)), req.kv))
            else:  # a token tree: row 0 is the last committed token, node i is row i + 1
                rows = [-1] + [p + 1 for p in draft.parents]
                positions = torch.tensor([pos, *(pos + d for d in tree_depths(draft.parents))])
                seqs.append(SeqInput(ids, positions, req.kv, tree_mask(rows, pos)))
        out = self.model.forward_batch(seqs, return_hidden=[layer for layer in layers if layer >= 0])
        return self.model.compute_logits(out.hidden), _with_final(out, layers)  # [rows, V]

    def _commit(
        self, req: Request, draft: Draft, logits: torch.Tensor, pos: int, hidden: dict[int, torch.Tensor] | None = None
    ) -> None:
        """Verify, tell the drafter, then change the request (what may raise comes first)."""
        spec = req.spec
        target = logits  # the target's own rows, for a drafter that reads logits
        if req.grammar is not None:  # each row masked as plain decoding masks that position (drafts are chains here)
            logits = req.grammar.masked(logits, draft.tokens)
        raw = logits
        logits = self._processed(req, logits, row_prefixes(draft.tokens, draft.parents))
        if spec is not None and spec.acceptance == "typical-lossy" and not req.params.greedy and len(draft):
            # opted in: lossy (the output is no longer distributed as the target's)
            tree = verify_tree_typical(draft.tokens, draft.parents, logits, req.params, req.generator,
                                       spec.typical_threshold, spec.typical_alpha)
            depth = len(draft) if draft.parents is None else max(tree_depths(draft.parents))
            tokens, accepted, path = tree.tokens, tree.num_accepted, (None if draft.parents is None else tree.path)
        elif draft.parents is None:
            result = verify_chain(draft.tokens, logits, req.params, req.generator, draft.probs)
            tokens, accepted, depth, path = result.tokens, result.num_accepted, len(draft), None
        else:  # a token tree: keep the accepted path's slots
            if req.params.greedy:
                tree = verify_tree_greedy(draft.tokens, draft.parents, logits)
            else:
                tree = verify_tree_sampled(draft.tokens, draft.parents, logits, req.params, req.generator, draft.probs)
            tokens, accepted, depth, path = tree.tokens, tree.num_accepted, max(tree_depths(draft.parents)), tree.path
        # the row each committed token came from: row 0, then the row after each accepted node
        rows = [0, *((path[j] + 1) if path is not None else (j + 1) for j in range(len(tokens) - 1))]
        # a copy only when asked
        entries = self._logprobs(req, raw[rows], tokens) if req.params.logprobs is not None else None
        if req.drafter is not None:
            t0 = time.perf_counter()
            req.drafter.accept(req.request_id, tokens, accepted)
            req.metrics.spec.accept_seconds += time.perf_counter() - t0
            req.metrics.spec.num_accept_calls += 1
            if hidden:  # the committed positions' target features: row 0 and the accepted rows
                rows = [0, *(i + 1 for i in (path if path is not None else range(accepted)))]
                ids = [req.output_ids[-1], *tokens[:accepted]]
                cast(ReadsHiddenStates, req.drafter).observe(
                    req.request_id, pos, ids, {layer: h[rows] for layer, h in hidden.items()}
                )  # hidden: its reader
            if getattr(
                req.drafter, "needs_logits", False
            ):  # every verified row: row 0, then each draft node's (rejected ones too)
                cast(ReadsLogits, req.drafter).observe_logits(
                    req.request_id, [req.output_ids[-1], *draft.tokens], target
                )
        if path is None:
            req.kv.truncate(pos + 1 + accepted)
        else:
            req.kv.compact(pos + 1, [pos + 1 + i for i in path])
        kept = self._append(req, tokens, entries)  # fewer than committed when a stop came first
        req.metrics.num_decode_tokens += kept
        req.metrics.spec.record(len(draft), min(accepted, kept - 1), depth)
        if draft.source is not None:  # a chain member's draft: its own statistics count it too
            req.metrics.spec.member(draft.source).record(len(draft), min(accepted, kept - 1), depth)
        if self._trace is not None and len(draft) and spec is not None:
            method = "+".join(spec.chain) if spec.chain else spec.method
            self._trace.step(req.request_id, method, req.metrics.num_forward_passes, draft.tokens, draft.parents,
                             min(accepted, kept - 1))
        if req.controller is not None:
            req.controller.update(depth, accepted)
        req.metrics.num_forward_passes += 1

    def _append(self, req: Request, tokens: Sequence[int], entries: list[dict[int, Logprob]] | None) -> int:
        """Append committed tokens (up to a stop); their logprobs; advance the grammar past them
        and end the request when the grammar is complete."""
        before = len(req.output_ids)
        kept = req.append_tokens(tokens)
        if entries is not None:
            req.add_logprobs(entries)
        if req.grammar is not None:
            req.grammar.commit(req.output_ids[before:])
            if req.grammar.finished and not req.finished:
                req.finish_reason, req.stop_reason = "stop", None
                req.text += req.detok.flush()
        return kept

    def _logprobs(self, req: Request, rows: torch.Tensor, tokens: Sequence[int]) -> list[dict[int, Logprob]] | None:
        """vLLM-style logprobs of the committed tokens from their raw rows, when asked for."""
        if req.params.logprobs is None:
            return None
        return token_logprobs(
            rows, tokens, req.params.logprobs, lambda t: self.tokenizer.decode([t], skip_special_tokens=False)
        )

    def _processed(self, req: Request, logits: torch.Tensor, prefixes: list[list[int]]) -> torch.Tensor:
        """The request's context processors (penalties, min_tokens) on its verify rows, each row
        with its own context (`processors.py`), exactly as plain decoding processes that position."""
        p = req.params
        if not needs_processing(p):
            return logits
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids))
        return process_rows(logits, p, req.prompt_ids, req.output_ids, prefixes, stop_ids)

    def finish(self, req: Request, reason: str | None = None) -> None:
        """End a request (finished, or aborted with `reason`): free its cache, release its
        drafter state. Safe to call more than once."""
        if req.released:
            return
        req.released = True
        if reason is not None and req.finish_reason is None:
            req.finish_reason = reason
        req.metrics.finished_time = time.time()
        req.kv.free()
        if req.drafter is not None:
            req.drafter.end(req.request_id)

    def stream(self, req: Request) -> Iterator[str]:
        """Run a request to completion, yielding text deltas as they become final."""
        try:
            self.start(req)
            delta = req.take_delta()
            if delta:
                yield delta
            while not req.finished:
                self.step(req)
                delta = req.take_delta()
                if delta:
                    yield delta
        finally:
            self.finish(req, "abort")

    def run(self, req: Request) -> Request:
        for _ in self.stream(req):
            pass
        return req


def _shape_draft(draft: Draft, budget: int, draft_min: int, as_tree: bool) -> Draft:
    """A drafter's proposal as the step verifies it: at most `budget` tokens (a tree keeps its
    first `budget` nodes, still a tree), none when shorter than `draft_min`; a tree is verified
    as a tree when `as_tree` (greedy requests, and sampled ones unless `sampled_tree` is
    "first-path") and otherwise reduced to its first root path; a tree that is a chain becomes one."""
    tokens, parents, probs = list(draft.tokens), draft.parents, draft.probs
    if parents is not None:
        try:
            check_parents(list(parents), len(tokens))
        except ValueError as exc:
            raise TokenleapError(f"drafter returned a malformed tree: {exc}") from exc
        parents = list(parents[:budget])
    tokens = tokens[:budget]
    if probs is not None and len(probs) > budget:
        probs = probs[:budget]
    if parents is not None and (not as_tree or parents == list(range(-1, len(parents) - 1))):
        path = first_path(parents)
        tokens = [tokens[i] for i in path]
        probs = probs[path] if probs is not None else None
        parents = None
    if len(tokens) < max(1, draft_min):
        return Draft(setup_seconds=draft.setup_seconds) if draft.setup_seconds else _EMPTY
    return Draft(tokens, parents, probs, draft.source, draft.setup_seconds)
