"""The drafter that runs any draft head (`tokenleap.heads.base.DraftHead`: EAGLE-3, EAGLE-1/2,
MTP layers) for the engine, drafting chains (topk = 1) or EAGLE-2 dynamic trees (Li et al., 2024,
"EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees"), and the drafter of
Medusa's parallel heads (`MedusaDrafter`).

Runtime contract with the engine (`needs_hidden_states`): the engine asks the target's forward
for the head's `hidden_layers` in the same forward that prefills or verifies, and hands the rows
of the committed positions to `observe`. The head's KV cache holds only positions built from the
target's true features; draft rows go past them and are dropped at the next `propose`, which
first rebuilds the head's KV for the newly accepted positions from their true features. Every
piece of per-request state is keyed by the token prefix it was built from, so a step the engine
rolls back can never leave stale state. Drafts are the greedy argmax over the draft vocabulary:
deterministic, so sampled requests stay lossless too.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from tokenleap.drafters.base import Draft, DraftRequest
from tokenleap.heads.base import FINAL_HIDDEN, DraftHead, HeadKV
from tokenleap.kv.cache import common_prefix

if TYPE_CHECKING:
    from tokenleap.heads.medusa import MedusaHeads


@dataclass(frozen=True)
class TreeShape:
    """EAGLE-2 dynamic tree: `topk` children per expanded node and `topk` frontier nodes per
    depth, `depth` levels, then the best nodes by cumulative draft probability (the engine's
    budget) are kept. topk = 1 is a chain."""

    topk: int = 1
    depth: int = 6



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


# the method that runs a head of each kind (`LayerHead.kind`): a head drafter's name
_METHOD_OF_KIND = {"EAGLE-3": "eagle3", "EAGLE-1/2": "eagle", "MTP": "mtp"}


def head_method(head: DraftHead) -> str:
    """The method a head is run by, from its kind: "eagle3", "eagle" (EAGLE-1/2) or "mtp"; "head"
    for another kind."""
    return _METHOD_OF_KIND.get(str(getattr(head, "kind", "")), "head")


class HeadDrafter:
    """Drafts chains (topk = 1) or EAGLE-2 dynamic trees from any `DraftHead`; greedy argmax
    over the draft vocabulary, deterministic drafts (lossless for sampled requests too). Its
    `name` is the method of the head it runs (`head_method`: eagle3, eagle or mtp)."""

    name: str
    needs_hidden_states: ClassVar[bool] = True
    drafts_with_model: ClassVar[bool] = True  # a chain asks draftless members first (base.DraftsWithModel)

    def __init__(self, head: DraftHead, tree: TreeShape = TreeShape(), relative_draft_cost: float = 0.0) -> None:
        self.head = head
        self.name = head_method(head)
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
        c = min(common_prefix(st.feat_tokens, tokens), len(tokens) - 1)
        if c < len(st.feat_tokens):
            st.truncate(c)
        L = len(st.feat_tokens)
        if L == 0 or L != len(tokens) - 1:
            return 0
        ck = common_prefix(st.kv_tokens, tokens)
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
        # deeper than the budget cannot be kept
        head, topk, depth = self.head, self.tree.topk, min(self.tree.depth, budget)
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


@dataclass
class _MedusaState:
    prefix: list[int]  # x_0 .. x_p: the tokens up to the position of `feature`
    feature: torch.Tensor | None = None  # [1, H] the target's final hidden state at position p


class MedusaDrafter:
    """Chains of each Medusa head's argmax, or a dynamic tree over their top-k tokens."""

    name: ClassVar[str] = "medusa"
    needs_hidden_states: ClassVar[bool] = True
    drafts_with_model: ClassVar[bool] = True  # a chain asks draftless members first (base.DraftsWithModel)
    hidden_layers = (FINAL_HIDDEN,)

    def __init__(self, heads: MedusaHeads, topk: int = 1) -> None:
        self.heads = heads
        self.topk = topk  # 1: a chain of each head's argmax; k > 1: a tree (`_tree`)
        self._states: dict[str, _MedusaState] = {}

    def begin(self, request: DraftRequest) -> None:
        self._states[request.request_id] = _MedusaState([])

    def end(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def accept(self, request_id: str, tokens: Sequence[int], num_accepted: int) -> None:
        return None

    def observe(self, request_id: str, start: int, token_ids: Sequence[int], hidden: dict[int, torch.Tensor]) -> None:
        st = self._states.get(request_id)
        if st is None or not len(token_ids):
            return
        if start > len(st.prefix):  # positions missing: the kept prefix no longer leads here
            st.prefix, st.feature = [], None
            return
        st.prefix = st.prefix[:start] + [int(t) for t in token_ids]
        st.feature = hidden[FINAL_HIDDEN][-1:].float()

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        st = self._states.get(request_id)
        if st is None or st.feature is None or max_tokens <= 0:
            return Draft()
        # the feature must be the one of position len(tokens) - 2, reached by these very tokens
        if len(st.prefix) != len(tokens) - 1 or list(tokens[: len(st.prefix)]) != st.prefix:
            return Draft()
        with torch.inference_mode():
            k = min(max_tokens, self.heads.num_heads)
            if self.topk <= 1:
                return Draft([int(self.heads.logits(i, st.feature)[0].argmax()) for i in range(k)])
            return self._tree(st.feature, k, max_tokens)

    def _tree(self, feature: torch.Tensor, depth: int, budget: int) -> Draft:
        """A dynamic tree: head d's top-k tokens are the candidate children at depth d + 1 (the
        heads do not see the path, so every node's candidates are alike); the `topk` best
        nodes by cumulative log-probability are expanded per depth and the best `budget`
        candidates kept (ancestors first on ties, so the kept set is a tree)."""
        scores: list[float] = []
        toks: list[int] = []
        parents: list[int] = []
        depths: list[int] = []
        frontier = [-1]
        for d in range(depth):
            top = torch.log_softmax(self.heads.logits(d, feature), dim=-1)[0].topk(self.topk)
            cands = list(zip(top.values.tolist(), top.indices.tolist()))
            children = []
            for parent in frontier:
                base = scores[parent] if parent >= 0 else 0.0
                for lp, tok in cands:
                    scores.append(base + lp)
                    toks.append(int(tok))
                    parents.append(parent)
                    depths.append(d + 1)
                    children.append(len(scores) - 1)
            frontier = sorted(children, key=lambda i: -scores[i])[: self.topk]
        keep = sorted(range(len(scores)), key=lambda i: (-scores[i], depths[i], i))[:budget]
        kept = set(keep)
        order = sorted(
            (i for i in keep if parents[i] < 0 or parents[i] in kept), key=lambda i: (depths[i], -scores[i], i)
        )
        index = {c: j for j, c in enumerate(order)}
        order = [i for i in order if parents[i] < 0 or parents[i] in index]
        index = {c: j for j, c in enumerate(order)}
        return Draft([toks[i] for i in order], [index[parents[i]] if parents[i] >= 0 else -1 for i in order])
