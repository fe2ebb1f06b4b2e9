"""A KV cache manager over real (tiny) scaled-FP8 pools whose bytes *prove* where they came from.

Used by the specs, the tests and the reproducers. Instead of a model, a "step" writes, for every
computed position, bytes derived from a fingerprint of the content that position's KV depends on
(token ids and media digests up to and including it). The fingerprint is computed here, independently
of `prism.kv.keys`, so a bug in keys, lookup, tails, transfers or reclaim shows up as a slot holding the
wrong fingerprint. Transfers run through the real executor on the real pool tensors, and are compared
with a snapshot reference (each move applied to a copy of the pools taken before the plan).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from ..kv import transfers
from ..kv.content import SeqContent
from ..kv.fp8 import KVLayout, KVPool
from ..kv.manager import KVCacheManager
from ..kv.transfers import TransferPlan


def fingerprints(content: SeqContent, upto: int) -> list[bytes]:
    """fp[i] identifies everything the KV at position i depends on (a running hash over tokens+media)."""
    runs = [(span.start, span.length, span.digest, 0) for span in content.media]
    return _fingerprints_from_runs(content.tokens[:upto], runs)


def _slot_bytes(fp: bytes, layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Payload bytes [2, L, H, D] and scale bytes [2, L, H, 4] derived from one fingerprint."""
    L, H, D = layout.num_layers, layout.num_kv_heads, layout.head_dim
    need = 2 * L * H * (D + 4)
    stream = b""
    counter = 0
    while len(stream) < need:
        stream += hashlib.sha256(fp + counter.to_bytes(4, "little")).digest()
        counter += 1
    flat = torch.frombuffer(bytearray(stream[:need]), dtype=torch.uint8)
    payload = flat[: 2 * L * H * D].view(2, L, H, D)
    scales = flat[2 * L * H * D :].view(2, L, H, 4)
    return payload, scales


