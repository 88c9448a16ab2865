"""The sampling a model's generation_config recommends (the engine's Info.default_sampling)."""

from __future__ import annotations

import json

import torch

from inference import model_store
from kvd_api.engine.v1 import engine_pb2 as pb
from tests.model_families import FAMILIES, build


def test_a_folder_whose_generation_config_sets_sampling_recommends_it(tmp_path):
    build(FAMILIES["llama"], tmp_path)
    config = json.loads((tmp_path / "generation_config.json").read_text())
    # do_sample false: the values are recommended all the same, as vLLM takes them.
    config.update(temperature=0.6, top_p=0.9, do_sample=False)
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    model = model_store.load_model(tmp_path, torch.float32)
    recommended = model_store.default_sampling(model.generation_config)
    assert recommended == {"temperature": 0.6, "top_p": 0.9}
    message = pb.SamplingParams(**recommended)  # what Info sends
    assert message.HasField("temperature") and message.HasField("top_p") and not message.HasField("top_k")
    assert abs(message.temperature - 0.6) < 1e-6


def test_every_recommended_field_is_read_and_unset_ones_are_left_out():
    from transformers import GenerationConfig

    every = GenerationConfig(temperature=0.7, top_p=0.8, top_k=20, min_p=0.05, repetition_penalty=1.1, max_length=9)
    assert model_store.default_sampling(every) == {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
    }  # fmt: skip
    assert model_store.default_sampling(GenerationConfig(eos_token_id=2)) == {}
    assert model_store.default_sampling(None) == {}


def test_smollm2_recommends_nothing(model_dir):
    model = model_store.load_model(model_dir, torch.float32)
    assert model_store.default_sampling(model.generation_config) == {}
