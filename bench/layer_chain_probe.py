"""What do the kernel boundaries between a decode layer's GEMVs cost, and would one persistent kernel save it?
(An experiment, not part of `nox -s bench`.)

W3 batch 1 is 4.29 ms against a 3.55 ms floor, and sessions 16-34 closed every kernel-by-kernel road (`NOTES.md`).
What is left is a persistent decode layer: programs that stay resident across the layer's steps, waiting on each
other instead of on whole grids, and that can request the next weight before the wait (weights are never written in a
step). Before anyone builds that, this asks its cheapest question on the part of the step that is pure weight
streaming: the 36 layers' four GEMVs (QKV 6144x4096, O 4096x4096, gate/up 24576x4096, down 4096x12288, bf16; 13.9 GB,
each layer's weights read once), chained as the step chains them, input of each = output of the one before:

- `kernels`: `prism.ops.gemv.gemv` per GEMV, 144 launches in a CUDA graph, launched in order or early (PDL,
  `ops/pdl.py`), the engine's way;
- `persistent`: one launch of (SMs x occupancy) programs doing all 144 GEMVs, a grid-wide barrier (an atomic counter
  with release/acquire) between consecutive GEMVs; each program walks its row blocks' column tiles as one flat
  pipelined loop (`gemv_stream.py`'s persistent GEMV);
- `persistent, prefetch P`: the same, each program requesting its first P column tiles of the next GEMV *before*
  the barrier, so that its weight stream is already in flight when the input becomes visible.

against the chain's weight bytes at the measured copy bandwidth. The gap between `kernels` and the floor is what the
boundaries (and each kernel's ramp and tail) cost today; what `persistent` recovers of it bounds what a persistent
decode layer could gain on the GEMVs (the attention chain between QKV and O is not in this probe).

Each variant's output is checked first: every GEMV of the first layer against the fp32 product of its own input,
and the 36-layer result twice (bitwise: a lost barrier shows as a race) and against `kernels`' result.

Session 35 on the H200 (`bench/results/2026-12-03-nvidia-h200-session35-layer-chain-probe.txt`; floor 3,228 us at 4.30
TB/s): `kernels` in order 3,463 us (+6.5 us per layer), launched early 3,615; the best `persistent` 3,459 (2 per SM,
8 x 512, 4 warps, 4 stages), and requesting the next weight's first tiles before the barrier slower in every pair. A
barrier costs what a kernel boundary costs: on the GEMVs a persistent decode layer would recover nothing.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

# One decoder layer of the 8B model: hidden 4096, q + k + v rows 6144, intermediate 12288.
HIDDEN, QKV, INTER, LAYERS = 4096, 6144, 12288, 36


@triton.jit
def _grid_barrier(counter_ptr, target):
    """Every program of the grid has arrived here `target / programs` times: the cooperative-groups grid sync
    (block barrier, release add, acquire spin, block barrier), for a grid that is all resident."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _first_tiles(w_ptr, pid, N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, PRE_K: tl.constexpr):
    """This program's first row block, its first PRE_K columns (the loads issued before the barrier; zeros for a
    program without a row block in this GEMV)."""
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    return tl.load(w_ptr + rows[:, None].to(tl.int64) * K + tl.arange(0, PRE_K)[None, :], mask=(rows < N)[:, None],
                   other=0.0)


