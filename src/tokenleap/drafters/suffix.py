"""Suffix decoding (Oliaro et al., 2024, "SuffixDecoding: Extreme Speculative Decoding for
Emerging AI Applications"; the `suffix_decoding` of Snowflake's ArcticInference).

Two frequency-counted suffix tries, cut at `max_depth` tokens, index text: one per request over
its prompt and output, extended as tokens are committed, and one global trie over the outputs of
finished requests (at most `max_cached_requests`, evicted first in, first out). A node counts
how often its path occurred, so a child's probability given its parent is child.count /
parent.count. To propose, every suffix of the context that matches a path (tracked
incrementally: one step per new token) is a starting point; from it the drafter follows the
most frequent child while the product of those probabilities stays >= `min_token_prob`, for at
most ceil(match_length * max_spec_factor + max_spec_offset) tokens. A walk scores the sum of its
products (the expected number of accepted tokens); the best walk over both tries is the draft.
In a request's own trie the context's own occurrence, which has no continuation yet, is left
out of the first probability, so both tries estimate on the same footing.

A seeded sampled request (`DraftRequest.request_local`) drafts from its own trie only, so its
text does not depend on which outputs the global trie holds; its output still joins the global
trie when it ends (see `tokenleap.drafters.base`).

A path that occurred once is stored as one lazy node pointing into its sequence and is expanded
into child nodes only when a second occurrence arrives, so a trie grows with the repeated text,
not with length x max_depth.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Any, ClassVar

from tokenleap.drafters.base import Draft, DraftRequest
from tokenleap.drafters.methods import MethodRecord, option, options_of
from tokenleap.errors import TokenleapError

if TYPE_CHECKING:
    from tokenleap.drafters.spec import SpecConfig

logger = logging.getLogger(__name__)


class _Node:
    """A trie node whose path (root to here, `depth` tokens) occurred `count` times.

    A node with count 1 is lazy: `children` is None and its one occurrence continues with
    `seq[pos:]` (implicit nodes of count 1, down to depth max_depth or the sequence's end).
    """

    __slots__ = ("token", "depth", "count", "children", "best", "seq", "pos")

    def __init__(self, token: int, depth: int, seq: Sequence[int] = (), pos: int = 0) -> None:
        self.token = token
        self.depth = depth
        self.count = 1
        self.children: dict[int, _Node] | None = None
        self.best: _Node | None = None  # the most frequent child (ties: the latest to grow)
        self.seq = seq
        self.pos = pos


Location = tuple[_Node, int]  # (node, k): k tokens down the node's lazy chain (0 if expanded)


@dataclass
class Speculation:
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # cumulative path probability per token
    score: float = 0.0  # sum of probs: the expected number of accepted tokens
    match_len: int = 0


class SuffixTree:
    """A depth-bounded suffix trie with occurrence counts over several token sequences."""

    def __init__(self, max_depth: int = 64) -> None:
        if max_depth < 1:
            raise TokenleapError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node(-1, 0)
        self.root.count, self.root.children = 0, {}
        self.version = 0  # changes whenever sequences are added or removed
        self._seqs: dict[Hashable, list[int]] = {}
        self._active: dict[Hashable, list[_Node]] = {}  # per growing sequence: its repeated suffixes

    def __len__(self) -> int:
        return len(self._seqs)

    def sequence(self, seq_id: Hashable) -> list[int]:
        return self._seqs[seq_id]

    # ------------------------------------------------------------------ building

    def extend(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """Append tokens to the growing sequence `seq_id` (created if new), indexing the suffixes
        they end. A growing sequence must be its tree's only one: another sequence's arrival or
        removal could expand or collapse the node its live end sits in behind its back."""
        if any(other != seq_id for other in self._seqs):
            raise ValueError("a growing sequence must be the only sequence in its SuffixTree")
        seq = self._seqs.setdefault(seq_id, [])
        self._active[seq_id] = self._index(seq, self._active.get(seq_id, []), tokens)

    def insert(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """Index a complete sequence (it will not grow)."""
        if seq_id in self._seqs or self._active:
            raise ValueError(f"cannot insert {seq_id!r}: already indexed, or a sequence is growing")
        self._index(self._seqs.setdefault(seq_id, []), [], tokens)

    def _index(self, seq: list[int], active: list[_Node], tokens: Sequence[int]) -> list[_Node]:
        for token in tokens:
            seq.append(token)
            active = self._append(seq, active, token)
        self.version += 1
        return active

    def _append(self, seq: list[int], active: list[_Node], token: int) -> list[_Node]:
        """Extend every suffix of `seq` ending at the new last token. Suffixes that occurred only
        once sit in lazy chains that extend themselves; `active` holds the others (expanded
        nodes, longest first; consumed). Returns the new active list."""
        root, max_depth = self.root, self.max_depth
        root.count += 1
        kept: list[_Node] = []
        active.append(root)
        for node in active:
            depth, children = node.depth, node.children
            if depth >= max_depth:
                continue
            assert children is not None  # active nodes are expanded (children is None only on lazy ones)
            child = children.get(token)
            if child is None:  # first occurrence of this path: a lazy leaf
                child = children[token] = _Node(token, depth + 1, seq, len(seq))
            else:
                if child.children is None:
                    self._expand(child)
                child.count += 1
                kept.append(child)
            if depth and (node.best is None or child.count >= node.best.count):
                node.best = child
        return kept

    def _expand(self, node: _Node) -> None:
        """Turn a lazy node into an expanded one: its single occurrence becomes a lazy child."""
        seq, pos = node.seq, node.pos
        node.children, node.seq = {}, ()
        if pos < len(seq) and node.depth < self.max_depth:
            child = _Node(seq[pos], node.depth + 1, seq, pos + 1)
            node.children[child.token] = node.best = child

    # ------------------------------------------------------------------ removal

    def remove(self, seq_id: Hashable) -> None:
        """Subtract a sequence's occurrences; nodes left with count 0 are pruned and nodes left
        with count 1 collapse back into lazy chains."""
        seq = self._seqs.pop(seq_id)
        self._active.pop(seq_id, None)
        for start in range(len(seq)):
            self._remove_suffix(seq, start)
        self.version += 1

    def _remove_suffix(self, seq: list[int], start: int) -> None:
        node, single = self.root, None
        node.count -= 1
        for token in seq[start : start + self.max_depth]:
            children = node.children
            assert children is not None  # lazy nodes have count 1: the walk breaks at one before descending into it
            child = children[token]
            child.count -= 1
            if child.count == 0:
                del children[token]
            if node.best is child:
                node.best = max(reversed(children.values()), key=attrgetter("count"), default=None)
            if child.count == 0:
                break
            if child.count == 1 and single is None:
                single = child
            node = child
        if single is not None:
            self._collapse(single)

    def _collapse(self, node: _Node) -> None:
        """Make an expanded node of count 1 lazy again, pointing at its remaining occurrence."""
        below: list[int] = []
        leaf = node
        while leaf.children:
            leaf = next(iter(leaf.children.values()))  # count 1: at most one child
            below.append(leaf.token)
        if leaf.children is None and leaf.pos >= len(below):
            node.seq, node.pos = leaf.seq, leaf.pos - len(below)
        else:
            tail = leaf.seq[leaf.pos : leaf.pos + self.max_depth - leaf.depth] if leaf.children is None else []
            node.seq, node.pos = below + list(tail), 0
        node.children = node.best = None

    # ------------------------------------------------------------------ matching

    def active(self, seq_id: Hashable) -> list[Location]:
        """Locations of the growing sequence's own suffixes that occurred before, longest first
        (its other suffixes occurred only once, so nothing ever followed them)."""
        return [(node, 0) for node in self._active.get(seq_id, ())]

    def _step(self, node: _Node, k: int, token: int) -> Location | None:
        if node.children is not None:
            child = node.children.get(token)
            return None if child is None else (child, 0)
        i = node.pos + k
        if node.depth + k < self.max_depth and i < len(node.seq) and node.seq[i] == token:
            return node, k + 1
        return None

    def advance(self, locations: Sequence[Location], token: int) -> list[Location]:
        """The matching suffixes after `token` is appended to the context, longest first."""
        out = []
        for node, k in (*locations, (self.root, 0)):
            nxt = self._step(node, k, token)
            if nxt is not None:
                out.append(nxt)
        return out

    def match(self, context: Sequence[int]) -> list[Location]:
        """Locations of every suffix of `context` (up to max_depth tokens) found in the trie,
        longest first."""
        locations: list[Location] = []
        for token in context[-self.max_depth :]:
            locations = self.advance(locations, token)
        return locations

    def count(self, path: Sequence[int]) -> int:
        """How many times `path` occurred (0 when absent or longer than max_depth)."""
        loc: Location = (self.root, 0)
        for token in path:
            step = self._step(*loc, token)
            if step is None:
                return 0
            loc = step
        return loc[0].count if len(path) else self.root.count

    def num_nodes(self) -> int:
        stack, n = [self.root], 0
        while stack:
            node = stack.pop()
            n += 1
            stack.extend((node.children or {}).values())
        return n

    # ------------------------------------------------------------------ speculation

    def speculate(
        self,
        locations: Sequence[Location],
        max_tokens: int,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
        exclude: int = 0,
    ) -> Speculation:
        """The best-scoring greedy walk from any of `locations` (longest match first; a shorter
        match must score strictly higher to win). `exclude` occurrences ending at each location
        (the context's own, in its request's tree) are left out of the first probability.

        A match one token shorter with the same count occurred only where the longer one did, so
        its walk is the same and is skipped unless the longer walk hit the depth bound."""
        best, prev = Speculation(), (-1, 0, True)  # previous match: (length, count, walk cut at depth)
        for node, k in locations:
            match_len = node.depth + k
            limit = min(max_tokens, math.ceil(match_len * max_spec_factor + max_spec_offset - 1e-6))
            if limit <= best.score:  # no shorter match can do better
                break
            if prev[:2] == (match_len + 1, node.count) and not prev[2]:
                prev = (match_len, node.count, False)
                continue
            spec, end_depth = self._walk(node, k, limit, min_token_prob, exclude)
            prev = (match_len, node.count, end_depth >= self.max_depth)
            if spec.score > best.score:
                best, spec.match_len = spec, match_len
        return best

    def _walk(
        self, node: _Node, k: int, limit: int, min_token_prob: float, exclude: int = 0
    ) -> tuple[Speculation, int]:
        """Follow the most frequent child; returns the walk and the depth where it ended."""
        spec, prob = Speculation(), 1.0
        while len(spec.tokens) < limit:
            if node.children is None:  # inside a lazy chain: one occurrence, probability 1
                i = node.pos + k
                if node.depth + k >= self.max_depth or i >= len(node.seq):
                    break
                token, k = node.seq[i], k + 1
            else:
                child = node.best
                if child is None:
                    break
                prob *= child.count / (node.count - exclude)
                exclude = 0
                if prob < min_token_prob:
                    break
                token, node, k = child.token, child, 0
            spec.tokens.append(token)
            spec.probs.append(prob)
            spec.score += prob
        return spec, node.depth + k


@dataclass(frozen=True)
class SuffixConfig:
    max_depth: int = 64  # longest suffix indexed and matched
    max_spec_factor: float = 1.0  # draft at most ceil(match_length * factor + offset) tokens
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1  # stop the draft when its path probability drops below this
    max_cached_requests: int = 1000  # finished outputs kept in the global trie (0: none)

    def __post_init__(self) -> None:
        if self.max_depth < 1:
            raise TokenleapError(f"suffix max_depth must be >= 1, got {self.max_depth}")
        if self.max_spec_factor < 0:
            raise TokenleapError(f"suffix max_spec_factor must be >= 0, got {self.max_spec_factor}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise TokenleapError(f"suffix min_token_prob must be in [0, 1], got {self.min_token_prob}")
        if self.max_cached_requests < 0:
            raise TokenleapError(f"suffix max_cached_requests must be >= 0, got {self.max_cached_requests}")


@dataclass
class _RequestState:
    local: SuffixTree  # sequence 0: the request's prompt + output so far
    prompt_len: int
    local_only: bool = False  # a seeded sampled request: never reads the global trie
    pending: list[int] = field(default_factory=list)  # accepted since the last propose
    global_locs: list[Location] = field(default_factory=list)
    global_version: int = -1  # the global trie's version global_locs were computed for

    @property
    def tokens(self) -> list[int]:
        return self.local.sequence(0)


class SuffixDrafter:
    """Suffix decoding over a per-request trie and a global trie shared by all requests."""

    name: ClassVar[str] = "suffix"
    needs_hidden_states: ClassVar[bool] = False

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config or SuffixConfig()
        self.global_tree = SuffixTree(self.config.max_depth)
        self._cached: deque[int] = deque()  # global sequence ids, oldest first
        self._next_id = 0
        self._requests: dict[str, _RequestState] = {}

    def begin(self, request: DraftRequest) -> None:
        self._requests[request.request_id] = self._new_state(request.prompt_ids, request.request_local)

    def _new_state(self, prompt: Sequence[int], local_only: bool = False) -> _RequestState:
        local = SuffixTree(self.config.max_depth)
        local.extend(0, [int(t) for t in prompt])
        return _RequestState(local, len(prompt), local_only)

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        state = self._sync(request_id, tokens)
        if max_tokens <= 0:
            return Draft()
        c = self.config
        args = (max_tokens, c.max_spec_factor, c.max_spec_offset, c.min_token_prob)
        best = state.local.speculate(state.local.active(0), *args, exclude=1)
        if state.global_locs:
            other = self.global_tree.speculate(state.global_locs, *args)
            if other.score > best.score:
                best = other
        return Draft(best.tokens)

    def _sync(self, request_id: str, tokens: Sequence[int]) -> _RequestState:
        """Index the context's tokens not seen before (tokens are only ever appended)."""
        state = self._requests.get(request_id)
        if state is None or not _extends(tokens, state.tokens):
            if state is not None:
                logger.debug("request %s: context does not extend the indexed tokens; reindexing", request_id)
            prompt_len = len(tokens) if state is None else min(state.prompt_len, len(tokens))
            local_only = state is not None and state.local_only
            state = self._requests[request_id] = self._new_state(tokens[:prompt_len], local_only)
        new = [int(t) for t in tokens[len(state.tokens) :]]
        if new:
            state.local.extend(0, new)
        if not state.local_only:
            self._match_global(state, new)
        state.pending.clear()
        return state

    def _match_global(self, state: _RequestState, new: Sequence[int]) -> None:
        tree = self.global_tree
        if state.global_version != tree.version:  # the trie changed: match from scratch
            state.global_locs = tree.match(state.tokens) if len(tree) else []
            state.global_version = tree.version
        else:
            for token in new:
                state.global_locs = tree.advance(state.global_locs, token)

    def accept(self, request_id: str, tokens: Sequence[int], num_accepted: int) -> None:
        state = self._requests.get(request_id)
        if state is not None:
            state.pending.extend(int(t) for t in tokens)

    def end(self, request_id: str) -> None:
        state = self._requests.pop(request_id, None)
        if state is not None:
            self.cache_output(state.tokens[state.prompt_len :] + state.pending)

    def global_size(self) -> int:
        """Nodes of the tree over earlier outputs (a replica reports it)."""
        return len(self.global_tree)

    def learn(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Learn from an answer produced elsewhere (another replica): as if a request of this
        drafter had ended with it."""
        self.cache_output([int(t) for t in output_ids])

    def cache_output(self, output: Sequence[int]) -> None:
        """Add a finished output to the global trie, evicting the oldest beyond the limit."""
        if self.config.max_cached_requests == 0 or not output:
            return
        self.global_tree.insert(self._next_id, output)
        self._cached.append(self._next_id)
        self._next_id += 1
        while len(self._cached) > self.config.max_cached_requests:
            self.global_tree.remove(self._cached.popleft())


def _extends(tokens: Sequence[int], indexed: Sequence[int]) -> bool:
    """Whether `tokens` continues `indexed` (checked at the last indexed token: O(1))."""
    n = len(indexed)
    return len(tokens) >= n and (n == 0 or tokens[n - 1] == indexed[n - 1])


@dataclass(frozen=True)
class SuffixOptions:
    """The suffix method's options (vLLM's `suffix_decoding_*` keys)."""

    suffix_decoding_max_tree_depth: int = option(
        64, help="longest suffix indexed and matched", flags=("--spec-suffix-max-tree-depth",), request_max=256
    )
    suffix_decoding_max_spec_factor: float = option(
        1.0, help="draft at most factor x match length tokens", flags=("--spec-suffix-max-spec-factor",), request_max=64
    )
    suffix_decoding_min_token_prob: float = option(
        0.1, help="stop a draft below this path probability", flags=("--spec-suffix-min-token-prob",)
    )
    suffix_decoding_max_cached_requests: int = option(1000, help="finished outputs kept in the global tree (FIFO)",
                                                      flags=("--spec-suffix-max-cached-requests",), per_request=False)

    def __post_init__(self) -> None:
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_spec_factor < 0:
            raise TokenleapError(
                f"need suffix_decoding_max_tree_depth >= 1 and suffix_decoding_max_spec_factor >= 0, got "
                f"{self.suffix_decoding_max_tree_depth} and {self.suffix_decoding_max_spec_factor}"
            )
        if not 0 <= self.suffix_decoding_min_token_prob <= 1 or self.suffix_decoding_max_cached_requests < 0:
            raise TokenleapError(
                f"need suffix_decoding_min_token_prob in [0, 1] and suffix_decoding_max_cached_requests >= 0, got "
                f"{self.suffix_decoding_min_token_prob} and {self.suffix_decoding_max_cached_requests}"
            )


def _build(config: SpecConfig, **_: Any) -> SuffixDrafter:
    opts = options_of(config, "suffix", SuffixOptions)
    return SuffixDrafter(
        SuffixConfig(
            max_depth=opts.suffix_decoding_max_tree_depth,
            max_spec_factor=opts.suffix_decoding_max_spec_factor,
            min_token_prob=opts.suffix_decoding_min_token_prob,
            max_cached_requests=opts.suffix_decoding_max_cached_requests,
        )
    )


METHOD = MethodRecord(
    "suffix",
    _build,
    "suffix trees per request and over earlier outputs (SuffixDecoding); `auto` (the command line's "
    "default) names it: measured never to lose, the adaptive controller turning it off where nothing repeats",
    options=SuffixOptions,
    aliases=("auto",),
)
