"""Tensor parallelism (issue 8): `tensor_parallel.py` shards the text decoder over a torch.distributed group
(column/row-parallel linears, vocab-parallel embedding and LM head) and agrees on capacity (MIN over ranks).
Not yet: the engine running on several ranks, per-rank KV pools, encoder data parallelism."""
