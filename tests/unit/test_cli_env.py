"""The daemon's and the engine's command lines: the retired KVD_DTYPE is refused, the new names are read."""

from __future__ import annotations

import os

import pytest

from inference import cli as engine_cli
from kvd import cli as daemon_cli
from kvd.common.settings import parse


@pytest.mark.parametrize("main, prog", [(daemon_cli.main, "kvd"), (engine_cli.main, "kvd-engine")])
def test_kvd_dtype_is_refused_at_start_naming_its_replacements(monkeypatch, main, prog):
    monkeypatch.setenv("KVD_DTYPE", "bfloat16")
    with pytest.raises(SystemExit) as exited:
        main(["--help"])  # refused before the flags are even read
    message = str(exited.value.code)
    assert message.startswith(f"{prog}: KVD_DTYPE is no longer read")
    assert "KVD_CACHE_DTYPE" in message and "KVD_MODEL_DTYPE" in message


def test_each_process_reads_its_own_dtype_variable(monkeypatch):
    monkeypatch.setenv("KVD_CACHE_DTYPE", "float16")
    monkeypatch.setenv("KVD_MODEL_DTYPE", "float64")
    assert parse(daemon_cli.COMMAND, []).cache_dtype == "float16"
    assert parse(engine_cli.COMMAND, []).dtype == "float64"
    assert parse(engine_cli.COMMAND, ["--model-dtype", "bfloat16"]).dtype == "bfloat16"


def test_cuda_graphs_are_read_from_the_environment_and_on_only_where_they_can_run(monkeypatch):
    from inference.app import _use_cuda_graphs

    monkeypatch.setenv("KVD_CUDA_GRAPHS", "off")
    assert parse(engine_cli.COMMAND, []).cuda_graphs == "off"
    assert parse(engine_cli.COMMAND, ["--cuda-graphs", "on"]).cuda_graphs == "on"
    assert _use_cuda_graphs("auto", "cuda", "triton") and not _use_cuda_graphs("off", "cuda", "triton")
    assert not _use_cuda_graphs("auto", "cpu", "torch") and not _use_cuda_graphs("auto", "cuda", "flash-attn")
    with pytest.raises(ValueError, match="--cuda-graphs on needs a CUDA device and the triton backend"):
        _use_cuda_graphs("on", "cpu", "torch")


@pytest.mark.parametrize(
    "preset, expected",
    [
        (None, "expandable_segments:False,backend:native"),
        ("expandable_segments:True", "expandable_segments:False,backend:native"),
        (
            "max_split_size_mb:512,backend:cudaMallocAsync",
            "max_split_size_mb:512,expandable_segments:False,backend:native",
        ),
        (
            "roundup_power2_divisions:[256:1,512:2]",
            "roundup_power2_divisions:[256:1,512:2],expandable_segments:False,backend:native",
        ),
    ],
)
def test_the_daemon_overrides_what_a_preset_allocator_setting_would_break_in_the_ipc_export(preset, expected):
    assert daemon_cli.ipc_allocator_conf(preset) == expected


def test_the_daemon_sets_the_allocator_variables_it_finds_and_the_cuda_one(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    daemon_cli._force_ipc_allocator()
    assert "PYTORCH_ALLOC_CONF" not in os.environ
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False,backend:native"
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "garbage_collection_threshold:0.8")
    daemon_cli._force_ipc_allocator()
    assert os.environ["PYTORCH_ALLOC_CONF"].startswith("garbage_collection_threshold:0.8,expandable")
