"""Checkpoint loading: sharded == single file, dtype conversion, and every malformed checkpoint or
config is refused with an error that names the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from prism.model.config import ConfigError, Qwen3VLConfig
from prism.model.loading import (
    CheckpointError,
    MissingTensorError,
    TensorShapeError,
    UnexpectedTensorError,
    hf_weight_plan,
    load_model,
)
from prism.testing.checkpoints import build_checkpoint


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    return build_checkpoint("tiny", tmp_path_factory.mktemp("single") / "ckpt")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    return build_checkpoint("tiny", tmp_path_factory.mktemp("sharded") / "ckpt", shard_max_bytes=700_000)


def raw_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(f, framework="pt") as sf:
            out.update({k: sf.get_tensor(k) for k in sf.keys()})  # noqa: SIM118
    return out


def copy_with_tensors(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    shutil.copytree(src, dst)
    for f in dst.glob("model*.safetensors*"):
        f.unlink()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_sharded_and_single_file_load_identically(single, sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (sharded / "model.safetensors").exists()
    a = load_model(single, dtype=torch.float32).state_dict()
    b = load_model(sharded, dtype=torch.float32).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dtype_conversion_and_weight_placement(single, dtype):
    model = load_model(single, dtype=dtype)
    params = dict(model.named_parameters())
    assert {p.dtype for p in params.values()} == {dtype}
    raw = raw_tensors(single)
    cfg = model.config
    plan = hf_weight_plan(cfg)
    # Every HF tensor lands, converted, in its slot (fused qkv / gate_up rows, reshaped patch embed).
    for name, slot in plan.items():
        dst = params[slot.param].narrow(0, slot.row_start, slot.shape[0])
        assert torch.equal(dst, raw[name].to(dtype).reshape(dst.shape)), name
    assert set(plan) == set(raw)
    q = cfg.text.num_attention_heads * cfg.text.head_dim
    k_rows = params["language_model.layers.1.self_attn.qkv.weight"][
        q : q + cfg.text.num_key_value_heads * cfg.text.head_dim
    ]
    assert torch.equal(k_rows, raw["model.language_model.layers.1.self_attn.k_proj.weight"].to(dtype))


def test_unsupported_dtype_rejected(single):
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(single, dtype=torch.int8)


def test_missing_tensor_is_named(single, tmp_path):
    tensors = raw_tensors(single)
    del tensors["model.language_model.layers.2.mlp.up_proj.weight"]
    bad = copy_with_tensors(single, tmp_path / "bad", tensors)
    with pytest.raises(MissingTensorError, match=r"model\.language_model\.layers\.2\.mlp\.up_proj\.weight"):
        load_model(bad)


def test_unexpected_tensor_is_named(single, tmp_path):
    tensors = raw_tensors(single)
    tensors["model.visual.blocks.99.attn.qkv.weight"] = torch.zeros(2, 2, dtype=torch.bfloat16)
    bad = copy_with_tensors(single, tmp_path / "bad", tensors)
    with pytest.raises(UnexpectedTensorError, match=r"model\.visual\.blocks\.99\.attn\.qkv\.weight"):
        load_model(bad)


def test_wrong_shape_is_named(single, tmp_path):
    tensors = raw_tensors(single)
    name = "model.visual.deepstack_merger_list.1.linear_fc2.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    bad = copy_with_tensors(single, tmp_path / "bad", tensors)
    with pytest.raises(TensorShapeError, match=r"deepstack_merger_list\.1\.linear_fc2\.weight.*shape"):
        load_model(bad)


def test_non_float_tensor_rejected(single, tmp_path):
    tensors = raw_tensors(single)
    name = "model.language_model.norm.weight"
    tensors[name] = torch.ones_like(tensors[name], dtype=torch.int8)
    bad = copy_with_tensors(single, tmp_path / "bad", tensors)
    with pytest.raises(CheckpointError, match=r"language_model\.norm\.weight.*I8"):
        load_model(bad)


def test_sharded_index_problems(sharded, tmp_path):
    bad = tmp_path / "missing_shard"
    shutil.copytree(sharded, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (bad / victim).unlink()
    with pytest.raises(CheckpointError, match=victim):
        load_model(bad)

    bad2 = tmp_path / "wrong_map"
    shutil.copytree(sharded, bad2)
    index = json.loads((bad2 / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == files[0])
    index["weight_map"][name] = files[1]
    (bad2 / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_model(bad2)


def test_no_weights(single, tmp_path):
    bad = tmp_path / "empty"
    bad.mkdir()
    shutil.copy(single / "config.json", bad / "config.json")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(bad)


def _config_with(single: Path, tmp_path: Path, edit) -> Path:
    d = json.loads((single / "config.json").read_text())
    edit(d)
    out = tmp_path / "cfg"
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps(d))
    return out


@pytest.mark.parametrize(
    ("edit", "pattern"),
    [
        (lambda d: d["text_config"].pop("hidden_size"), "text_config.hidden_size"),
        (
            lambda d: d["vision_config"].pop("deepstack_visual_indexes"),
            "vision_config.deepstack_visual_indexes",
        ),
        (lambda d: d.pop("image_token_id"), "image_token_id"),
        (lambda d: d["text_config"].update(sliding_window=4096), r"unknown key.*sliding_window"),
        (
            lambda d: d.update(quantization_config={"quant_method": "fp8"}),
            r"unknown key.*quantization_config",
        ),
        (lambda d: d["text_config"]["rope_scaling"].update(mrope_section=[24, 20, 20]), "mrope_section"),
        (lambda d: d["text_config"]["rope_scaling"].update(rope_type="yarn"), "rope_type"),
        (lambda d: d["text_config"].update(num_key_value_heads=3), "num_key_value_heads"),
        (lambda d: d["vision_config"].update(num_position_embeddings=150), "not a square"),
        (lambda d: d["vision_config"].update(deepstack_visual_indexes=[0, 9]), "deepstack_visual_indexes"),
        (lambda d: d.update(video_token_id=d["image_token_id"]), "distinct"),
        (lambda d: d["text_config"].update(hidden_size="128"), "hidden_size must be int"),
    ],
)
def test_bad_config_is_named(single, tmp_path, edit, pattern):
    cfg_dir = _config_with(single, tmp_path, edit)
    with pytest.raises(ConfigError, match=pattern):
        Qwen3VLConfig.from_pretrained(cfg_dir)


def test_missing_config_key_fails_load_before_weights(single, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(single, bad)
    d = json.loads((bad / "config.json").read_text())
    del d["vision_config"]["patch_size"]
    (bad / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="vision_config.patch_size"):
        load_model(bad)


def test_hf5_written_config_layout_parses_the_same(single, tmp_path):
    """transformers 5.x re-saves with `rope_parameters`; both layouts must mean the same model."""
    from transformers import Qwen3VLConfig as HFConfig

    HFConfig.from_pretrained(single).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in written["text_config"]
    assert Qwen3VLConfig.from_pretrained(tmp_path) == Qwen3VLConfig.from_pretrained(single)


def test_tied_checkpoint_ignores_redundant_lm_head(tmp_path):
    ckpt = build_checkpoint("tiny-tied", tmp_path / "tied")
    tensors = raw_tensors(ckpt)
    assert "lm_head.weight" not in tensors
    base = load_model(ckpt, dtype=torch.float32)
    tensors["lm_head.weight"] = torch.zeros_like(tensors["model.language_model.embed_tokens.weight"])
    with_head = load_model(copy_with_tensors(ckpt, tmp_path / "with_head", tensors), dtype=torch.float32)
    assert with_head.lm_head is None
    h = torch.randn(3, base.config.text.hidden_size)
    assert torch.equal(base.compute_logits(h), with_head.compute_logits(h))


def test_progress_bar(single, capsys):
    load_model(single, progress=True)
    assert "loading" in capsys.readouterr().err
