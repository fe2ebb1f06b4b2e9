"""Engine configuration: one typed dataclass, loadable from JSON, unknown keys rejected.

Owns the rule "a bad configuration is refused before anything is loaded, naming its key": every field is checked
here (`ConfigError`), the devices' presence before the engine loads anything (`rank.check_rank_devices`); the KV pool's
size against the model once the model's shape is known (`resolved_max_model_len`, `KVCapacityError`).
`specs/spec_engine_config.py`.

Sizing rule: the KV pool holds `num_gpu_pages` pages of `page_size` tokens (or as many as fit in
`kv_memory_bytes`), and no request may need more than the pool: `max_model_len` defaults to, and may
not exceed, the pool's token capacity, so the oldest request can always finish (liveness).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from ..kv.fp8 import KV_DTYPES, KVLayout, pages_in_budget
from ..media.pixel_budget import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_VIDEO_PIXELS


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, or out of range."""


Preemption = Literal["recompute", "swap"]
_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


@dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    kv_dtype: str = "fp8"
    num_gpu_pages: int | None = None  # None: as many pages as fit in kv_memory_bytes
    kv_memory_bytes: int = 64 * 2**20
    num_cpu_pages: int = 0  # the CPU swap pool (0: preemption always recomputes)
    # Sequences running at a time; also the slots of the penalties' count table, allocated on the device when a
    # penalized request first samples: (max_num_seqs + 1) x vocab x 5 bytes (README, `engine/penalty_counts.py`).
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the KV pool's capacity, capped at 32768
    enable_chunked_prefill: bool = True
    # Interleaving (opt-in): while some requests are decoding, a prefill computes at most this many tokens
    # per step, so the decoders' inter-token gap stays short; a visual span larger than this still goes
    # whole (spans are never cut). None: a prefill takes whatever the step's token budget leaves.
    interleave_prefill_tokens: int | None = None
    # While some requests are decoding, a new request's uncached media are encoded in the step before its
    # prefill (riding along the decodes) instead of in the prefill's step: the decoders' longest gap is then
    # the longer of the two, not their sum. Costs the new request about one decode step of TTFT.
    encode_media_ahead: bool = True
    # ... and on CUDA with one rank, that encoding runs on a stream of its own beside the decodes (the request is
    # admitted once it has finished), so no step runs the encoder and a decode in series
    # (`engine/background_encoding.py`; W4 on the H200: longest gap 21.6 -> 16.7 ms, TTFT 2-12 ms longer).
    # None: on with interleaving (the interleaving mode is both), off without it (then a prefill step is the
    # longest gap anyway, and the request would only pay the TTFT).
    encode_ahead_beside_decodes: bool | None = None
    # ... and while that encoding runs, each decode step is launched this long after the one before has ended
    # (sooner if the encoding ends): meanwhile the encoder has the device to itself, where beside a decode step it
    # gets ~half of it. Each gap of the decoding requests grows by it. 0: launch at once. With async scheduling
    # (the steps scheduled while another runs) and not in deterministic mode. W4 on the H200 (session 20), 8
    # images encoded beside 8 decodes: 0 ms 84.7 / 86.5 ms of cold TTFT, 5 ms 80.2 / 82.4 / 81.5, 8 ms 78.7 / 81.5
    # with a longest gap of 20.1 ms.
    encode_ahead_decode_pause_ms: float = 5.0
    enable_prefix_cache: bool = True
    preemption: Preemption = "recompute"
    dtype: str = "auto"  # model weights/activations: auto = bfloat16 on CUDA, float32 on CPU
    device: str = "auto"
    encoder_cache_bytes: int = 256 * 2**20
    preprocess_cache_bytes: int = 256 * 2**20
    # The pixels a prompt's images may announce in all (their headers, before any is decoded; `media.pixel_budget`):
    # 16 images at 4096 x 4096, the most Qwen3-VL's processor keeps of one. More is an `ImagePixelBudgetError`.
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    # ... and the frames a prompt's videos sample (width x height each, summed; `media.pixel_budget`): 64 frames of
    # 1920 x 1080. More is a `VideoPixelBudgetError`, before any frame is decoded.
    max_video_pixels: int = DEFAULT_MAX_VIDEO_PIXELS
    model_id: str | None = None  # namespace of media digests and prefix keys; default: the model dir
    cuda_graphs: bool = True  # decodes and short prefills replay captured CUDA graphs (CUDA only)
    cuda_graph_max_batch: int = 64  # rows (one token each) of the largest captured step; larger steps run eagerly
    # Tokens of the largest captured packed step (prefill chunks, questions, media tokens, beside decodes); larger
    # steps run eagerly. 0: no packed graphs. One graph per bucket (`packed_graphs.BUCKETS`: 17 up to 1024), each
    # holding its own [max_num_seqs + 1, vocab] bf16 logits (8B: ~5 MB per bucket at 16 sequences). Their padding
    # writes scratch KV pages for this many tokens, allocated beside kv_memory_bytes (8B shapes, FP8: ~75 MB for
    # 1024).
    cuda_graph_max_packed_tokens: int = 1024
    # Async scheduling: while a step runs, its sampled tokens stay on the device and the next decode step of the same
    # sequences is launched on them (when nothing else needs scheduling), so the host's work between steps
    # (committing tokens, streaming, building the next inputs) overlaps the device's. Needs the CUDA graphs' rows.
    async_scheduling: bool = True
    # ... and when requests wait to be admitted, the scheduler runs while the step is in flight too: the admitted
    # prefills go beside the decode rows fed the device's tokens (`continuation.rows_scheduled_ahead`). W5's
    # clients keep requests waiting, so most of its steps are scheduled ones, each serialized with the device
    # (100 of 181 steps in `bench/host_w5.py`). H200, W5 (session 15): BF16 54.6 -> 66.1 req/s, FP8 74.9 -> 73.2
    # (host-bound either way) with its TTFT p50 81 -> 54 ms.
    async_admissions: bool = True
    # ... under tensor parallelism too (both of the above): a step launched on tokens rank 0 sampled and no host has
    # read goes to the followers as a payload, and every rank takes those tokens from rank 0 by a broadcast before
    # its forward (`ModelRunner.run`), so the followers build and launch a step while the one before runs. Off
    # until measured on two GPUs (checked on the CPU over gloo: TP2's tokens equal TP1's).
    tensor_parallel_async_scheduling: bool = False
    # One-row products of the decoder's QKV, O and down projections (a decode step of one sequence) as a Triton
    # GEMV (`ops/gemv.py`), which reads those weights closer to the memory bandwidth than cuBLAS does there.
    batch1_gemv: bool = True
    # ... and (with batch1_gemv) those one-row steps fold each decoder layer's two residual adds + RMSNorms into the
    # GEMVs that produce and read them (`DecoderLayer.forward_one_row`, `ops.gemv.ResidualRow`): seven kernels per
    # layer instead of nine, the same roundings (only the order of the norm's fp32 sum of squares differs). One GPU
    # only (the row-parallel O and down of tensor parallelism add the residual after their all-reduce). H200, W3
    # (session 17): batch 1 4.40 -> 4.32 ms.
    batch1_fused_norms: bool = True
    # The decode step's kernels (norms, GEMVs, the fused Q/K-norm + KV write, decode attention), captured or eager,
    # are launched with programmatic dependent launch on Hopper and later: each kernel's blocks are resident,
    # waiting, before the previous kernel ends (`ops/pdl.py`). No effect on what is computed (bitwise, GPU test).
    # H200, W3 (session 16): batch 1 4.51 -> 4.43 ms, batch 8 5.51 -> 5.45.
    programmatic_launch: bool = True
    # Cascade attention: captured decode steps whose graph bucket has at least this many rows read the pages that
    # several rows share at the start of their contexts (the same images) once for all of them, then each row's
    # own keys (`ops/cascade_attention.py`). 0: never. Smaller steps gain less than the extra launches cost. Those
    # buckets are captured twice (with and without), which doubles their capture time and keeps a second logits
    # buffer per bucket (bf16, rows x vocabulary: ~58 MB in all for the default 64 rows of Qwen3-VL).
    cascade_attention_min_batch: int = 8
    # Lists of item grids (the sizes of a step's images) whose vision encoding is replayed as a CUDA graph once
    # seen twice, the least recently used dropped beyond this many (`engine/vision_graphs.py`); they share one memory
    # pool of the encoder's activations (8 images of 448x448: a few hundred MB). 0: the encoder runs eagerly.
    vision_cuda_graphs: int = 4
    # Chat messages given to the engine itself (`add_request`, `LLM.generate`): each new image is encoded as soon as
    # it is prepared, while the others still are, unless its features are cached, the prefix cache holds pages of
    # it, or other requests wait (one rank only). The prefill then finds the features in the encoder cache.
    # Off by default: on the H200, W1 (8 new 448x448 images) took ~10 ms longer with it than without, since an image
    # encoded alone costs 3.0 ms of GPU against 1.9 in a list of eight, and the encoding's host work on the calling
    # thread slowed the preparation of the rest (9.7 -> 40-79 ms until the last image was encoded).
    encode_media_while_preparing: bool = False
    # Off CUDA, run the steps the CUDA graphs would replay through the same rows and packed buffers, eagerly: slower
    # on the CPU, but it puts the graph paths' input construction through the whole engine (tests and specs).
    graph_rows_without_cuda: bool = False
    # Reuse a cached partial page (copy its rows into a private page) only if it saves at least this many tokens
    # of prefill: a copy costs more host time (~0.2 ms on the H200 host since session 16) than a few tokens in a prefill. None: an
    # eighth of a page (32 tokens at 256-token pages: W1's cold prompts shared 4 tokens of chat template; 2 at 16).
    # A shorter tail is still copied where the whole pages before it end inside an image (`KVCacheManager.lookup`).
    min_tail_copy_tokens: int | None = None
    # A waiting request whose prompt a running prefill has yet to compute at least this many tokens of (whole pages
    # with the same tokens and images) waits for that prefill instead of computing the same KV beside it, then hits
    # the pages it published (`Scheduler._prefilled_elsewhere`). Requests about the same images
    # arriving together (W7's decides over a few materials, W5's clients) compute each image set once. Costs the
    # waiting request the steps of that prefill; short shared prefixes (a system prompt) are recomputed instead,
    # which costs less. None: never wait.
    defer_shared_prefill_tokens: int | None = 512
    # Bitwise-reproducible outputs: each sequence computed alone in page-aligned, padded one-page tiles (each
    # replayed from one CUDA graph of a page's rows), prefix hits page-aligned, media encoded one at a time (vision
    # graphs captured with the eager attention backend). Costs speed (see bench/).
    deterministic: bool = False
    # After every step, run the KV manager's full accounting check; check every cascade attention plan (tests).
    check_invariants: bool = False
    # Ranks of one host (GPUs, or CPU processes over gloo): the text decoder is split over them (KV heads
    # too), the vision encoder runs data parallel. Rank 0 is this process; the engine spawns the others.
    tensor_parallel_size: int = 1
    # The process's GIL switch interval (`sys.setswitchinterval`), set once the engine is built (process-wide: it
    # applies to every thread of an application that embeds the engine, and the last engine built sets it; the TP
    # follower ranks are processes of their own and keep Python's); None leaves Python's 5 ms. The step loop shares
    # the GIL with the media-preparation threads: at 5 ms a thread waiting for it may wait that long while another
    # runs Python. W5 on the H200 (session 13, the harness): FP8 67-69 -> 79.4 req/s,
    # BF16 53-54 -> 56.2 at 0.5 ms.
    python_switch_interval_ms: float | None = 0.5
    distributed_timeout_s: float = 300.0  # bounds every collective: a dead rank fails the others, no hang

    @property
    def encodes_ahead_beside_decodes(self) -> bool:
        """`encode_ahead_beside_decodes`, resolved: with interleaving unless set."""
        if self.encode_ahead_beside_decodes is not None:
            return self.encode_ahead_beside_decodes
        return self.interleave_prefill_tokens is not None

    @property
    def tail_copy_threshold(self) -> int:
        """The fewest tokens a reused partial page must hold (`min_tail_copy_tokens`, resolved)."""
        return self.page_size // 8 if self.min_tail_copy_tokens is None else self.min_tail_copy_tokens

    def __post_init__(self) -> None:
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "kv_memory_bytes", "cuda_graph_max_batch",
                     "max_image_pixels", "max_video_pixels"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        tail = self.min_tail_copy_tokens
        if tail is not None and (not isinstance(tail, int) or isinstance(tail, bool) or tail < 0):
            raise ConfigError(f"min_tail_copy_tokens must be a non-negative integer or null, got {tail!r}")
        for name in ("num_gpu_pages", "max_model_len", "interleave_prefill_tokens", "defer_shared_prefill_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ConfigError(f"{name} must be a positive integer or null, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be at least 2 (a prompt token and a generated one), got "
                              f"{self.max_model_len}")
        for f in dataclasses.fields(self):  # a JSON "false" string would otherwise switch a feature on
            if f.type in ("bool", bool) and not isinstance(getattr(self, f.name), bool):
                raise ConfigError(f"{f.name} must be true or false, got {getattr(self, f.name)!r}")
            if f.type == "bool | None" and getattr(self, f.name) not in (None, True, False):
                raise ConfigError(f"{f.name} must be true, false or null, got {getattr(self, f.name)!r}")
        switch = self.python_switch_interval_ms
        if switch is not None and (isinstance(switch, bool) or not isinstance(switch, (int, float))
                                   or not math.isfinite(switch) or switch < 0.001):
            raise ConfigError(f"python_switch_interval_ms must be a finite number >= 0.001 or null, got {switch!r}")
        packed = self.cuda_graph_max_packed_tokens
        if not isinstance(packed, int) or isinstance(packed, bool) or packed < 0 or 0 < packed < 32:
            raise ConfigError(f"cuda_graph_max_packed_tokens must be 0 (off) or an integer >= 32, got {packed!r}")
        cascade = self.cascade_attention_min_batch
        if not isinstance(cascade, int) or isinstance(cascade, bool) or cascade < 0:
            raise ConfigError(f"cascade_attention_min_batch must be 0 (off) or a positive integer, got {cascade!r}")
        vision = self.vision_cuda_graphs
        if not isinstance(vision, int) or isinstance(vision, bool) or vision < 0:
            raise ConfigError(f"vision_cuda_graphs must be 0 (off) or a positive integer, got {vision!r}")
        if not isinstance(self.num_cpu_pages, int) or isinstance(self.num_cpu_pages, bool) or self.num_cpu_pages < 0:
            raise ConfigError(f"num_cpu_pages must be a non-negative integer, got {self.num_cpu_pages!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if self.preemption not in ("recompute", "swap"):
            raise ConfigError(f"preemption must be 'recompute' or 'swap', got {self.preemption!r}")
        if self.preemption == "swap" and self.num_cpu_pages == 0:
            raise ConfigError("preemption='swap' needs num_cpu_pages > 0")
        if not isinstance(self.tensor_parallel_size, int) or isinstance(self.tensor_parallel_size, bool) \
                or self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        pause = self.encode_ahead_decode_pause_ms
        if isinstance(pause, bool) or not isinstance(pause, (int, float)) or not 0 <= pause <= 1000:
            raise ConfigError(f"encode_ahead_decode_pause_ms must be a number of ms in [0, 1000], got {pause!r}")
        timeout = self.distributed_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ConfigError(f"distributed_timeout_s must be a positive finite number, got {timeout!r}")
        for name in ("encoder_cache_bytes", "preprocess_cache_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be a non-negative integer (bytes; 0 keeps nothing), got {value!r}")
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise ConfigError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:<index>', got {self.device!r}")
        if self.model_id is not None and (not isinstance(self.model_id, str) or not self.model_id):
            raise ConfigError(f"model_id must be a non-empty string or null, got {self.model_id!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")

    # -- loading -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> EngineConfig:
        if not isinstance(raw, dict):
            raise ConfigError(f"an engine config must be a JSON object, got {type(raw).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"unknown engine config keys: {unknown}; known keys: {sorted(known)}")
        return cls(**raw)

    @classmethod
    def from_json(cls, path: str | Path) -> EngineConfig:
        return cls.from_dict(cls.read_json(path))

    @staticmethod
    def read_json(path: str | Path) -> dict[str, Any]:
        """The fields a JSON config file names (checked as a config by `from_dict`)."""
        try:
            raw = json.loads(Path(path).read_text())
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}: not valid JSON ({error})") from error
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: an engine config is a JSON object, got {type(raw).__name__}")
        return raw

    def replace(self, **changes: Any) -> EngineConfig:
        return EngineConfig.from_dict({**self.to_dict(), **changes})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # -- derived -------------------------------------------------------------------------------
    def resolved_device(self) -> torch.device:
        """The device `device` names ("auto": CUDA when this process sees one); whether this host has it is
        `rank.check_rank_devices`'s to say, before the engine loads anything."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def kv_pages(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """KV pages this rank could hold (num_kv_heads: this rank's heads); 0 when none fits. Ranks agree
        on the MIN of it before allocating (`prism.distributed.capacity.agree_num_pages`)."""
        return self.num_gpu_pages or pages_in_budget(
            self.kv_memory_bytes, num_layers, num_kv_heads, head_dim, self.page_size, self.kv_dtype
        )

    def kv_layout(self, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int) -> KVLayout:
        return KVLayout(num_layers, num_kv_heads, head_dim, self.page_size, num_pages, self.kv_dtype)

    def resolved_max_model_len(self, pool_tokens: int) -> int:
        if self.max_model_len is None:
            return min(pool_tokens, 32768)
        if self.max_model_len > pool_tokens:
            raise ConfigError(
                f"max_model_len={self.max_model_len} exceeds the KV pool's {pool_tokens} tokens: one request "
                "could never finish; raise kv_memory_bytes / num_gpu_pages or lower max_model_len"
            )
        return self.max_model_len
