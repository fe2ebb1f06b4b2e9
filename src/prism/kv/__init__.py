"""The paged KV cache shared across requests: pages, prefix index, reclaim, transfer plans, FP8 format.

Pure state (no model code): `manager.KVCacheManager` is the scheduler's only entry point; each module's
docstring names the invariant of REFERENCE §2 it owns.
"""
