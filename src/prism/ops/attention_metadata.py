"""Where a step's tokens sit in the paged KV pool: `PagedAttentionMetadata` (and cascade attention's
`SharedPrefix`), device tensors for the kernels beside host copies of the same facts, so nothing syncs.

Owns the validity of a step's layout: lengths that fit, one slot per new token (shared pages are read-only),
page tables wide enough, everything on one device. The attention ops (`paged_attention`, `paged_prefill`,
`cascade_attention`) take it as given.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .host_copy import to_device

_INDEX = torch.int64


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _ints(name: str, xs: Sequence[int]) -> tuple[int, ...]:
    xs = list(xs)
    if any(isinstance(x, bool) for x in xs):
        raise ValueError(f"{name} must be ints, not bools")
    try:  # operator.index refuses floats, which int() would silently truncate
        return tuple(operator.index(x) for x in xs)
    except TypeError as exc:
        raise ValueError(f"{name} must be a sequence of ints") from exc


@dataclass(frozen=True)
class SharedPrefix:
    """Cascade attention's device facts for a decode step (`cascade_attention`): row r's first
    `prefix_lens[r]` keys lie on the same pages as the first keys of row `leader[0]`, and are attended in one
    pass for all such rows (0: none; else a multiple of the page size below the row's context).
    `splits`: programs that share the prefix pass of one KV head and row block (a kernel constant)."""

    prefix_lens: torch.Tensor  # [B] int64
    leader: torch.Tensor  # [1] int64
    splits: int


@dataclass(frozen=True)
class PagedAttentionMetadata:
    """Where this step's tokens sit in the pool. Device tensors for kernels, host copies so nothing syncs.

    query_start_loc [B+1]: cu_seqlens of the new tokens in the packed batch.
    context_lens [B]: KV length of each sequence after this step's tokens are written (prefix + new).
    block_table [B, max_pages]: physical page of logical page j (padding 0).
    slot_mapping [N]: slot (page * page_size + row) of each new token.
    All int64 on one device. `max_page` is the largest page id the block table holds (host int).
    `shared_prefix`: a decode step's prefix shared by several rows (cascade attention), else None.
    """

    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    query_lens: tuple[int, ...]
    context_lens_host: tuple[int, ...]
    page_size: int
    max_page: int
    shared_prefix: SharedPrefix | None = None

    def __post_init__(self) -> None:
        b = len(self.query_lens)
        if len(self.context_lens_host) != b:
            raise ValueError(f"{b} query lengths but {len(self.context_lens_host)} context lengths")
        if not isinstance(self.page_size, int) or self.page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {self.page_size!r}")
        expect = {"query_start_loc": (b + 1,), "context_lens": (b,), "slot_mapping": (sum(self.query_lens),)}
        dev = self.block_table.device
        for name, shape in expect.items():
            t = getattr(self, name)
            if t.dtype != _INDEX or tuple(t.shape) != shape:
                raise ValueError(f"{name} must be int64 {shape}, got {t.dtype} {tuple(t.shape)}")
            if t.device != dev:
                raise ValueError(f"{name} is on {t.device}, block_table on {dev}")
        bt = self.block_table
        if bt.dtype != _INDEX or bt.dim() != 2 or bt.shape[0] != b:
            raise ValueError(f"block_table must be int64 [B={b}, max_pages], got {bt.dtype} {tuple(bt.shape)}")
        for i, (q, c) in enumerate(zip(self.query_lens, self.context_lens_host, strict=True)):
            if q < 1 or c < q:
                raise ValueError(f"sequence {i}: need 1 <= query_len <= context_len, got {q} and {c}")
        need = max((_cdiv(c, self.page_size) for c in self.context_lens_host), default=0)
        if bt.shape[1] < need:
            raise ValueError(f"block_table has {bt.shape[1]} columns; the longest context needs {need} pages")
        if self.max_page < 0:
            raise ValueError(f"page ids must be >= 0, got max_page={self.max_page}")
        if self.shared_prefix is not None:
            self._check_shared_prefix(self.shared_prefix, dev)

    def _check_shared_prefix(self, shared: SharedPrefix, dev: torch.device) -> None:
        if not self.is_decode:
            raise ValueError("a shared prefix (cascade attention) applies to decode steps only")
        for name, t, shape in (("prefix_lens", shared.prefix_lens, (self.num_seqs,)), ("leader", shared.leader, (1,))):
            if t.dtype != _INDEX or tuple(t.shape) != shape or t.device != dev:
                raise ValueError(f"shared prefix {name} must be int64 {shape} on {dev}, got {t.dtype} "
                                 f"{tuple(t.shape)} on {t.device}")
        if not isinstance(shared.splits, int) or isinstance(shared.splits, bool) or shared.splits < 1:
            raise ValueError(f"shared prefix splits must be a positive int, got {shared.splits!r}")

    @classmethod
    def build(cls, query_lens: Sequence[int], context_lens: Sequence[int], page_tables: Sequence[Sequence[int]],
              page_size: int, device: torch.device | str = "cpu") -> PagedAttentionMetadata:
        """From host lists: per sequence its new-token count, its context length after this step, and its
        physical pages in logical order (at least ceil(context_len / page_size) of them). The new tokens'
        slots must be distinct across the batch (ValueError): shared pages are read-only."""
        ql, cl = _ints("query_lens", query_lens), _ints("context_lens", context_lens)
        if len(ql) != len(cl) or len(ql) != len(page_tables):
            raise ValueError(f"lengths differ: {len(ql)} query_lens, {len(cl)} context_lens, "
                             f"{len(page_tables)} page_tables")
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        tables = [_ints(f"page_tables[{i}]", t) for i, t in enumerate(page_tables)]
        width = max((len(t) for t in tables), default=0)
        block_table = torch.zeros((len(tables), width), dtype=_INDEX)
        slots = []
        for i, (q, c, t) in enumerate(zip(ql, cl, tables, strict=True)):
            if q < 1 or c < q:
                raise ValueError(f"sequence {i}: need 1 <= query_len <= context_len, got {q} and {c}")
            if len(t) * page_size < c:
                raise ValueError(f"sequence {i}: {len(t)} pages of {page_size} cannot hold context {c}")
            if any(p < 0 for p in t):
                raise ValueError(f"sequence {i}: negative page id in {list(t)[:8]}")
            row = torch.tensor(t, dtype=_INDEX)
            block_table[i, : len(t)] = row
            pos = torch.arange(c - q, c, dtype=_INDEX)
            slots.append(row[pos // page_size] * page_size + pos % page_size)
        slot_mapping = torch.cat(slots) if slots else torch.zeros(0, dtype=_INDEX)
        if torch.unique(slot_mapping).numel() != slot_mapping.numel():
            raise ValueError("two new tokens map to the same slot (a page written by two sequences?)")
        qsl = torch.zeros(len(ql) + 1, dtype=_INDEX)
        qsl[1:] = torch.cumsum(torch.tensor(ql, dtype=_INDEX), 0)
        dev = torch.device(device)
        max_page = max((max(t, default=0) for t in tables), default=0)
        return cls(to_device(qsl, dev), to_device(cl, dev, _INDEX), to_device(block_table, dev),
                   to_device(slot_mapping, dev), ql, cl, page_size, max_page)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token."""
        return all(q == 1 for q in self.query_lens)

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens_host, default=0)
