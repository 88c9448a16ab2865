"""The model store on the real SmolLM2-135M-Instruct: conversion, loading, layout, dtypes.

The module fixture converts the bundled GGUF into the default cache dir, so the
~40 s conversion happens once per machine and later runs reuse it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config

from inference import model_store
from inference.model_store import (
    ModelLayout,
    _is_complete,
    default_cache_dir,
    default_dtype,
    load_model,
    load_tokenizer,
    model_spec,
    parse_dtype,
    resolve_model,
)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model("smollm2", default_cache_dir())


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir, torch.float32)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def _safetensors(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _write_garbage_gguf(path: Path) -> Path:
    # Not a GGUF at all: any attempt to convert it fails at once, which tells
    # "returned the cached folder" from "tried to (re)convert".
    path.write_bytes(b"not a gguf file" * 64)
    return path


# ------------------------------------------------------------ the real model


def test_converted_folder_holds_a_complete_hf_model(model_dir):
    assert model_dir == default_cache_dir() / "SmolLM2-135M-Instruct.Q4_1"
    assert (model_dir / "config.json").is_file()
    assert _safetensors(model_dir)
    assert (model_dir / "tokenizer.json").is_file()
    assert (model_dir / "tokenizer_config.json").is_file()
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert (model_dir / "chat_template.jinja").is_file() or "chat_template" in tokenizer_config
    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config  # the weights are plain, dequantized tensors


def test_model_is_smollm2_135m(model):
    spec = model_spec(model.config, model.generation_config)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not model.training
    assert spec.layout == ModelLayout(num_layers=30, num_kv_heads=3, head_dim=64)
    assert (spec.vocab_size, spec.max_context) == (49152, 8192)
    assert 2 in spec.eos_token_ids  # <|im_end|>
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_tokenizer_round_trips_text(tokenizer):
    ids = tokenizer.encode("Hello, world!", add_special_tokens=False)
    assert tokenizer.decode(ids) == "Hello, world!"


def test_chat_template_renders_im_start(tokenizer):
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert im_start != tokenizer.unk_token_id
    assert im_start in encoded["input_ids"]


def test_greedy_generation_knows_paris(model, tokenizer):
    input_ids = torch.tensor([tokenizer.encode("The capital of France is")])
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, input_ids.shape[1] :])


def test_resolving_again_reuses_the_conversion(model_dir):
    before = [p.stat().st_mtime_ns for p in _safetensors(model_dir)]
    again = resolve_model("smollm2", default_cache_dir())
    assert again == model_dir  # and nothing was written again:
    assert [p.stat().st_mtime_ns for p in _safetensors(model_dir)] == before


def test_float64_loading(model_dir):
    model = load_model(model_dir, torch.float64)
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert not model.training


# ------------------------------------------------------- completeness marker


def test_folder_without_marker_is_incomplete(model_dir, tmp_path):
    # The small files of the real conversion; the weights do not matter to the check.
    copy = tmp_path / model_dir.name
    shutil.copytree(model_dir, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    source = model_store.bundled_smollm2_gguf()
    assert _is_complete(copy, source)
    (copy / ".complete").unlink()
    assert not _is_complete(copy, source)
    assert not _is_complete(tmp_path / "missing", source)


def test_marker_of_another_source_version_is_stale(tmp_path):
    source = _write_garbage_gguf(tmp_path / "m.gguf")
    folder = tmp_path / "cache" / "m"
    folder.mkdir(parents=True)
    (folder / ".complete").write_text(f"m.gguf {source.stat().st_size + 1} 0")
    assert not _is_complete(folder, source)


def test_another_install_of_the_same_file_shares_the_conversion(tmp_path):
    # Two virtualenvs hold the same GGUF with different install times.
    source = _write_garbage_gguf(tmp_path / "m.gguf")
    folder = tmp_path / "cache" / "m"
    folder.mkdir(parents=True)
    (folder / ".complete").write_text(model_store._source_stamp(source))
    other = tmp_path / "venv2"
    other.mkdir()
    copy = Path(shutil.copy(source, other / "m.gguf"))
    os.utime(copy, (1_000_000, 1_000_000))
    assert _is_complete(folder, copy)
    copy.write_bytes(source.read_bytes()[::-1])  # same name and size, other content
    assert not _is_complete(folder, copy)


def test_complete_gguf_conversion_is_returned_without_converting(tmp_path):
    source = _write_garbage_gguf(tmp_path / "m.gguf")
    cache = tmp_path / "cache"
    folder = cache / "m"
    folder.mkdir(parents=True)
    (folder / ".complete").write_text(model_store._source_stamp(source))
    assert resolve_model(str(source), cache) == folder


def test_incomplete_gguf_conversion_is_redone(tmp_path):
    source = _write_garbage_gguf(tmp_path / "m.gguf")
    cache = tmp_path / "cache"
    (cache / "m").mkdir(parents=True)  # half-written: no marker
    # Redoing it means converting the garbage file, which transformers refuses.
    with pytest.raises(ValueError, match="GGUF"):
        resolve_model(str(source), cache)
    assert (cache / "m.lock").is_file()


# ---------------------------------------------------------------- other specs


def test_local_hf_folder_is_returned_as_is(model_dir, tmp_path):
    assert resolve_model(str(model_dir), tmp_path) == model_dir


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path), tmp_path)


def test_unknown_spec_names_it_and_the_accepted_forms(tmp_path):
    with pytest.raises(ValueError, match="no-such-model") as raised:
        resolve_model("no-such-model", tmp_path)
    assert "smollm2" in str(raised.value)
    assert ".gguf" in str(raised.value)
    assert "config.json" in str(raised.value)


# ------------------------------------------------------------- small helpers


def test_default_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "kvd" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "kvd" / "models"


def test_parse_dtype():
    assert parse_dtype("float64") is torch.float64
    assert parse_dtype("float32") is torch.float32
    assert parse_dtype("bfloat16") is torch.bfloat16
    assert parse_dtype("float16") is torch.float16
    with pytest.raises(ValueError, match="int8"):
        parse_dtype("int8")


def test_default_dtype():
    assert default_dtype("cpu") == "float32"
    assert default_dtype("cuda") == "bfloat16"
    assert default_dtype("cuda:1") == "bfloat16"


def test_layout_falls_back_for_configs_without_head_dim_or_kv_heads():
    # A real GPT-2 config: no head_dim, no num_key_value_heads, a list of eos ids.
    config = GPT2Config(n_embd=64, n_head=4, n_layer=2, n_positions=128, eos_token_id=[5, 7])
    spec = model_spec(config)
    assert spec.layout == ModelLayout(num_layers=2, num_kv_heads=4, head_dim=16) and spec.max_context == 128
    assert spec.eos_token_ids == (5, 7)


def test_the_hub_id_of_the_bundled_model_and_of_a_hub_snapshot(tmp_path):
    converted = tmp_path / Path(model_store.SMOLLM2_GGUF).stem
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3-0.6B" / "snapshots" / "abc123"
    assert model_store.hub_id(converted) == model_store.SMOLLM2_HUB_ID
    assert model_store.hub_id(snapshot) == "Qwen/Qwen3-0.6B"
    assert model_store.hub_id(tmp_path / "my-finetune") == ""
