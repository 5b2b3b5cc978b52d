"""KV cache with rollback (reserve / commit / truncate / compact / free)."""

from tokenleap.kv.cache import KVCache

__all__ = ["KVCache"]
