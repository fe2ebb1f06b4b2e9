"""Found by review of the tensor-parallel start-up: tensor_parallel_size was checked against the CUDA devices only
as a TensorParallelFailure (a runtime error, not the configuration's ConfigError) raised at the followers' launch,
and counted from cuda:0 whatever the configured device: device='cuda:1' with tensor_parallel_size=2 on two GPUs
passed and put rank 0 on cuda:0. Now the ranks take the devices from the configured one on, and a host without
them is a ConfigError naming the setting, the number asked and the devices there are, before any rank starts.
The CUDA device count is simulated (one, then two devices)."""

from __future__ import annotations

import _common  # noqa: F401 - makes `prism` importable


def main() -> None:
    import torch

    from prism.engine.config import ConfigError, EngineConfig
    from prism.engine.engine import Engine
    from prism.testing.checkpoints import ensure_tiny_checkpoint

    outcomes = []
    for device, devices in (("cuda", 1), ("cuda:1", 2)):
        torch.cuda.device_count = lambda devices=devices: devices
        try:
            Engine(ensure_tiny_checkpoint(), EngineConfig(tensor_parallel_size=2, device=device))
            outcomes.append((device, devices, None))
        except Exception as error:  # noqa: BLE001 - the kind of error is the finding
            outcomes.append((device, devices, error))
    ok = all(isinstance(e, ConfigError) and "tensor_parallel_size=2" in str(e) and f" {n} " in str(e)
             for _, n, e in outcomes)
    _common.verdict(ok, "; ".join(f"{d} on {n} device(s): {e}" for d, n, e in outcomes),
                    "; ".join(f"device={d!r}, tensor_parallel_size=2 on {n} CUDA device(s): {e!r}"
                              for d, n, e in outcomes))


if __name__ == "__main__":
    main()
