"""Verification of drafts: chains (greedy and lossless speculative sampling) and token trees (greedy,
and lossless multi-candidate sampling)."""

from tokenleap.verify.chain import VerifyResult, verify_chain
from tokenleap.verify.tree import TreeVerifyResult, verify_tree_greedy
from tokenleap.verify.tree_sampling import verify_tree_sampled

__all__ = ["TreeVerifyResult", "VerifyResult", "verify_chain", "verify_tree_greedy", "verify_tree_sampled"]
