"""Sampled token-tree verification: agreement with the Python-loop reference, exact cases, and
chi-squared losslessness over random trees (depth 2-3, branching 1-4) for deterministic
siblings, siblings drawn i.i.d. from q and siblings drawn without replacement; the same tests
reject deliberately wrong verifiers."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tokenleap.sampling import SamplingParams, logits_to_probs
from tokenleap.verify.reference import verify_tree_sampled_reference
from tokenleap.verify.tree import TreeVerifyResult, verify_tree_greedy
from tokenleap.verify.tree_sampling import (
    children_of,
    sample_inverse_cdf,
    verify_tree_sampled,
    without_replacement_rows,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- vs the reference


def _random_tree(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(-1, i - 1) for i in range(n)]


@pytest.mark.parametrize("mode", ["deterministic", "iid", "without-replacement"])
def test_matches_reference_on_random_cases(mode: str) -> None:
    rng = random.Random({"deterministic": 1, "iid": 2, "without-replacement": 3}[mode])
    depths_seen: set[int] = set()
    for case in range(200):
        vocab, n = rng.randint(4, 40), rng.randint(0, 12)
        parents = _random_tree(rng, n)
        g = torch.Generator().manual_seed(case)
        logits = torch.randn(n + 1, vocab, generator=g) * rng.choice((0.5, 1.0, 3.0))
        params = SamplingParams(
            temperature=rng.choice((0.5, 1.0, 1.5)),
            top_k=rng.choice((0, 1, 3)),
            top_p=rng.choice((1.0, 0.8)),
            min_p=rng.choice((0.0, 0.1)),
        )
        p = logits_to_probs(logits, params)
        q = None
        if mode == "deterministic":
            tokens = [int(p[parents[i] + 1].argmax()) if rng.random() < 0.5 else rng.randrange(vocab) for i in range(n)]
        else:
            q_parent = torch.softmax(torch.randn(n + 1, vocab, generator=g) * 2, dim=-1)
            if mode == "iid":
                q = q_parent[[parents[i] + 1 for i in range(n)]] if n else None
                tokens = [int(torch.multinomial(q_parent[parents[i] + 1], 1, generator=g)) for i in range(n)]
            else:
                tokens, q_rows = [0] * n, torch.zeros(n, vocab)
                for parent, kids in children_of(parents).items():
                    drawn = torch.multinomial(q_parent[parent + 1], len(kids), replacement=False, generator=g).tolist()
                    rows = without_replacement_rows(q_parent[parent + 1], drawn)
                    for j, c in enumerate(kids):
                        tokens[c], q_rows[c] = drawn[j], rows[j]
                q = q_rows if n else None
        fast = verify_tree_sampled(tokens, parents, logits, params, gen_fast := torch.Generator().manual_seed(case), q)
        ref = verify_tree_sampled_reference(
            tokens, parents, logits, params, gen_ref := torch.Generator().manual_seed(case), q
        )
        assert (fast.tokens, fast.path) == ref, f"case {case}"
        assert torch.equal(gen_fast.get_state(), gen_ref.get_state())
        assert fast.num_accepted == len(fast.path) and fast.tokens[:-1] == [tokens[i] for i in fast.path]
        assert all(parents[b] == a for a, b in zip([-1] + fast.path, fast.path))  # a root path
        depths_seen.add(fast.num_accepted)
    assert {0, 1, 2} <= depths_seen


def test_greedy_params_give_greedy_tree_verification() -> None:
    logits = torch.randn(4, 7, generator=torch.Generator().manual_seed(0))
    tokens, parents = [int(logits[0].argmax()), 1, int(logits[1].argmax())], [-1, -1, 0]
    greedy = SamplingParams(temperature=0.0)
    assert verify_tree_sampled(tokens, parents, logits, greedy, torch.Generator()) == verify_tree_greedy(
        tokens, parents, logits
    )


def test_bad_shapes_raise() -> None:
    params = SamplingParams(temperature=1.0)
    with pytest.raises(ValueError, match="need 3 target rows"):
        verify_tree_sampled([1, 2], [-1, 0], torch.zeros(2, 5), params, torch.Generator())
    with pytest.raises(ValueError, match="draft_probs must be"):
        verify_tree_sampled([1, 2], [-1, 0], torch.zeros(3, 5), params, torch.Generator(), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="parents must precede"):
        verify_tree_sampled([1, 2], [1, -1], torch.zeros(3, 5), params, torch.Generator())


def test_certain_child_is_always_taken_and_repeated_siblings_never() -> None:
    # top_k=1: p is one-hot on each row's argmax; the second root child (same token as a
    # rejected first child) and masked-out children can never be committed
    logits = torch.tensor(
        [[0.0, 5.0, 1.0, 0.0], [0.0, 0.0, 0.0, 4.0], [3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 2.0, 0.0], [1.0, 0, 0, 0]]
    )
    params = SamplingParams(temperature=1.0, top_k=1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        # root children: node 0 (token 2, masked out), node 1 (token 2 again), node 2 (token 1, certain)
        r = verify_tree_sampled([2, 2, 1, 2], [-1, -1, -1, 2], logits, params, gen)
        assert (r.tokens, r.path) == ([1, 2, 0], [2, 3])


def test_inverse_cdf_never_picks_zero_mass() -> None:
    dist = torch.tensor([0.0, 0.3, 0.0, 0.7, 0.0])
    assert [sample_inverse_cdf(dist, u) for u in (0.0, 0.29, 0.31, 0.999999, 1.0 - 1e-17)] == [1, 1, 3, 3, 3]


def test_without_replacement_rows() -> None:
    q = torch.tensor([0.5, 0.25, 0.25])
    rows = without_replacement_rows(q, [0, 2])
    assert torch.allclose(rows, torch.tensor([[0.5, 0.25, 0.25], [0.0, 0.5, 0.5]]))


# --------------------------------------------------------------------------- chi-squared losslessness

V = 5
ALPHA = 1e-3
N_DRAWS = 12_000
N_CONTROL = 3_000
T = SamplingParams(temperature=1.0)
Verifier = Callable[..., TreeVerifyResult]


@functools.cache
def _row(prefix: tuple[int, ...], salt: int, scale: float = 1.6) -> torch.Tensor:
    """A deterministic function of the token prefix: the target's logits (salt 0) or a draft
    model's logits (salt 1), like a language model's next-token distribution."""
    g = torch.Generator().manual_seed(hash((salt, prefix)) % 2**31)
    return torch.randn(V, generator=g) * scale


@functools.cache
def _p(prefix: tuple[int, ...], params: SamplingParams = T) -> torch.Tensor:
    return logits_to_probs(_row(prefix, 0).unsqueeze(0), params)[0]


@functools.cache
def _q(prefix: tuple[int, ...]) -> torch.Tensor:
    return torch.softmax(_row(prefix, 1, 1.0), dim=-1)


@functools.cache
def _stacked(paths: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    return torch.stack([_row(ctx, 0) for ctx in paths])


class TreeDrafter:
    """Random tree shapes of depth 2-3, branching 1-4 (a fixed shape per seed). Deterministic:
    the siblings are distinct tokens chosen once per prefix (some likely, some not). iid /
    without-replacement: drawn from the draft model's q at the parent, per call."""

    def __init__(self, seed: int, mode: str) -> None:
        rng = random.Random(seed)
        self.mode = mode
        depth = rng.choice((2, 3))
        self.parents: list[int] = []
        frontier = [-1]
        for _ in range(depth):
            nxt = []
            for node in frontier:
                for _ in range(rng.randint(1, 4) if node == -1 or rng.random() < 0.6 else 0):
                    self.parents.append(node)
                    nxt.append(len(self.parents) - 1)
            frontier = nxt or frontier[:1]
        self.salt = seed
        self.g = torch.Generator().manual_seed(seed + 7)

    def propose(self, prefix: tuple[int, ...]) -> tuple[list[int], torch.Tensor | None]:
        n = len(self.parents)
        tokens, q_rows = [0] * n, torch.zeros(n, V)
        paths: dict[int, tuple[int, ...]] = {-1: prefix}
        for parent, kids in children_of(self.parents).items():
            ctx = paths[parent]
            if self.mode == "deterministic":
                order = random.Random(hash((self.salt, ctx))).sample(range(V), len(kids))
                drawn, rows = order, None
            elif self.mode == "iid":
                drawn = torch.multinomial(_q(ctx), len(kids), replacement=True, generator=self.g).tolist()
                rows = _q(ctx).expand(len(kids), V)
            else:
                drawn = torch.multinomial(_q(ctx), len(kids), replacement=False, generator=self.g).tolist()
                rows = without_replacement_rows(_q(ctx), drawn)
            for j, c in enumerate(kids):
                tokens[c] = drawn[j]
                paths[c] = ctx + (drawn[j],)
                if rows is not None:
                    q_rows[c] = rows[j]
        return tokens, (None if self.mode == "deterministic" else q_rows)

    def logits(self, prefix: tuple[int, ...], tokens: Sequence[int]) -> torch.Tensor:
        paths = [prefix]
        for t, parent in zip(tokens, self.parents):
            paths.append(paths[parent + 1] + (t,))
        return _stacked(tuple(paths))


