"""Verification of drafts: chains (greedy and lossless speculative sampling) and token trees (greedy)."""

from tokenleap.verify.chain import VerifyResult, verify_chain
from tokenleap.verify.tree import TreeVerifyResult, verify_tree_greedy

__all__ = ["TreeVerifyResult", "VerifyResult", "verify_chain", "verify_tree_greedy"]
