"""PNG plots of the latest benchmark results (run by `nox -s bench` after the benchmarks; needs matplotlib).

Reads bench/results/<stem>.json and <stem>-workloads.json for the newest stem and writes next to them:
<stem>-ttft.png (W1/W2 Prism vs HF), <stem>-decode.png (W3 step time by batch), <stem>-w4-itl.png (the
running streams' inter-token gaps around the cold injection, per mode), <stem>-w5.png (FP8 vs BF16 KV).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def newest_stem() -> str | None:
    """The newest `bench_engine.py` result (other tools' JSON, such as `config_ab.py`'s, sits in the same folder)."""
    for path in sorted(RESULTS.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True):
        if path.stem.endswith(("-workloads", "-http", "-w7")):
            continue
        try:
            if "workloads" in json.loads(path.read_text()):
                return path.stem
        except (OSError, ValueError):
            continue
    return None


def plot_engine(stem: str, r: dict) -> list[Path]:
    w = r["workloads"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = ["W1 cold", "W2 same images"]
    prism = [w["W1_prism_fp8"]["median_ms"], w["W2_prism_fp8"]["median_ms"]]
    hf = [w["W1_hf"]["median_ms"], w["W2_hf"]["median_ms"]]
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], prism, 0.4, label="Prism (FP8 KV)")
    ax.bar([i + 0.2 for i in x], hf, 0.4, label="HF transformers")
    ax.scatter(list(x), [60, 10], marker="_", s=600, color="black", label="target", zorder=3)
    ax.set_xticks(list(x), names)
    ax.set_ylabel("TTFT, median ms" if "ttft_scope" not in r else "TTFT without input preparation, median ms")
    ax.set_title(f"8 images 448x448, {r['gpu']}")
    ax.legend()
    fig.tight_layout()
    ttft = RESULTS / f"{stem}-ttft.png"
    fig.savefig(ttft, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    batches = [1, 8, 32]
    ax.plot(batches, [w[f"W3_prism_fp8_batch{b}_step_ms"] for b in batches], "o-", label="Prism FP8 KV")
    ax.axhline(w["W3_hf_batch1_step_ms"], color="gray", ls="--", label="HF batch 1")
    ax.axhline(4.0, color="black", ls=":", label="target batch 1")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch")
    ax.set_ylabel("step time, ms")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    decode = RESULTS / f"{stem}-decode.png"
    fig.savefig(decode, dpi=120)
    plt.close(fig)
    return [ttft, decode]


def plot_workloads(stem: str, r: dict) -> list[Path]:
    out = []
    modes = [k for k in r if k.startswith("W4")]
    if modes:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for k in modes:
            ax.plot(r[k]["gaps_ms"], lw=0.8, label=k)
        ax.axhline(70, color="black", ls=":", label="default target")
        ax.axhline(20, color="gray", ls=":", label="interleaving target")
        ax.set_xlabel("token gap (all running streams, in order)")
        ax.set_ylabel("inter-token gap, ms")
        ax.legend(fontsize=8)
        fig.tight_layout()
        out.append(RESULTS / f"{stem}-w4-itl.png")
        fig.savefig(out[-1], dpi=120)
        plt.close(fig)
    if "W5_fp8" in r:
        fig, (a, b) = plt.subplots(1, 2, figsize=(7, 3.2))
        kinds = ["W5_fp8", "W5_bf16"]
        labels = ["scaled FP8", "BF16"]
        a.bar(labels, [r[k]["req_per_s"] for k in kinds])
        a.set_ylabel("requests / s")
        b.bar(labels, [100 * r[k]["hit_rate"] for k in kinds])
        b.set_ylabel("prefix hit rate, %")
        fig.suptitle("W5: Zipf working set, same KV budget")
        fig.tight_layout()
        out.append(RESULTS / f"{stem}-w5.png")
        fig.savefig(out[-1], dpi=120)
        plt.close(fig)
    return out


def main() -> None:
    stem = sys.argv[1] if len(sys.argv) > 1 else newest_stem()
    if stem is None:
        sys.exit("no benchmark results to plot")
    written = []
    engine = RESULTS / f"{stem}.json"
    if engine.exists():
        written += plot_engine(stem, json.loads(engine.read_text()))
    workloads = RESULTS / f"{stem}-workloads.json"
    if workloads.exists():
        written += plot_workloads(stem, json.loads(workloads.read_text()))
    print("\n".join(f"wrote {p}" for p in written))


if __name__ == "__main__":
    main()
