"""Attention metadata and kernels: causal and tree masks, prefill and per-row decode paths."""

from tokenleap.attention.ops import AttentionMask, attend, causal_mask, tree_mask

__all__ = ["AttentionMask", "attend", "causal_mask", "tree_mask"]