def joint_counts(verifier: Verifier, drafter: TreeDrafter, length: int, n: int, seed: int) -> np.ndarray:
    """Histogram of the first `length` tokens of a decoding loop that drafts a tree per step."""
    gen = torch.Generator().manual_seed(seed)
    counts = np.zeros((V,) * length, dtype=np.int64)
    for _ in range(n):
        out: tuple[int, ...] = ()
        while len(out) < length:
            tokens, q = drafter.propose(out)
            out += tuple(verifier(tokens, drafter.parents, drafter.logits(out, tokens), T, gen, q).tokens)
        counts[out[:length]] += 1
    return counts


def true_joint(length: int) -> np.ndarray:
    joint = np.zeros((V,) * length)
    for idx in np.ndindex(*joint.shape):
        joint[idx] = np.prod([float(_p(idx[:i])[idx[i]]) for i in range(length)])
    return joint


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-squared p-value; an observation in a zero-probability cell gives 0.0; cells
    expected below 5 are pooled."""
    counts, probs = np.asarray(counts, dtype=np.float64).ravel(), np.asarray(probs, dtype=np.float64).ravel()
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    obs, exp = counts[support], probs[support] / probs[support].sum() * counts.sum()
    small = exp < 5
    if small.any():
        obs, exp = np.append(obs[~small], obs[small].sum()), np.append(exp[~small], exp[small].sum())
    return float(chisquare(obs, exp).pvalue) if len(obs) > 1 else 1.0


def stale_walk(fix_acceptance: bool, fix_residual: bool) -> Verifier:
    """Deliberately wrong verifiers: the acceptance test keeps using the node's original p
    instead of the residual (`fix_acceptance=False`), or the last token is drawn from the
    node's original p instead of the residual (`fix_residual=False`)."""

    def verify(
        tokens: Sequence[int],
        parents: Sequence[int],
        logits: torch.Tensor,
        params: SamplingParams,
        gen: torch.Generator,
        q: torch.Tensor | None = None,
    ) -> TreeVerifyResult:
        kids = children_of(parents)
        node, path = -1, []
        while True:
            p0 = logits_to_probs(logits[node + 1 : node + 2], params)[0].double()
            p = p0
            for c in kids.get(node, []):
                x = tokens[c]
                qc = torch.zeros(V, dtype=torch.float64) if q is None else q[c].double()
                if q is None:
                    qc[x] = 1.0
                test = p if fix_acceptance else p0
                if float(torch.rand((), generator=gen, dtype=torch.float64)) * float(qc[x]) < float(test[x]):
                    path.append(c)
                    node = c
                    break
                r = (p - qc).clamp_min(0.0)
                p = r / r.sum() if float(r.sum()) > 0 else p
            else:
                last = int(torch.multinomial(p if fix_residual else p0, 1, generator=gen))
                return TreeVerifyResult([tokens[i] for i in path] + [last], len(path), path)

    return verify


