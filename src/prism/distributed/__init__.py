"""Tensor parallelism (issue 8): `tensor_parallel.py` shards the text decoder over a torch.distributed group
(column/row-parallel linears, vocab-parallel embedding and LM head); `capacity.py` agrees on the KV page count
(MIN over ranks, invariant 10); `encoder_dp.py` spreads whole media items over the ranks and gathers their
features; `step_channel.py` carries rank 0's step payloads to the followers. The engine side (rank set-up,
follower processes, their start-up) is `engine/rank.py`, `engine/tp_workers.py` and `engine/tp_startup.py`."""
