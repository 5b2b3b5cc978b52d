"""Chain verification of drafts: greedy and lossless speculative sampling."""

from tokenleap.verify.chain import VerifyResult, verify_chain

__all__ = ["VerifyResult", "verify_chain"]
