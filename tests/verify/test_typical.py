"""Typical acceptance (Medusa's lossy rule, opt-in only): the acceptance bound, the deepest
acceptable path, and a chi-squared check that it really is lossy (so nobody mistakes it for
the exact verifier)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tokenleap import SpecConfig
from tokenleap.errors import TokenleapError
from tokenleap.sampling import SamplingParams, logits_to_probs
from tokenleap.verify.tree_sampling import verify_tree_sampled
from tokenleap.verify.typical import typical_mask, verify_tree_typical

T1 = SamplingParams(temperature=1.0)


def test_mask_is_min_of_threshold_and_entropy_bound() -> None:
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.97, 0.01, 0.01, 0.01]])
    h = [-sum(x * math.log(x) for x in row) for row in p.tolist()]
    mask = typical_mask(p, threshold=0.09, alpha=0.3)
    for i, row in enumerate(p.tolist()):
        bound = min(0.09, 0.3 * math.exp(-h[i]))
        assert mask[i].tolist() == [x > bound for x in row]
    assert mask[0].tolist() == [True, True, True, False]


def test_deepest_acceptable_path_first_on_ties() -> None:
    # row 0 (after the last token): tokens 0 and 1 likely, 2 and 3 not; every other row: token 3
    logits = torch.full((6, 4), -5.0)
    logits[0, 0] = logits[0, 1] = 2.0
    logits[1:, 3] = 3.0
    # nodes: 0 (tok 2, unlikely), 1 (tok 1), 2 (tok 0), 3 (tok 3 under 1), 4 (tok 3 under 2)
    r = verify_tree_typical([2, 1, 0, 3, 3], [-1, -1, -1, 1, 2], logits, T1, torch.Generator().manual_seed(0))
    assert r.path == [1, 3] and r.tokens[:2] == [1, 3] and r.num_accepted == 2
    chain = verify_tree_typical([0, 3, 1], None, logits[:4], T1, torch.Generator().manual_seed(0))
    assert chain.num_accepted == 2 and chain.tokens[:2] == [0, 3]
    with pytest.raises(ValueError, match="greedy"):
        verify_tree_typical([0], None, logits[:2], SamplingParams(temperature=0.0), torch.Generator())


def test_typical_acceptance_is_lossy_where_the_exact_verifier_is_not() -> None:
    """A plausible but not dominant draft token (p ~ 0.25) is always kept by typical acceptance:
    the first emitted token is biased towards it; the exact verifier's is not."""
    logits = torch.tensor([[1.0, 0.0, 0.0, 0.0, -1.0], [0.0] * 5])
    p0 = logits_to_probs(logits, T1)[0].double().numpy()
    n = 4000
    for verifier, lossless in ((verify_tree_sampled, True), (verify_tree_typical, False)):
        gen = torch.Generator().manual_seed(3)
        counts = np.zeros(5)
        for _ in range(n):
            counts[verifier([1], [-1], logits, T1, gen).tokens[0]] += 1
        pvalue = chisquare(counts, p0 / p0.sum() * n).pvalue
        assert (pvalue >= 1e-3) if lossless else (pvalue < 1e-6), (verifier.__name__, pvalue)


def test_lossy_rule_is_opt_in_and_validated() -> None:
    assert SpecConfig(method="ngram").acceptance == "exact"
    assert SpecConfig(method="ngram", acceptance="typical-lossy", typical_threshold=0.2).typical_threshold == 0.2
    with pytest.raises(TokenleapError, match="acceptance must be one of"):
        SpecConfig(method="ngram", acceptance="typical")
    with pytest.raises(TokenleapError, match="typical_threshold"):
        SpecConfig(method="ngram", acceptance="typical-lossy", typical_alpha=2.0)
