"""Found by review of the server's start-up: a KV pool larger than the device's free memory (`kv_memory_bytes` or
`num_gpu_pages` too large for the GPU, or for what the weights left) went to torch's allocator, which failed with
torch's "CUDA out of memory" (on one tensor-parallel rank, while the others went on). Now the start refuses it before
allocating, with a `KVCapacityError` naming the key, the bytes asked and the bytes free, and an allocation that runs
out of memory all the same is the same typed error.

On the CPU (no free-memory query) the device's free memory is simulated: 1 MiB free for a 64 MiB pool; then an
allocator that runs out of memory."""

from __future__ import annotations

import _common  # noqa: F401 - makes `prism` importable


def start(**config) -> str:
    from prism.engine.llm import LLM
    from prism.testing.checkpoints import ensure_tiny_checkpoint

    try:
        LLM(ensure_tiny_checkpoint(), device="cpu", page_size=4, **config).engine.shutdown()
        return "started"
    except Exception as error:  # noqa: BLE001 - the kind of error is the finding
        return f"{type(error).__name__}: {error}"


def main() -> None:
    import torch

    from prism.distributed import capacity
    from prism.kv.fp8 import KVPool

    problems = []
    allocate, free_bytes, asked = KVPool.allocate, getattr(capacity, "device_free_bytes", None), []
    KVPool.allocate = lambda layout, *a, **kw: asked.append(layout.total_bytes) or allocate(layout, *a, **kw)
    capacity.device_free_bytes = lambda device: 2**20
    beyond = start(kv_memory_bytes=64 * 2**20)
    if not (beyond.startswith("KVCapacityError") and "kv_memory_bytes=67108864" in beyond and "1048576 bytes" in beyond):
        problems.append(f"a 64 MiB pool with 1 MiB free: {beyond}")
    if asked:
        problems.append(f"a pool beyond the free memory went to the allocator ({asked[0]} bytes)")
    capacity.device_free_bytes = free_bytes

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")

    KVPool.allocate = out_of_memory
    oom = start(kv_memory_bytes=64 * 2**20)
    if not (oom.startswith("KVCapacityError") and "kv_memory_bytes=67108864" in oom):
        problems.append(f"an allocation out of memory: {oom}")
    _common.verdict(not problems, f"{beyond}; and: {oom}", "; ".join(problems))


if __name__ == "__main__":
    main()
