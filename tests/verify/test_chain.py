"""Chain verification: exact greedy cases, agreement with the slow reference, and chi-squared losslessness of
speculative sampling."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tokenleap.sampling import SamplingParams, logits_to_probs
from tokenleap.verify.chain import VerifyResult, verify_chain
from tokenleap.verify.reference import verify_chain_reference

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny tensors: intra-op threads only add overhead (4-5x per call on a shared 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

# --------------------------------------------------------------------------- greedy, exact


def _logits_with_argmax(argmaxes: Sequence[int], vocab: int = 10, seed: int = 0) -> torch.Tensor:
    """[len(argmaxes), vocab] random logits whose row i has its unique maximum at argmaxes[i]."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(argmaxes), vocab, generator=g)
    for i, a in enumerate(argmaxes):
        logits[i, a] = logits[i].max() + 1.0
    return logits


def test_greedy_perfect_match_accepts_all_and_adds_bonus() -> None:
    logits = _logits_with_argmax([4, 7, 1, 9])
    result = verify_chain([4, 7, 1], logits, GREEDY, torch.Generator().manual_seed(0))
    assert result == VerifyResult([4, 7, 1, 9], 3)


def test_greedy_early_mismatch_accepts_prefix_then_target_argmax() -> None:
    logits = _logits_with_argmax([4, 7, 1, 9])
    result = verify_chain([4, 3, 1], logits, GREEDY, torch.Generator().manual_seed(0))
    assert result == VerifyResult([4, 7], 1)


def test_greedy_mismatch_at_first_position() -> None:
    logits = _logits_with_argmax([4, 7, 1, 9])
    result = verify_chain([5, 7, 1], logits, GREEDY, torch.Generator().manual_seed(0))
    assert result == VerifyResult([4], 0)


def test_greedy_later_matches_after_a_mismatch_do_not_count() -> None:
    logits = _logits_with_argmax([2, 2, 2, 2])
    result = verify_chain([2, 0, 2], logits, GREEDY, torch.Generator().manual_seed(0))
    assert result == VerifyResult([2, 2], 1)


def test_greedy_empty_draft_gives_argmax_of_row_0() -> None:
    logits = _logits_with_argmax([6])
    result = verify_chain([], logits, GREEDY, torch.Generator().manual_seed(0))
    assert result == VerifyResult([6], 0)


def test_greedy_ties_take_the_first_index() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 0.0, 0.0]])
    assert verify_chain([1], logits, GREEDY, torch.Generator()) == VerifyResult([1, 0], 1)
    assert verify_chain([2], logits, GREEDY, torch.Generator()) == VerifyResult([1], 0)


def test_greedy_ignores_draft_probs() -> None:
    logits = _logits_with_argmax([3, 5, 8])
    q = torch.full((2, 10), 0.1)
    assert verify_chain([3, 5], logits, GREEDY, torch.Generator(), q) == VerifyResult([3, 5, 8], 2)


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0)], ids=["greedy", "sampling"])
@pytest.mark.parametrize(("k", "rows"), [(3, 3), (3, 5), (0, 2), (2, 0)])
def test_wrong_number_of_rows_raises(params: SamplingParams, k: int, rows: int) -> None:
    logits = torch.zeros(rows, 8)
    with pytest.raises(ValueError, match=f"need {k + 1} target rows"):
        verify_chain(list(range(k)), logits, params, torch.Generator().manual_seed(0))