@triton.jit
def _gemv_phase(w_ptr, x_ptr, y_ptr, pre, pid, nprog, N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr):
    """y = W . x over this program's row blocks pid, pid + nprog, ...: their column tiles as one flat pipelined
    loop. With PREFETCH, `pre` holds the first PREFETCH tiles of the first block, already requested."""
    k_tiles: tl.constexpr = K // BLOCK_K
    my_blocks = (N // BLOCK_N - pid + nprog - 1) // nprog
    cols = tl.arange(0, BLOCK_K)
    carry = tl.zeros([BLOCK_N], tl.float32)
    start = pid * 0
    if PREFETCH > 0:
        if my_blocks > 0:
            x0 = tl.load(x_ptr + tl.arange(0, PREFETCH * BLOCK_K), cache_modifier=".cg").to(tl.float32)
            carry = tl.sum(pre.to(tl.float32) * x0[None, :], axis=1)
            start += PREFETCH
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for t in tl.range(start, my_blocks * k_tiles, num_stages=STAGES):
        block = pid + (t // k_tiles) * nprog
        kt = t % k_tiles
        rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
        tile = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + (kt * BLOCK_K + cols)[None, :])
        x = tl.load(x_ptr + kt * BLOCK_K + cols, cache_modifier=".cg").to(tl.float32)
        acc += tile.to(tl.float32) * x[None, :]
        if kt == k_tiles - 1:
            tl.store(y_ptr + rows, (tl.sum(acc, axis=1) + carry).to(y_ptr.dtype.element_ty))
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            carry = tl.zeros([BLOCK_N], tl.float32)


@triton.jit
def _chain_kernel(wqkv, wo, wgu, wdown, h_ptr, q_ptr, a_ptr, g_ptr, counter_ptr, layers,
                  HID: tl.constexpr, QKV_N: tl.constexpr, INTER_N: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr):
    # Per layer: q = Wqkv h; a = Wo q[:HID]; g = Wgu a; h = Wdown g[:INTER]. A barrier after each; each phase
    # reads only the phase before's output and writes a buffer last read two phases earlier.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    PRE_K: tl.constexpr = PREFETCH * BLOCK_K if PREFETCH > 0 else BLOCK_K
    s_qkv = QKV_N * HID
    s_o = HID * HID
    s_gu = 2 * INTER_N * HID
    s_down = HID * INTER_N
    arrivals = pid * 0
    if PREFETCH > 0:
        pre = _first_tiles(wqkv, pid, QKV_N, HID, BLOCK_N, PRE_K)
    else:
        pre = tl.zeros([BLOCK_N, PRE_K], wqkv.dtype.element_ty)
    for layer in range(layers):
        lw = (pid * 0).to(tl.int64) + layer  # 64-bit weight offsets
        _gemv_phase(wqkv + lw * s_qkv, h_ptr, q_ptr, pre, pid, nprog, QKV_N, HID, BLOCK_N, BLOCK_K, STAGES,
                    PREFETCH)
        if PREFETCH > 0:
            pre = _first_tiles(wo + lw * s_o, pid, HID, HID, BLOCK_N, PRE_K)
        arrivals += nprog
        _grid_barrier(counter_ptr, arrivals)
        _gemv_phase(wo + lw * s_o, q_ptr, a_ptr, pre, pid, nprog, HID, HID, BLOCK_N, BLOCK_K, STAGES, PREFETCH)
        if PREFETCH > 0:
            pre = _first_tiles(wgu + lw * s_gu, pid, 2 * INTER_N, HID, BLOCK_N, PRE_K)
        arrivals += nprog
        _grid_barrier(counter_ptr, arrivals)
        _gemv_phase(wgu + lw * s_gu, a_ptr, g_ptr, pre, pid, nprog, 2 * INTER_N, HID, BLOCK_N, BLOCK_K, STAGES,
                    PREFETCH)
        if PREFETCH > 0:
            pre = _first_tiles(wdown + lw * s_down, pid, HID, INTER_N, BLOCK_N, PRE_K)
        arrivals += nprog
        _grid_barrier(counter_ptr, arrivals)
        _gemv_phase(wdown + lw * s_down, g_ptr, h_ptr, pre, pid, nprog, HID, INTER_N, BLOCK_N, BLOCK_K, STAGES,
                    PREFETCH)
        if PREFETCH > 0:
            if layer + 1 < layers:
                pre = _first_tiles(wqkv + (lw + 1) * s_qkv, pid, QKV_N, HID, BLOCK_N, PRE_K)
        arrivals += nprog
        _grid_barrier(counter_ptr, arrivals)


class Chain:
    """A stack of layers' weights ([layers, out, in] each; gate/up [layers, 2 * inter, hidden]) and the buffers the
    chain passes along. `scale` keeps each output's magnitude near its input's (W ~ N(0, 1/in))."""

    def __init__(self, layers: int, hidden: int, qkv: int, inter: int, device: str, dtype: torch.dtype,
                 seed: int = 0):
        gen = torch.Generator(device=device).manual_seed(seed)

        def weight(out: int, inp: int) -> torch.Tensor:
            return (torch.randn(layers, out, inp, generator=gen, device=device) / inp ** 0.5).to(dtype)

        self.layers, self.hidden, self.qkv, self.inter = layers, hidden, qkv, inter
        self.wqkv, self.wo = weight(qkv, hidden), weight(hidden, hidden)
        self.wgu, self.wdown = weight(2 * inter, hidden), weight(hidden, inter)
        self.x0 = torch.randn(hidden, generator=gen, device=device).to(dtype)
        self.h = torch.empty(hidden, dtype=dtype, device=device)
        self.q = torch.empty(qkv, dtype=dtype, device=device)
        self.a = torch.empty(hidden, dtype=dtype, device=device)
        self.g = torch.empty(2 * inter, dtype=dtype, device=device)
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)

    @property
    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in (self.wqkv, self.wo, self.wgu, self.wdown))