WRONG = {"stale-acceptance": stale_walk(False, True), "stale-residual": stale_walk(True, False)}
CASES = [(3, "deterministic"), (8, "deterministic"), (5, "iid"), (6, "iid"), (7, "without-replacement")]


@pytest.mark.parametrize(("seed", "mode"), CASES, ids=[f"{m}-{s}" for s, m in CASES])
def test_joint_of_first_tokens_is_plain_sampling(seed: int, mode: str) -> None:
    drafter = TreeDrafter(seed, mode)
    assert any(parents == -1 for parents in drafter.parents[1:])  # at least two root siblings
    length = 3 if seed % 2 else 2
    joint = true_joint(length)
    pvalue = chi2_pvalue(joint_counts(verify_tree_sampled, drafter, length, N_DRAWS, seed), joint)
    assert pvalue >= ALPHA, f"verify_tree_sampled on tree {drafter.parents}: p={pvalue:.3g}"
    for name, wrong in WRONG.items():
        bad = chi2_pvalue(joint_counts(wrong, TreeDrafter(seed, mode), length, N_CONTROL, seed), joint)
        assert bad < ALPHA, f"{name} passed (p={bad:.3g}) on tree {drafter.parents}: the test has no power"


def test_correct_walk_of_the_control_family_passes() -> None:
    """The controls differ from a correct verifier only by their deliberate bug."""
    drafter = TreeDrafter(3, "deterministic")
    pvalue = chi2_pvalue(joint_counts(stale_walk(True, True), drafter, 2, N_DRAWS, 3), true_joint(2))
    assert pvalue >= ALPHA


def test_top_p_and_min_p_apply() -> None:
    """With processors on, every emitted token lies in the processed support and the first
    token follows the processed distribution."""
    params = SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05)
    drafter = TreeDrafter(3, "deterministic")
    gen = torch.Generator().manual_seed(1)
    p0 = _p((), params).double().numpy()
    assert 0 < (p0 == 0).sum() < V - 1
    counts = np.zeros(V, dtype=np.int64)
    for _ in range(N_DRAWS):
        tokens, _ = drafter.propose(())
        counts[verify_tree_sampled(tokens, drafter.parents, drafter.logits((), tokens), params, gen).tokens[0]] += 1
    assert chi2_pvalue(counts, p0) >= ALPHA