def _views(pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
    payload = pool.payload.view(torch.uint8)
    assert pool.scales is not None
    scales = pool.scales.view(torch.uint8).view(*pool.scales.shape, 4)
    return payload, scales


def apply_plan_to_snapshot(plan: TransferPlan, gpu: KVPool, cpu: KVPool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The meaning of a plan: every move reads its source from the pools as they were before the plan."""
    snap_gpu = [t.clone() for t in _views(gpu)]
    snap_cpu = [t.clone() for t in _views(cpu)]
    out_gpu = [t.clone() for t in snap_gpu]
    out_cpu = [t.clone() for t in snap_cpu]
    for move in plan.moves():
        src = snap_gpu if move.src[0] == "gpu" else snap_cpu
        dst = out_gpu if move.dst[0] == "gpu" else out_cpu
        rows = move.rows if move.rows is not None else gpu.layout.page_size
        for s, d in zip(src, dst, strict=True):
            d[:, :, move.dst[1], :rows] = s[:, :, move.src[1], :rows]
    return out_gpu, out_cpu


@dataclass
class KVWorld:
    """Manager + real pools + the pending slices of the current step."""

    num_gpu_pages: int
    page_size: int
    num_cpu_pages: int = 0
    namespace: str = "test-model"
    num_layers: int = 2
    num_kv_heads: int = 1
    head_dim: int = 4
    min_tail_tokens: int = 0
    page_aligned_hits: bool = False  # deterministic mode's hits
    pending: dict[int, tuple[int, int]] = field(default_factory=dict)
    steps: int = 0

    def __post_init__(self) -> None:
        self.manager = KVCacheManager(self.num_gpu_pages, self.page_size, self.namespace, self.num_cpu_pages,
                                      min_tail_tokens=self.min_tail_tokens, page_aligned_hits=self.page_aligned_hits)
        layout = KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.page_size, self.num_gpu_pages, "fp8")
        self.gpu = KVPool.allocate(layout, torch.device("cpu"))
        self.cpu = KVPool.allocate(layout.with_num_pages(max(self.num_cpu_pages, 1)), torch.device("cpu"))

    # -- driving the manager like a scheduler would ------------------------------------------------
    def admit(self, seq_id: int, content: SeqContent, chunk: int) -> int:
        """Admit and schedule up to `chunk` tokens after the cached prefix. Returns the hit length."""
        seq = self.manager.admit(seq_id, content, chunk)
        end = min(seq.num_computed + chunk, len(content))
        if end > seq.num_computed:
            self.pending[seq_id] = (seq.num_computed, end)
        return seq.num_cached

    def schedule(self, seq_id: int, num_tokens: int) -> None:
        seq = self.manager.seqs[seq_id]
        end = min(seq.num_computed + num_tokens, len(seq.content))
        self.manager.reserve(seq_id, end - seq.num_computed)
        if end > seq.num_computed:
            self.pending[seq_id] = (seq.num_computed, end)

    def decode(self, seq_id: int, token: int) -> None:
        self.manager.append_tokens(seq_id, [token])
        self.schedule(seq_id, 1)

    def release(self, seq_id: int, keep_in_cache: bool = True) -> None:
        self.pending.pop(seq_id, None)
        self.manager.release(seq_id, keep_in_cache)

    def step(self) -> TransferPlan:
        """Execute the plan (checked against its snapshot meaning), 'compute' the pending slices, publish."""
        plan = self.manager.take_plan()
        try:
            expected_gpu, expected_cpu = apply_plan_to_snapshot(plan, self.gpu, self.cpu)
            transfers.execute_plan(plan, self.gpu, self.cpu)
            for name, actual, expected in (
                ("gpu", _views(self.gpu), expected_gpu),
                ("cpu", _views(self.cpu), expected_cpu),
            ):
                for a, e in zip(actual, expected, strict=True):
                    if not torch.equal(a, e):
                        raise AssertionError(f"executing the plan differs from its snapshot meaning on the {name} pool: {plan}")
            for seq_id, (start, end) in sorted(self.pending.items()):
                self._write(seq_id, start, end)
                self.manager.publish_computed(seq_id, start, end)
        finally:  # a failed step must not also leak its pins into the teardown's leak check
            self.pending.clear()
            self.manager.finish_plan(plan)
        self.steps += 1
        return plan

    def _write(self, seq_id: int, start: int, end: int) -> None:
        seq = self.manager.seqs[seq_id]
        fps = fingerprints(seq.content, end)
        payload, scales = _views(self.gpu)
        for pos in range(start, end):
            pool, page = seq.pages[pos // self.page_size]
            assert pool == "gpu"
            p, s = _slot_bytes(fps[pos], self.gpu.layout)
            payload[:, :, page, pos % self.page_size] = p
            scales[:, :, page, pos % self.page_size] = s

    # -- checks ------------------------------------------------------------------------------------
    def slot_matches(self, page: int, row: int, fp: bytes) -> bool:
        payload, scales = _views(self.gpu)
        p, s = _slot_bytes(fp, self.gpu.layout)
        return torch.equal(payload[:, :, page, row], p) and torch.equal(scales[:, :, page, row], s)

    def check_live_kv(self) -> None:
        """Every computed position of every resident sequence holds the KV of its own content."""
        for seq in self.manager.seqs.values():
            if not seq.is_resident:
                continue
            pending = self.pending.get(seq.seq_id)
            upto = pending[0] if pending else seq.num_computed
            fps = fingerprints(seq.content, upto)
            for pos in range(upto):
                _, page = seq.pages[pos // self.page_size]
                if not self.slot_matches(page, pos % self.page_size, fps[pos]):
                    raise AssertionError(
                        f"sequence {seq.seq_id}: position {pos} (page {page}) holds KV of other content "
                        f"(hit {seq.num_cached} of {len(seq.content)} tokens)"
                    )

    def check_findable_kv(self) -> None:
        """Every row described by the prefix index holds KV computed for exactly that content."""
        index = self.manager.index
        by_key = {r.key: r for r in index.records() if r.key is not None}
        for record in index.records():
            chain, parent = [record], record.parent
            while parent != self.manager.root:
                upper = by_key.get(parent)
                if upper is None:
                    break  # an ancestor was reused: this page is unreachable until recomputed
                chain.append(upper)
                parent = upper.parent
            else:
                chain.reverse()
                tokens = [t for r in chain for t in r.tokens]
                spans = []
                for depth, r in enumerate(chain):
                    spans += [(depth * self.page_size + m.row, m.length, m.digest, m.offset) for m in r.media]
                fps = _fingerprints_from_runs(tokens, spans)
                base = (len(chain) - 1) * self.page_size
                for row in range(len(record.tokens)):
                    if not self.slot_matches(record.page, row, fps[base + row]):
                        raise AssertionError(f"findable page {record.page} row {row} does not hold its content's KV")

    def check_all(self) -> None:
        self.manager.check_invariants()
        self.check_live_kv()
        self.check_findable_kv()


def _fingerprints_from_runs(tokens: list[int], runs: list[tuple[int, int, bytes, int]]) -> list[bytes]:
    """Running hash over (token, media digest, offset in the item) per position: (row, length, digest, offset) runs."""
    tag: dict[int, tuple[bytes, int]] = {}
    for row, length, digest, offset in runs:
        for k in range(length):
            tag[row + k] = (digest, offset + k)
    out, state = [], b"fingerprint"
    for i, token in enumerate(tokens):
        state = hashlib.sha256(state + repr((token, tag.get(i))).encode()).digest()
        out.append(state)
    return out