def run_persistent(chain: Chain, programs: int, block_n: int, block_k: int, warps: int, stages: int,
                   prefetch: int, layers: int | None = None) -> torch.Tensor:
    """The whole chain in one launch of `programs` programs (all must be resident at once: a barrier waits for every
    one of them); the result is `chain.h`."""
    for n, k in ((chain.qkv, chain.hidden), (chain.hidden, chain.hidden), (2 * chain.inter, chain.hidden),
                 (chain.hidden, chain.inter)):
        if n % block_n or k % block_k or k < prefetch * block_k:
            raise ValueError(f"a {n}x{k} weight does not split into {block_n}x{block_k} tiles")
    args = (chain.wqkv, chain.wo, chain.wgu, chain.wdown, chain.h, chain.q, chain.a, chain.g, chain.counter,
            chain.layers if layers is None else layers)
    kwargs = dict(HID=chain.hidden, QKV_N=chain.qkv, INTER_N=chain.inter, BLOCK_N=block_n, BLOCK_K=block_k,
                  STAGES=stages, PREFETCH=prefetch, num_warps=warps)
    if programs > 1:
        _check_all_resident(programs, warps, _chain_kernel.warmup(*args, grid=(programs,), **kwargs))
    chain.h.copy_(chain.x0)
    chain.counter.zero_()
    _chain_kernel[(programs,)](*args, **kwargs)
    return chain.h


def _check_all_resident(programs: int, warps: int, compiled) -> None:
    """Refuse a grid the GPU cannot hold at once: its barrier would wait forever for programs not yet started."""
    compiled._init_handles()
    props = torch.cuda.get_device_properties(0)
    regs_per_warp = -(-compiled.n_regs * 32 // 256) * 256  # registers are given to a warp in units of 256
    smem = compiled.metadata.shared + 1024  # the 1 KB each block's shared memory reserves beside its own
    per_sm = min(getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * warps),
                 getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps),
                 getattr(props, "shared_memory_per_multiprocessor", 228 * 1024) // smem, 32)
    if compiled.n_spills or per_sm * props.multi_processor_count < programs:
        raise ValueError(f"{programs} programs of {compiled.n_regs} registers, {compiled.metadata.shared} B shared "
                         f"and {compiled.n_spills} spills: {per_sm} per SM fit, not all resident")


def run_kernels(chain: Chain, layers: int | None = None) -> torch.Tensor:
    """The same chain as `prism.ops.gemv.gemv` launches, one per GEMV (PDL when the caller is inside
    `programmatic_launch(True)`)."""
    from prism.ops.gemv import gemv

    chain.h.copy_(chain.x0)
    h = chain.h
    for layer in range(chain.layers if layers is None else layers):
        q = gemv(chain.wqkv[layer], h)
        a = gemv(chain.wo[layer], q[: chain.hidden])
        g = gemv(chain.wgu[layer], a)
        h = gemv(chain.wdown[layer], g[: chain.inter])
        if layers == 1:  # the first layer's check reads the intermediates where the persistent kernel leaves them
            chain.q.copy_(q), chain.a.copy_(a), chain.g.copy_(g)
    chain.h.copy_(h)
    return chain.h