def test_sampling_draft_outside_support_is_always_rejected() -> None:
    # top_k=2 masks token 5 out of p_0: it can never be committed, whatever the uniforms
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0, 0.0, 1.0], [0.0] * 6])
    params = SamplingParams(temperature=1.0, top_k=2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        result = verify_chain([5], logits, params, gen)
        assert result.num_accepted == 0
        assert result.tokens[0] in (0, 1)


def test_sampling_draft_with_probability_one_is_always_accepted() -> None:
    # top_k=1 makes p_0 one-hot on token 2: a deterministic draft of 2 must always pass
    logits = torch.tensor([[0.0, 1.0, 4.0, 0.5], [0.0, 0.0, 0.0, 9.0]])
    params = SamplingParams(temperature=1.0, top_k=1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        assert verify_chain([2], logits, params, gen) == VerifyResult([2, 3], 1)


# --------------------------------------------------------------------------- vs the reference

TEMPERATURES = (0.5, 1.0, 1.5)
TOP_PS = (1.0, 0.9, 0.5)
MIN_PS = (0.0, 0.05, 0.2)


def _random_case(
    rng: random.Random, probabilistic: bool
) -> tuple[list[int], torch.Tensor, SamplingParams, torch.Tensor | None]:
    """A random verification problem: draft, target logits, sampling params, draft probs."""
    vocab = rng.randint(8, 50)
    k = rng.randint(0, 6)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    logits = torch.randn(k + 1, vocab, generator=g) * rng.choice((0.5, 1.0, 2.0, 4.0))
    top_k = rng.choice((0, -1, 1, 2, rng.randint(1, vocab), vocab + 3))
    params = SamplingParams(
        temperature=rng.choice(TEMPERATURES), top_k=top_k, top_p=rng.choice(TOP_PS), min_p=rng.choice(MIN_PS)
    )
    p = logits_to_probs(logits, params)
    draft_probs = None
    if probabilistic:
        # q: a random distribution per row, sometimes close to p, sometimes with a sparse support
        q = torch.softmax(torch.randn(k, vocab, generator=g) * rng.choice((0.5, 2.0, 5.0)), dim=-1)
        if rng.random() < 0.3:
            q = 0.5 * q + 0.5 * p[:k]
        draft_probs = q / q.sum(dim=-1, keepdim=True)
        draft = [int(torch.multinomial(draft_probs[i], 1, generator=g)) for i in range(k)]
    else:
        # mix target-likely tokens (acceptances) and arbitrary ones (rejections)
        draft = [int(p[i].argmax()) if rng.random() < 0.6 else rng.randrange(vocab) for i in range(k)]
    return draft, logits, params, draft_probs


def _assert_same_as_reference(
    draft: list[int], logits: torch.Tensor, params: SamplingParams, draft_probs: torch.Tensor | None, seed: int
) -> None:
    gen_fast = torch.Generator().manual_seed(seed)
    gen_ref = torch.Generator().manual_seed(seed)
    fast = verify_chain(draft, logits, params, gen_fast, draft_probs)
    ref = verify_chain_reference(draft, logits, params, gen_ref, draft_probs)
    context = f"draft={draft} params={params} V={logits.shape[1]} q={'yes' if draft_probs is not None else 'no'}"
    assert fast == ref, context
    # both consumed exactly the same randomness, so later draws would agree too
    assert torch.equal(gen_fast.get_state(), gen_ref.get_state()), context
    # structural invariants of any chain verification
    n = fast.num_accepted
    assert 0 <= n <= len(draft)
    assert len(fast.tokens) == n + 1
    assert fast.tokens[:n] == draft[:n]
    assert all(isinstance(t, int) for t in fast.tokens)


@pytest.mark.parametrize("probabilistic", [False, True], ids=["deterministic-draft", "probabilistic-draft"])
def test_matches_reference_on_random_cases(probabilistic: bool) -> None:
    rng = random.Random(1234 + probabilistic)
    num_accepted_seen: set[int] = set()
    for case in range(300):
        draft, logits, params, q = _random_case(rng, probabilistic)
        _assert_same_as_reference(draft, logits, params, q, seed=case)
        num_accepted_seen.add(verify_chain(draft, logits, params, torch.Generator().manual_seed(case), q).num_accepted)
    # the cases exercised rejections at the start, partial and full acceptance
    assert {0, 1, 2, 3} <= num_accepted_seen


def test_matches_reference_greedy_random_cases() -> None:
    rng = random.Random(99)
    for case in range(300):
        draft, logits, _, _ = _random_case(rng, probabilistic=False)
        _assert_same_as_reference(draft, logits, GREEDY, None, seed=case)


def test_matches_reference_when_q_equals_p() -> None:
    # q == p exactly: every draft token is accepted (u * q < p for u < 1 whenever q > 0)
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=0.8, top_p=0.9)
    p = logits_to_probs(logits, params)
    g = torch.Generator().manual_seed(6)
    for seed in range(50):
        draft = [int(torch.multinomial(p[i], 1, generator=g)) for i in range(3)]
        _assert_same_as_reference(draft, logits, params, p[:3].clone(), seed)
        assert verify_chain(draft, logits, params, torch.Generator().manual_seed(seed), p[:3].clone()).num_accepted == 3


# --------------------------------------------------------------------------- chi-squared losslessness

N_DRAWS = 20_000
N_CONTROL = 4_000  # draws for the deliberately wrong verifiers: detecting them with fewer draws is the harder test
ALPHA = 1e-3  # significance; all seeds are fixed, so each test's outcome is deterministic

Verifier = Callable[[Sequence[int], torch.Tensor, SamplingParams, torch.Generator, "torch.Tensor | None"], VerifyResult]

# Six-token target rows for positions 0..3, fixed (independent of the context, like a unigram model).
TARGET_LOGITS = torch.tensor(
    [
        [2.0, 1.5, 1.0, 0.3, -0.5, -1.0],
        [-1.0, 0.0, 1.8, 0.5, 1.2, -0.3],
        [0.5, -0.5, 0.0, 2.0, 0.3, 1.0],
        [1.0, 1.0, 0.0, -1.0, 0.5, 0.2],
    ]
)
# Draft distributions q for positions 0..3, deliberately unlike p.
DRAFT_PROBS = torch.tensor(
    [
        [0.05, 0.40, 0.05, 0.30, 0.15, 0.05],
        [0.30, 0.05, 0.10, 0.05, 0.20, 0.30],
        [0.20, 0.30, 0.20, 0.05, 0.20, 0.05],
        [0.10, 0.10, 0.40, 0.10, 0.20, 0.10],
    ]
)
T1 = SamplingParams(temperature=1.0)


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-squared p-value of observed counts against expected probabilities.

    An observation in a zero-probability cell gives 0.0 (impossible outcome); cells whose
    expected count is below 5 are pooled into one.
    """
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    assert counts.shape == probs.shape
    total = counts.sum()
    assert total > 0
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    obs, exp = counts[support], probs[support] / probs[support].sum() * total
    small = exp < 5
    if small.any():
        obs = np.append(obs[~small], obs[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
    if len(obs) < 2:
        return 1.0
    return float(chisquare(obs, exp).pvalue)


def assert_follows(counts: np.ndarray, probs: np.ndarray, what: str) -> None:
    pvalue = chi2_pvalue(counts, probs)
    assert pvalue >= ALPHA, (
        f"{what}: chi-squared p={pvalue:.3g}\nobserved {counts.tolist()}\n"
        f"expected {(np.asarray(probs) * counts.sum()).round(1).tolist()}"
    )


def assert_detects(counts: np.ndarray, probs: np.ndarray, what: str) -> None:
    """The same statistic must reject a deliberately wrong verifier (the test has power)."""
    pvalue = chi2_pvalue(counts, probs)
    assert pvalue < ALPHA, (
        f"{what}: a biased verifier passed the chi-squared test (p={pvalue:.3g}); the test has no power"
    )


# Deliberately wrong verifiers, to show each statistical test would catch a broken algorithm.


def accept_always(
    draft: Sequence[int],
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,
) -> VerifyResult:
    p = logits_to_probs(target_logits, params)
    bonus = int(torch.multinomial(p[len(draft)], 1, generator=generator))
    return VerifyResult(list(draft) + [bonus], len(draft))


def resample_from_p(
    draft: Sequence[int],
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,
) -> VerifyResult:
    """Correct acceptance test, but the recovered token is drawn from p instead of the residual."""
    p = logits_to_probs(target_logits, params)
    for i, x in enumerate(draft):
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if float(torch.rand((), generator=generator, dtype=torch.float64)) * q_x >= float(p[i, x]):
            return VerifyResult(list(draft[:i]) + [int(torch.multinomial(p[i], 1, generator=generator))], i)
    return VerifyResult(list(draft) + [int(torch.multinomial(p[len(draft)], 1, generator=generator))], len(draft))


def bonus_from_wrong_row(
    draft: Sequence[int],
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,
) -> VerifyResult:
    """Correct except for an off-by-one: the bonus token is drawn from p_{k-1} instead of p_k."""
    result = verify_chain(draft, target_logits, params, generator, draft_probs)
    k = len(draft)
    if k == 0 or result.num_accepted < k:
        return result
    p = logits_to_probs(target_logits, params)
    return VerifyResult(list(draft) + [int(torch.multinomial(p[k - 1], 1, generator=generator))], k)


def _drafts(
    k: int, fixed: Sequence[int] | None, n: int, seed: int, q_rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """n drafts of length k: fixed tokens (q one-hot, probs None) or tokens sampled from q_rows
    (default DRAFT_PROBS[:k]), returned with q."""
    if fixed is not None:
        return torch.tensor(list(fixed[:k])).repeat(n, 1), None
    g = torch.Generator().manual_seed(seed)
    q = DRAFT_PROBS[:k] if q_rows is None else q_rows
    cols = [torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(k)]
    return torch.stack(cols, dim=1), q


def first_token_counts(
    verifier: Verifier,
    k: int,
    fixed: Sequence[int] | None,
    params: SamplingParams,
    seed: int = 0,
    q_rows: torch.Tensor | None = None,
    n: int = N_DRAWS,
) -> np.ndarray:
    """Histogram of the first committed token over n independent verifications of a k-token draft."""
    drafts, q = _drafts(k, fixed, n, seed + 1, q_rows)
    gen = torch.Generator().manual_seed(seed)
    logits = TARGET_LOGITS[: k + 1]
    counts = np.zeros(TARGET_LOGITS.shape[1], dtype=np.int64)
    for row in drafts.tolist():
        counts[verifier(row, logits, params, gen, q).tokens[0]] += 1
    return counts


def target_probs(params: SamplingParams) -> np.ndarray:
    return logits_to_probs(TARGET_LOGITS, params).double().numpy()


def _check_first_token(
    k: int,
    fixed: Sequence[int] | None,
    params: SamplingParams,
    seed: int,
    q_rows: torch.Tensor | None = None,
    wrong: Sequence[Verifier] = (accept_always, resample_from_p),
) -> None:
    p0 = target_probs(params)[0]
    assert_follows(first_token_counts(verify_chain, k, fixed, params, seed, q_rows), p0, "verify_chain")
    for verifier in wrong:
        assert_detects(first_token_counts(verifier, k, fixed, params, seed, q_rows, N_CONTROL), p0, verifier.__name__)


@pytest.mark.parametrize(
    ("draft", "what"), [((0, 2, 3), "likely (p~0.42)"), ((5, 2, 3), "unlikely (p~0.02)")], ids=["likely", "unlikely"]
)
def test_first_token_follows_p0_deterministic_drafter(draft: tuple[int, ...], what: str) -> None:
    p0 = target_probs(T1)[0]
    assert (p0[draft[0]] > 0.3) if draft[0] == 0 else (p0[draft[0]] < 0.05), what
    _check_first_token(3, draft, T1, seed=11)


def test_first_token_follows_p0_probabilistic_drafter() -> None:
    p0 = target_probs(T1)[0]
    assert np.abs(p0 - DRAFT_PROBS[0].numpy()).sum() > 0.5  # q really differs from p
    _check_first_token(2, None, T1, seed=12)


# temperature 0.7 then top-k 4 then top-p 0.9 then min-p 0.05 on row 0: tokens 0, 1, 2 survive
FILTERED = SamplingParams(temperature=0.7, top_k=4, top_p=0.9, min_p=0.05)


def test_filtered_target_distribution_is_what_we_expect() -> None:
    p = target_probs(FILTERED)
    assert np.flatnonzero(p[0]).tolist() == [0, 1, 2]  # hand check: top-k keeps 0..3, top-p drops 3
    assert np.allclose(p.sum(axis=1), 1.0)
    plain = torch.softmax(TARGET_LOGITS[0, :3] / 0.7, dim=-1).double().numpy()
    assert np.allclose(p[0, :3], plain, atol=1e-6)


@pytest.mark.parametrize(
    ("fixed", "k"),
    [((1, 3, 0), 3), ((4, 0, 0), 2), (None, 2)],
    ids=["deterministic-in-support", "deterministic-masked", "probabilistic"],
)
def test_first_token_follows_p0_with_top_k_and_top_p(fixed: tuple[int, ...] | None, k: int) -> None:
    if fixed is None:
        # a drafter sampling under the same processors: q = DRAFT_PROBS renormalised on p's support
        q = DRAFT_PROBS[:k] * torch.from_numpy(target_probs(FILTERED)[:k] > 0)
        _check_first_token(k, None, FILTERED, seed=13, q_rows=q / q.sum(dim=-1, keepdim=True))
    elif fixed[0] == 4:
        # token 4 is outside p_0's support: always rejected, and the residual is p_0 itself,
        # so recovering from p would be right here; only accepting it can be wrong
        assert target_probs(FILTERED)[0, 4] == 0.0
        _check_first_token(k, fixed, FILTERED, seed=13, wrong=(accept_always,))
    else:
        _check_first_token(k, fixed, FILTERED, seed=13)


def test_first_token_follows_p0_at_high_temperature_with_min_p() -> None:
    params = SamplingParams(temperature=1.5, min_p=0.2)
    p0 = target_probs(params)[0]
    assert 0 < (p0 == 0).sum() < 6  # min-p removed some tokens, not all
    _check_first_token(2, (1, 2), params, seed=14)


def _second_token_given_first_accepted(
    verifier: Verifier, k: int, fixed: Sequence[int] | None, seed: int, n: int = N_DRAWS
) -> np.ndarray:
    drafts, q = _drafts(k, fixed, n, seed + 1)
    gen = torch.Generator().manual_seed(seed)
    counts = np.zeros(6, dtype=np.int64)
    for row in drafts.tolist():
        result = verifier(row, TARGET_LOGITS[: k + 1], T1, gen, q)
        if result.num_accepted >= 1:
            counts[result.tokens[1]] += 1
    return counts


@pytest.mark.parametrize(
    ("k", "fixed"),
    [(1, (0,)), (2, (0, 2)), (2, (0, 5)), (2, None)],
    ids=["bonus", "accept-likely", "accept-unlikely", "probabilistic"],
)
def test_second_token_given_first_accepted_follows_p1(k: int, fixed: tuple[int, ...] | None) -> None:
    p1 = target_probs(T1)[1]
    counts = _second_token_given_first_accepted(verify_chain, k, fixed, seed=21)
    assert counts.sum() > 3000  # enough accepted first tokens for the test to mean something
    assert_follows(counts, p1, "verify_chain")
    # with k=1 the second token is the bonus, which accept-always still draws correctly from p_1
    wrong = (bonus_from_wrong_row,) if k == 1 else (accept_always, resample_from_p)
    for verifier in wrong:
        assert_detects(_second_token_given_first_accepted(verifier, k, fixed, 21, N_CONTROL), p1, verifier.__name__)


def _joint_first_two(
    verifier: Verifier, k: int, fixed: Sequence[int] | None, seed: int, n: int = N_DRAWS
) -> np.ndarray:
    """Histogram of the first two committed tokens of a decoding loop that drafts k tokens per
    step (position-indexed fixed target rows, so the true joint is p_0(x) * p_1(y))."""
    gen = torch.Generator().manual_seed(seed)
    g_draft = torch.Generator().manual_seed(seed + 1)
    counts = np.zeros((6, 6), dtype=np.int64)
    for _ in range(n):
        committed: list[int] = []
        while len(committed) < 2:
            t = len(committed)
            if fixed is not None:
                draft, q = list(fixed[t : t + k]), None
            else:
                q = DRAFT_PROBS[t : t + k]
                draft = [int(torch.multinomial(q[j], 1, generator=g_draft)) for j in range(k)]
            committed += verifier(draft, TARGET_LOGITS[t : t + k + 1], T1, gen, q).tokens
        counts[committed[0], committed[1]] += 1
    return counts


@pytest.mark.parametrize(
    ("k", "fixed"),
    [(2, (0, 2, 3)), (1, (0, 2, 3)), (2, None)],
    ids=["deterministic-k2", "deterministic-k1", "probabilistic-k2"],
)
def test_joint_of_first_two_tokens_is_product(k: int, fixed: tuple[int, ...] | None) -> None:
    p = target_probs(T1)
    joint = np.outer(p[0], p[1])
    assert_follows(_joint_first_two(verify_chain, k, fixed, seed=41), joint, "verify_chain")
    wrong = bonus_from_wrong_row if k == 1 else resample_from_p
    assert_detects(_joint_first_two(wrong, k, fixed, 41, N_CONTROL), joint, wrong.__name__)


def test_chi2_helper_handles_impossible_outcomes_and_pooling() -> None:
    assert chi2_pvalue(np.array([10, 0, 1]), np.array([0.5, 0.5, 0.0])) == 0.0
    # exact expected counts give p = 1; tiny cells are pooled rather than dividing by ~0
    assert chi2_pvalue(np.array([500, 499, 1]), np.array([0.5, 0.499, 0.001])) == pytest.approx(1.0)
    assert chi2_pvalue(np.array([900, 100]), np.array([0.5, 0.5])) < 1e-10
