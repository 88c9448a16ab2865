"""The daemon's and the engine's command lines: the retired KVD_DTYPE is refused, the new names are read."""

from __future__ import annotations

import pytest

from inference import cli as engine_cli
from kvd import cli as daemon_cli
from kvd.settings import parse


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
