"""Token Recycling (Luo et al., 2024, "Turning Trash into Treasure: Accelerating Inference of Large
Language Models with Token Recycling"): training-free, model-free token trees built from the
candidates the target itself ranked, and verification would otherwise throw away.

An adjacency table M holds, for every token t the target has been run on at some position, the
`recycling_topk` (k = 8) token ids with the largest logits there: what the target considered next
after t. The engine hands the drafter the raw logits it computed anyway (`ReadsLogits`): the last
prompt position's at prefill, and after each verification every verified row, the rejected draft
nodes' too (the paper updates M from the whole draft tree: each row is a real target row for its
node's token in its context). Each row overwrites M[t] (the latest context wins; within one step
the first row of a token: row 0, then the draft's order, so a chain's committed rows win).

Each step drafts a token tree from the last committed token by breadth-first expansion along a
static template, `recycling_branching` = (b0, b1, ...): the root's children are M[last][:b0], each
child c's children are M[c][:b1], and so on, siblings best first, nodes in breadth-first order up
to the step's node budget. The default, (2, 2, 1), is at most 2 + 4 + 4 = 10 nodes: the target's
two likeliest next tokens, two continuations of each, one more after those. CPU verification is
not free (10 rows cost ~1.5 one-row forwards on the default model), and on the default model it
gave the most tokens per unit of verify cost of the templates tried (wider or deeper trees get
more tokens per step, fewer per cost). A row never written (-1) has no children. Greedy requests
verify the tree with `verify_tree_greedy`, sampled ones with the lossless multi-candidate walk
(deterministic drafts: no q).

The table outlives requests, as the paper keeps it across queries, and the drafters of one
registry with the same k share one (a [vocab, k] int32 array, allocated at the first write: 1.5 MiB
for a 49k vocabulary). A seeded sampled request (`DraftRequest.request_local`) drafts from a table
of its own (the rows its own steps wrote, made at `begin`, dropped at `end`), so its text is a
function of its seed, prompt and configuration; its rows still feed the shared table (see
`tokenleap.drafters.base`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from tokenleap.drafters.base import Draft, DraftRequest
from tokenleap.drafters.methods import MethodRecord, option, options_of
from tokenleap.errors import TokenleapError

if TYPE_CHECKING:
    from tokenleap.drafters.spec import SpecConfig

DEFAULT_TOPK = 8
DEFAULT_BRANCHING = (2, 2, 1)
MAX_DEPTH = 32
_CHUNK = 64  # columns per chunk of `top_candidates`


def top_candidates(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The ids of each row's k largest logits, best first ([n, V] -> [n, min(k, V)] int64). The
    top k lie in the k chunks of 64 columns with the largest maxima (a column elsewhere has k
    larger ones, one in each of those), so one `amax` pass and a `topk` over those chunks (and the
    ragged tail) do it, 3-4x faster on a CPU than `torch.topk` over whole rows."""
    n, vocab = logits.shape
    k = min(k, vocab)
    chunks = vocab // _CHUNK
    if chunks <= k:
        return torch.topk(logits, k).indices
    best = torch.topk(logits[:, : chunks * _CHUNK].reshape(n, chunks, _CHUNK).amax(dim=2), k).indices  # [n, k]
    cols = (best.unsqueeze(-1) * _CHUNK + torch.arange(_CHUNK)).reshape(n, k * _CHUNK)
    if vocab > chunks * _CHUNK:
        cols = torch.cat([cols, torch.arange(chunks * _CHUNK, vocab).expand(n, -1)], dim=1)
    return torch.gather(cols, 1, torch.topk(torch.gather(logits, 1, cols), k).indices)


