"""Found by review of the tensor-parallel start-up: a follower rank that died before it reached the rendezvous
(killed, or failing before it joined the group) kept rank 0 waiting for it all of `distributed_timeout_s` (300 s
by default), then failing with "waiting for clients. 1/2 clients joined", which names no rank; and since torch had
counted the group rank 0 never formed, no TP engine could start in that process again. Now rank 0 watches the
followers while it waits and fails at once, naming the rank and its exit code, with every follower stopped; a TP
engine starts after it. Two processes over gloo on the CPU (rank 1 kills itself); fails if rank 0 takes 15 s."""

from __future__ import annotations

import _common

TIMEOUT_S = 30


def main() -> None:
    llm, raised, took = _common.start_tp_with_fault("killed_before_joining", TIMEOUT_S)
    if llm is not None:
        llm.engine.shutdown()
    named = raised is not None and "rank 1 exited with code -9" in str(raised)
    if not (named and took < 15):
        _common.verdict(False, "", f"rank 0 took {took:.0f} s (distributed_timeout_s={TIMEOUT_S}) to fail with "
                                   f"{raised!r}, not naming rank 1's exit at once")
    left, _, tokens = _common.what_a_failed_tp_start_left(TIMEOUT_S)  # the failed start left nothing behind
    _common.verdict(not left and tokens == 2,
                    f"rank 0 failed in {took:.1f} s ({raised}); a TP engine started after it",
                    f"followers of the failed start still running: {left}")


if __name__ == "__main__":
    main()
