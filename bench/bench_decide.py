"""GPU benchmark W7 (decisions), in-process: one material (8 images 448x448) + 3 questions as one decide
vs the same 3 questions as separate readout requests vs plain HF (3 full forwards), on the 8B-shaped
checkpoint built by bench_engine.py; latency at 1 client, throughput with 32 decides submitted at once.
Also the cost of deterministic mode on the same decide. Appends to bench/results/<date>-<gpu>-w7.json/.md."""

from __future__ import annotations

import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from results_io import write_results  # noqa: E402

from prism.decision.plan import Outcome, Readouts, advance, plan_decision  # noqa: E402
from prism.decision.questions import Question, candidate_token_ids  # noqa: E402
from prism.engine.llm import LLM  # noqa: E402
from prism.testing.checkpoints import build_checkpoint  # noqa: E402
from prism.testing.hf_reference import random_images  # noqa: E402

CKPT = Path("/tmp/prism-bench/qwen3vl-8b-random")
QUESTIONS = [
    Question("choice", "Which picture is the brightest?", tuple(f"picture {i + 1}" for i in range(8))),
    Question("yes_no", "Do all pictures show the same scene?"),
    Question("score", "How sharp are the pictures overall?", levels=(1, 2, 3, 4, 5)),
]


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def material(seed: int) -> list[dict]:
    images = random_images([(448, 448)] * 8, seed=seed)
    return [{"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                         {"type": "text", "text": "Here are eight pictures."}]}]


def separate(llm: LLM, mat: list[dict]) -> None:
    """The 3 questions as 3 independent readout requests, submitted together (a general server's view)."""
    inputs = llm.engine.inputs
    ids = []
    for i, q in enumerate(QUESTIONS):
        prompt = inputs.prepare_chat([*mat, {"role": "user", "content": q.render()}])
        rid = f"sep-{time.perf_counter_ns()}-{i}"
        llm.engine.add_readout_request(rid, prompt, candidate_token_ids(q, inputs.encode))
        ids.append(rid)
    llm._run_until_finished(ids)


def many_decides(llm: LLM, seed: int) -> None:
    """32 decides over 4 new materials (seeds `seed`..`seed + 3`), all submitted before the first step, each planned
    as `LLM.decide` and the server plan it (`plan_decision`: a material's images prepared once for its questions)."""
    engine = llm.engine
    mats = [material(seed + k) for k in range(4)]
    plans, ids = [], []
    for d in range(32):
        plan = plan_decision(f"many{d}-{time.perf_counter_ns()}", mats[d % 4], QUESTIONS, engine.inputs)
        state, work = advance(plan, None)
        assert state == "work" and isinstance(work, Readouts) and work.decision_id is not None
        plans.append((plan, [b.request_id for b in work.branches]))
        ids += engine.add_decision(work.decision_id, work.branches)
    finals = llm._run_until_finished(ids)
    for plan, branch_ids in plans:
        state, answers = advance(plan, {i: Outcome(readout=finals[i].readout) for i in branch_ids})
        assert state == "done" and len(answers) == len(QUESTIONS)


def main() -> None:
    if not (CKPT / "config.json").exists():
        build_checkpoint("8b", CKPT, device="cuda", progress=True)
    out: dict = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat()}
    llm = LLM(CKPT, kv_memory_bytes=24 * 2**30, page_size=256, max_num_seqs=128, max_num_batched_tokens=16384)
    llm.decide(material(999), QUESTIONS)  # warm-up
    cold = [timed(lambda s=s: llm.decide(material(100 + s), QUESTIONS)) for s in range(5)]
    hot_mat = material(7)
    llm.decide(hot_mat, QUESTIONS)
    hot = [timed(lambda: llm.decide(hot_mat, QUESTIONS)) for _ in range(5)]
    sep_cold = [timed(lambda s=s: separate(llm, material(200 + s))) for s in range(5)]

    # The first burst of a process pays first uses (new row counts for cuBLAS, new graph shapes); later ones, each
    # over 4 materials not seen before, are the steady state the median reports.
    first_many = timed(lambda: many_decides(llm, 300))
    t_many = [timed(lambda k=k: many_decides(llm, 400 + 100 * k)) for k in range(3)]
    out["prism_decide_cold_ms"] = statistics.median(cold) * 1e3
    out["prism_decide_hot_ms"] = statistics.median(hot) * 1e3
    out["prism_3_separate_cold_ms"] = statistics.median(sep_cold) * 1e3
    out["prism_32_decides_per_s"] = 32 / statistics.median(t_many)
    out["prism_32_decides_per_s_samples"] = [32 / t for t in t_many]
    out["prism_32_decides_per_s_first_burst"] = 32 / first_many
    llm = None
    torch.cuda.empty_cache()

    det = LLM(CKPT, kv_memory_bytes=24 * 2**30, page_size=256, deterministic=True)
    det.decide(material(999), QUESTIONS)
    det_cold = [timed(lambda s=s: det.decide(material(100 + s), QUESTIONS)) for s in range(5)]
    out["prism_deterministic_decide_cold_ms"] = statistics.median(det_cold) * 1e3
    inputs = det.engine.inputs
    det = None
    torch.cuda.empty_cache()

    from transformers import Qwen3VLForConditionalGeneration

    hf = Qwen3VLForConditionalGeneration.from_pretrained(CKPT, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()

    def hf_three(mat) -> None:
        for q in QUESTIONS:
            p = inputs.prepare_chat([*mat, {"role": "user", "content": q.render()}])
            kw = {"input_ids": torch.tensor([p.token_ids], device="cuda"),
                  "attention_mask": torch.ones(1, len(p.token_ids), dtype=torch.long, device="cuda"),
                  "mm_token_type_ids": torch.as_tensor(p.mm_token_type_ids)[None].cuda(),
                  "pixel_values": torch.cat([m.pixel_values for m in p.images]).cuda(),
                  "image_grid_thw": p.image_grid_thw.cuda()}
            with torch.no_grad():
                hf(**kw, logits_to_keep=1)

    hf_three(material(999))
    out["hf_3_forwards_cold_ms"] = statistics.median([timed(lambda s=s: hf_three(material(100 + s))) for s in range(5)]) * 1e3
    md = "\n".join([
        f"W7 decisions, {out['gpu']}, {out['date']}: one material of 8 images (448x448) + 3 questions (choice / yes-no / score)",
        "",
        "| | latency median | throughput |",
        "|---|---:|---:|",
        f"| Prism decide, new material | {out['prism_decide_cold_ms']:.1f} ms | |",
        f"| Prism decide, same material again (full hit) | {out['prism_decide_hot_ms']:.1f} ms | |",
        f"| Prism, the 3 questions as separate requests, new material | {out['prism_3_separate_cold_ms']:.1f} ms | |",
        f"| Prism decide, 32 submitted at once (4 new materials; median of 3 bursts) | | {out['prism_32_decides_per_s']:.2f} decides/s |",
        f"| the same, the process's first burst | | {out['prism_32_decides_per_s_first_burst']:.2f} decides/s |",
        f"| Prism decide, deterministic mode, new material | {out['prism_deterministic_decide_cold_ms']:.1f} ms | |",
        f"| HF transformers, 3 full forwards, new material | {out['hf_3_forwards_cold_ms']:.1f} ms | |",
    ]) + "\n"
    write_results(out, md, out["gpu"], out["date"], "w7")
    print(md)


if __name__ == "__main__":
    main()