class AdjacencyTable:
    """M: each token's `k` recycled candidates, best first. Dense (the shared table: a
    [vocab, k] int32 array, -1 where never written, allocated at the first write) or sparse (a
    request's own: a dict of the rows it wrote)."""

    def __init__(self, k: int = DEFAULT_TOPK, dense: bool = True) -> None:
        if k < 1:
            raise TokenleapError(f"recycling_topk must be >= 1, got {k}")
        self.k = k
        self.dense = dense
        self._array: np.ndarray | None = None
        self._rows: dict[int, list[int]] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of the dense array (0 until the first write, and for a sparse table)."""
        return 0 if self._array is None else int(self._array.nbytes)

    def write(self, token_ids: Sequence[int], top: np.ndarray, vocab: int) -> None:
        """M[token_ids[i]] = top[i] (distinct token ids; `top`: [n, <= k] ids, best first)."""
        if not self.dense:
            for t, row in zip(token_ids, top.tolist()):
                self._rows[int(t)] = row
            return
        if self._array is None or len(self._array) < vocab:
            grown = np.full((vocab, self.k), -1, dtype=np.int32)
            if self._array is not None:
                grown[: len(self._array)] = self._array
            self._array = grown
        self._array[np.asarray(token_ids, dtype=np.int64), : top.shape[1]] = top

    def children(self, token: int, width: int) -> list[int]:
        """M[token][:width] (fewer where the row holds fewer; none for a row never written)."""
        if not self.dense:
            return self._rows.get(token, [])[:width]
        array = self._array
        if array is None or not 0 <= token < len(array):
            return []
        return [t for t in array[token, :width].tolist() if t >= 0]


class TableStore:
    """The shared tables of one owner (a drafter registry), one per k."""

    def __init__(self) -> None:
        self._tables: dict[int, AdjacencyTable] = {}

    def get(self, k: int) -> AdjacencyTable:
        if k not in self._tables:
            self._tables[k] = AdjacencyTable(k)
        return self._tables[k]


def build_tree(table: AdjacencyTable, root: int, branching: Sequence[int], budget: int) -> tuple[list[int], list[int]]:
    """(tokens, parents) of the tree grown breadth-first from `root`: each node at depth d (the
    root's children: d = 0) gets M[token][:branching[d]] as children, best first, until the
    template ends, a level is empty or `budget` nodes are drafted. parents[i] = -1 for a child of
    the root, else the index of its parent (always before it)."""
    tokens: list[int] = []
    parents: list[int] = []
    level = [(-1, root)]
    for width in branching:
        below: list[tuple[int, int]] = []
        for parent, token in level:
            for child in table.children(token, width):
                if len(tokens) >= budget:
                    return tokens, parents
                tokens.append(child)
                parents.append(parent)
                below.append((len(tokens) - 1, child))
        if not below:
            break
        level = below
    return tokens, parents


class TokenRecyclingDrafter:
    name: ClassVar[str] = "recycling"
    needs_hidden_states: ClassVar[bool] = False
    needs_logits: ClassVar[bool] = True

    def __init__(
        self,
        topk: int = DEFAULT_TOPK,
        branching: Sequence[int] = DEFAULT_BRANCHING,
        table: AdjacencyTable | None = None,
    ) -> None:
        self.branching = parse_branching(branching, topk)
        if table is not None and table.k != topk:
            raise TokenleapError(f"the recycling table keeps {table.k} candidates per token, expected {topk}")
        self.table = table if table is not None else AdjacencyTable(topk)
        self.k = topk
        self._local: dict[str, AdjacencyTable] = {}  # request-local tables (seeded sampled requests)

    def begin(self, request: DraftRequest) -> None:
        if request.request_local:
            self._local[request.request_id] = AdjacencyTable(self.k, dense=False)

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        if max_tokens <= 0 or not tokens:
            return Draft()
        table = self._local.get(request_id, self.table)
        draft, parents = build_tree(table, int(tokens[-1]), self.branching, max_tokens)
        return Draft(draft, parents) if draft else Draft()

    def observe_logits(self, request_id: str, token_ids: Sequence[int], logits: torch.Tensor) -> None:
        """M[token_ids[i]] = the top k of logits[i]: the first row of a token repeated in one call wins."""
        first: dict[int, int] = {}
        for i, t in enumerate(token_ids):
            first.setdefault(int(t), i)
        top = top_candidates(logits, self.k).numpy()
        if len(first) < len(token_ids):
            top = top[list(first.values())]
        ids, vocab = list(first), int(logits.shape[1])
        self.table.write(ids, top, vocab)
        local = self._local.get(request_id)
        if local is not None:
            local.write(ids, top, vocab)

    def accept(self, request_id: str, tokens: Sequence[int], num_accepted: int) -> None:
        return None

    def end(self, request_id: str) -> None:
        self._local.pop(request_id, None)  # its rows stay in the shared table


def parse_branching(value: Any, topk: int = DEFAULT_TOPK) -> tuple[int, ...]:
    """A tree template: a tuple or list of ints, or a comma list ("2,2,1"); each width in
    1..topk, 1..32 depths."""
    try:
        widths = tuple(int(w) for w in (value.split(",") if isinstance(value, str) else value))
    except (TypeError, ValueError):
        raise TokenleapError(f"recycling_branching must be a comma list of ints, e.g. '2,2,1', got {value!r}") from None
    if not 1 <= len(widths) <= MAX_DEPTH or not all(1 <= w <= topk for w in widths):
        raise TokenleapError(
            f"recycling_branching needs 1..{MAX_DEPTH} widths, each in 1..recycling_topk ({topk}), got {value!r}"
        )
    return widths


def tables_shared(registry: Any) -> dict[str, Any]:
    """What the recycling drafters of one registry share: one table per k."""
    return {"recycling_tables": TableStore()}


@dataclass(frozen=True)
class RecyclingOptions:
    """Token Recycling's options: the table's width and the draft tree's template."""

    recycling_topk: int = option(DEFAULT_TOPK, help="candidates kept per token in the adjacency table (k)",
                                 flags=("--spec-recycling-topk",), per_request=False)
    recycling_branching: tuple[int, ...] | str = option(
        ",".join(map(str, DEFAULT_BRANCHING)),
        help="children per node at each depth of the draft tree, from the root (a comma list)",
        flags=("--spec-recycling-branching",),
    )

    def __post_init__(self) -> None:
        if self.recycling_topk < 1:
            raise TokenleapError(f"recycling_topk must be >= 1, got {self.recycling_topk}")
        object.__setattr__(self, "recycling_branching", parse_branching(self.recycling_branching, self.recycling_topk))


def _build(
    config: SpecConfig, *, recycling_tables: TableStore, **_: Any
) -> TokenRecyclingDrafter:  # one table per k for a registry
    opts = options_of(config, "recycling", RecyclingOptions)
    k = opts.recycling_topk
    return TokenRecyclingDrafter(k, parse_branching(opts.recycling_branching, k), table=recycling_tables.get(k))


METHOD = MethodRecord(
    "recycling",
    _build,
    "Token Recycling: token trees from the target's own top-k after each token, recycled from verification",
    options=RecyclingOptions,
    aliases=("token-recycling",),
    shared=tables_shared,
    doc="Token Recycling (Luo et al., 2024): a token tree grown from an adjacency table of the target's top-k "
    "candidates after each token, recycled from the rows verification computed (`drafters/recycling.py`)",
)