def reference_first_layer(chain: Chain) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Run the persistent chain's first layer only, then each of its GEMVs against the fp32 product of the input
    the kernel itself read: (name, kernel output, fp32 product)."""
    x0 = chain.x0.float()
    q_want = chain.wqkv[0].float() @ x0
    a_want = chain.wo[0].float() @ chain.q[: chain.hidden].float()
    g_want = chain.wgu[0].float() @ chain.a.float()
    h_want = chain.wdown[0].float() @ chain.g[: chain.inter].float()
    return [("qkv", chain.q, q_want), ("o", chain.a, a_want), ("gate_up", chain.g, g_want), ("down", chain.h, h_want)]


def check_first_layer(chain: Chain, run) -> float:
    """Largest error of the first layer's four GEMVs, each against the fp32 product of its own input."""
    run(layers=1)
    return max(float((got.float() - want).abs().max()) for _, got, want in reference_first_layer(chain))


def main() -> None:
    from kernel_timing import copy_bandwidth, us_per_call_in_graph

    from prism.ops.pdl import programmatic_launch

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results/layer_chain_probe.txt")
    parser.add_argument("--quick", action="store_true", help="a few persistent configurations")
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bandwidth = copy_bandwidth()
    chain = Chain(LAYERS, HIDDEN, QKV, INTER, "cuda", torch.bfloat16)
    floor_us = chain.weight_bytes / bandwidth * 1e6
    lines = [f"{torch.cuda.get_device_name()}: {sms} SMs, copy bandwidth (read + write) {bandwidth / 1e12:.2f} TB/s",
             f"{LAYERS} layers x (QKV, O, gate/up, down) GEMVs, {chain.weight_bytes / 1e9:.2f} GB of weights: "
             f"{floor_us:.1f} us at the copy bandwidth ({floor_us / LAYERS:.2f} per layer)"]
    print("\n".join(lines), flush=True)
    results: list[tuple[float, str]] = []
    reference = None

    def timed(label: str, run) -> None:
        nonlocal reference
        try:
            err = check_first_layer(chain, run)
            first = run().clone()
            again = run().clone()
            if err > 0.05 or not torch.equal(first, again):
                results.append((float("inf"), f"{label}: WRONG (first layer's max err {err:.3g}, "
                                              f"runs equal: {torch.equal(first, again)})"))
                return
            if reference is None:
                reference = first
            drift = float((first.float() - reference.float()).norm() / reference.float().norm())
            if drift > 0.2:  # bf16 rounding of 144 GEMVs in another order moves the result by ~1e-2, a race by ~1
                results.append((float("inf"), f"{label}: WRONG (relative distance to `kernels, in order` {drift:.3g})"))
                return
            us = us_per_call_in_graph(run, calls=3, replays=5)
        except Exception as error:  # a configuration the compiler refuses
            results.append((float("inf"), f"{label}: {type(error).__name__}: {str(error)[:160]}"))
            return
        line = f"{label} (relative distance to `kernels, in order`: {drift:.2e})"
        results.append((us, line))
        print(f"  {us:8.1f} us  {line}", flush=True)

    timed("kernels, in order", lambda layers=None: run_kernels(chain, layers))

    def early(layers=None):
        with programmatic_launch(True):
            return run_kernels(chain, layers)

    timed("kernels, launched early (PDL)", early)
    knobs = (itertools.product((1, 2), (8,), (512,), (4,), (3, 4), (0, 1, 2)) if args.quick else
             itertools.product((1, 2), (8, 16), (512,), (4, 8), (3, 4), (0, 1, 2)))
    for occ, bn, bk, warps, stages, prefetch in knobs:
        a = (sms * occ, bn, bk, warps, stages, prefetch)
        timed(f"persistent {occ}/SM {bn}x{bk} w{warps} s{stages} prefetch {prefetch}",
              lambda layers=None, a=a: run_persistent(chain, *a, layers=layers))
    results.sort(key=lambda r: r[0])
    lines.append("sorted (us for the 36-layer chain; per layer; over the copy-bandwidth floor):")
    for us, label in results:
        if us == float("inf"):
            lines.append(f"        -                            {label}")
        else:
            lines.append(f"  {us:8.1f} us  {us / LAYERS:6.2f} /layer  +{(us - floor_us) / LAYERS:5.2f} /layer  {label}")
    print("\n".join(lines[2:]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
