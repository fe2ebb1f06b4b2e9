"""Registers, spills and shared memory of the decode step's Triton kernels, compiled for the H200 (sm_90) on any
machine, no GPU needed (`prism.testing.offline_compile`: Triton's compiler and the `ptxas` in its wheel).

    python bench/kernel_resources.py                        # the engine's knobs, 8B shapes, bf16, FP8 KV
    python bench/kernel_resources.py --set paged_attention._NUM_WARPS=8 --set paged_attention._BLOCK_N=64

Each row is one kernel as the engine launches it at W3's shapes: registers per thread, the stack frame, and the bytes
per thread ptxas spills to local memory (stores / loads). Integer arguments that are multiples of 16 at W3 are marked
as the JIT marks them: without that the compile is another kernel (session 18 read 3.6 KB of spills per thread in
the decode kernel that way; compiled as launched it has none). `--set` changes a module's launch knob before the rows are
built (`prism.ops.<module>.<NAME>=<int or name>`), as `config_ab.py --variants` does in the engine.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the interpreter compiles nothing
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from prism.ops import cascade_attention, fused_norms, gemv, paged_attention, qk_norm_rope_kv, skinny_gemm  # noqa: E402
from prism.testing import kernel_signatures as sig  # noqa: E402
from prism.testing.knobs import set_ops_knob  # noqa: E402
from prism.testing.offline_compile import compile_for_hopper, ptxas_resources  # noqa: E402

# Qwen3-VL-8B's text decoder
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 4096, 32, 8, 128, 12288
GROUP = HEADS // KV_HEADS
PDL = 2  # the engine's default (`pdl.TRIGGER_FIRST`)

# Integer arguments whose values at W3 are multiples of 16 (the launch specializes on it, as on aligned pointers;
# `M` is the few-rows GEMM's rows: its rows are named for 16)
MULTIPLES_OF_16 = ("N", "INTER", "P_IN", "M", "HQ", "HEAD_DIM", "page_size", "num_slots", "D")


def attention_constexprs() -> dict:
    """The launch constants both attention kernels share (`paged_decode_attention`'s `common`), FP8 KV, bf16 q."""
    return dict(KIND=0, BLOCK_D=HEAD_DIM, DOT_DTYPE=tl.float16, PRECISION="tf32", OFFSET_DTYPE=tl.int64,
                NATIVE_FP8=True)


def rows() -> dict[str, tuple]:
    """name -> (kernel, signature, constexprs, num_warps), with the modules' knobs as they are now."""
    # the folded norm's input: the partial sums of squares of O's / down's programs
    block_p = triton.next_power_of_2(triton.cdiv(HIDDEN, gemv.BLOCK_N))
    gemv_knobs = dict(BLOCK_N=gemv.BLOCK_N, BLOCK_K=gemv.BLOCK_K, NUM_STAGES=gemv.NUM_STAGES, PDL=PDL)
    silu_knobs = dict(BLOCK_N=gemv.SILU_BLOCK_N, BLOCK_K=gemv.SILU_BLOCK_K, NUM_STAGES=gemv.NUM_STAGES, PDL=PDL)
    skinny = dict(PRECISION="tf32", PDL=PDL, SPLIT_K=skinny_gemm.SPLIT_K)
    skinny_tiles = {silu: dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "NUM_STAGES"), skinny_gemm.tiles(16, silu, 2),
                                   strict=True)) for silu in (False, True)}
    # the narrow band at 32 rows: O and down, K split NARROW_SPLIT_K ways
    narrow_splits = skinny_gemm.NARROW_SPLIT_K
    narrow = dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "NUM_STAGES"), skinny_gemm.tiles(32, False, 2), strict=True),
                  PRECISION="tf32", PDL=PDL, SPLIT_K=narrow_splits, SILU=False)
    decode = dict(BLOCK_G=16, BLOCK_N=paged_attention._BLOCK_N, NUM_STAGES=paged_attention._NUM_STAGES,
                  V_WITH_K=paged_attention._V_WITH_K, PDL=PDL, **attention_constexprs())
    splits_b1 = paged_attention.decode_num_splits(1, KV_HEADS, 2500)  # W3: ~2,500 tokens of context
    shared_splits = cascade_attention.SPLITS
    return {
        "GEMV, QKV (norm folded in)": (gemv._gemv_kernel, sig.GEMV,
                                       {**gemv_knobs, "NORM_IN": True, "BLOCK_P": block_p, "ADD_RESIDUAL": False},
                                       gemv.NUM_WARPS),
        "GEMV, O / down (residual out)": (gemv._gemv_kernel, sig.GEMV,
                                          {**gemv_knobs, "NORM_IN": False, "BLOCK_P": 1, "ADD_RESIDUAL": True},
                                          gemv.NUM_WARPS),
        "GEMV, gate/up + activation": (gemv._gemv_silu_and_mul_kernel, sig.GEMV_SILU_AND_MUL,
                                       {**silu_knobs, "NORM_IN": True, "BLOCK_P": block_p}, gemv.NUM_WARPS),
        "few-rows GEMM, 16 rows": (skinny_gemm._skinny_gemm_kernel, sig.SKINNY_GEMM,
                                   {**skinny, **skinny_tiles[False], "SILU": False}, skinny_gemm.NUM_WARPS),
        "few-rows GEMM, 16 rows, gate/up": (skinny_gemm._skinny_gemm_kernel, sig.SKINNY_GEMM,
                                            {**skinny, **skinny_tiles[True], "SILU": True}, skinny_gemm.NUM_WARPS),
        **({f"few-rows GEMM, its split sums ({skinny_gemm.SPLIT_K} splits)": (
            skinny_gemm._split_sums_kernel, sig.SPLIT_SUMS,
            dict(SPLIT_K=skinny_gemm.SPLIT_K, SILU=False, BLOCK=1024, PDL=PDL), 4)} if skinny_gemm.SPLIT_K > 1 else {}),
        f"few-rows GEMM, 32 rows, O / down ({narrow_splits} splits)": (
            skinny_gemm._skinny_gemm_kernel, sig.SKINNY_GEMM, narrow, skinny_gemm.NUM_WARPS),
        **({f"few-rows GEMM, 32 rows, its split sums ({narrow_splits} splits)": (
            skinny_gemm._split_sums_kernel, sig.SPLIT_SUMS,
            dict(SPLIT_K=narrow_splits, SILU=False, BLOCK=1024, PDL=PDL), 4)}
           if narrow_splits > 1 else {}),
        "Q/K norm + rope + KV write": (qk_norm_rope_kv._qk_norm_rope_write_kv_kernel, sig.QK_NORM_ROPE_WRITE_KV,
                                       dict(HALF=HEAD_DIM // 2, BLOCK_HQ=HEADS, BLOCK_HKV=KV_HEADS, DTYPE=tl.bfloat16,
                                            KIND=0, OFFSET_DTYPE=tl.int64, PDL=PDL), 4),
        f"decode attention, batch 1 ({splits_b1} splits)": (
            paged_attention._decode_kernel, sig.DECODE_ATTENTION,
            {**decode, "NUM_SPLITS": splits_b1, "SPLIT_SLOTS": splits_b1, "SKIP_PREFIX": False},
            paged_attention._NUM_WARPS),
        "decode attention, cascade own tails (1 split)": (
            paged_attention._decode_kernel, sig.DECODE_ATTENTION,
            {**decode, "NUM_SPLITS": 1, "SPLIT_SLOTS": 1 + shared_splits, "SKIP_PREFIX": True},
            paged_attention._NUM_WARPS),
        f"cascade shared pass ({shared_splits} splits)": (
            cascade_attention._shared_prefix_kernel, sig.SHARED_PREFIX,
            dict(SPLITS=shared_splits, FIRST_SLOT=1, SPLIT_SLOTS=1 + shared_splits, BLOCK_M=cascade_attention.BLOCK_M,
                 BLOCK_N=cascade_attention.BLOCK_N, NUM_STAGES=cascade_attention.NUM_STAGES,
                 V_WITH_K=cascade_attention.V_WITH_K, **attention_constexprs()),
            cascade_attention.NUM_WARPS),
        f"decode split reduce ({1 + shared_splits} slots)": (
            paged_attention._decode_reduce_kernel, sig.DECODE_REDUCE,
            dict(NUM_SPLITS=1 + shared_splits, BLOCK_S=triton.next_power_of_2(1 + shared_splits), BLOCK_D=HEAD_DIM,
                 PDL=PDL), 4),
        "residual add + RMSNorm": (fused_norms._add_rms_norm_kernel, sig.ADD_RMS_NORM,
                                   dict(DTYPE=tl.bfloat16, BLOCK=HIDDEN, PDL=PDL), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help="a launch knob of prism.ops.<module> (repeatable)")
    parser.add_argument("--only", default="", help="rows whose name contains this text")
    args = parser.parse_args()
    for assignment in args.set:
        set_ops_knob(assignment)
    print(f"sm_90, 8B shapes, bf16 activations, FP8 KV{'; ' + ', '.join(args.set) if args.set else ''}")
    print("| kernel | warps | registers | stack B | spill stores B | spill loads B | shared KB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, (kernel, signature, constexprs, warps) in rows().items():
        if args.only not in name:
            continue
        compiled = compile_for_hopper(kernel, signature, constexprs, num_warps=warps, multiples_of_16=MULTIPLES_OF_16)
        r = ptxas_resources(compiled.asm["ptx"])
        print(f"| {name} | {warps} | {r['registers']} | {r['stack_bytes']} | {r['spill_store_bytes']} | "
              f"{r['spill_load_bytes']} | {compiled.metadata.shared / 1024:.1f} |", flush=True)


if __name__ == "__main__":
    main()
