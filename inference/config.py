"""The engine's configuration: the process's settings, and what its step loop takes.

``EngineSettings`` is everything one engine process is configured with, each
field declaring its setting (flag, ``KVD_*`` variable, type, default, help; see
``kvd.common.config_fields``); ``kvd-engine`` (``inference/cli.py``) builds it
from the flags and variables. ``EngineConfig`` is the part the step loop
(``inference.engine``) runs with, which ``EngineApp`` derives from the settings
and the model.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from pathlib import Path

import click

from kvd.common.config_fields import optional_path, optional_text, setting
from kvd.common.defaults import ENGINE_ADDRESS, MAX_NUM_SEQS, TOKEN_BUDGET
from kvd.common.settings import DEFAULT_SOCKET_TEXT, default_socket

CUDA_GRAPHS = ("auto", "on", "off")


def read_token_file(path: str) -> str | None:
    """The daemon's token from ``--kvd-token-file`` (None: no file given; ValueError: unusable)."""
    if not path:
        return None
    from kvd.common.auth import read_token  # NOTE: loads grpc, which `kvd-engine --help` needs not

    return read_token(path, "daemon token")


@dataclass(frozen=True)
class EngineSettings:
    """Everything one engine process is configured with (the CLI fills it)."""

    model: str = setting(
        "--model",
        env="KVD_MODEL",
        default="smollm2",
        help="'smollm2' (the bundled SmolLM2-135M-Instruct), a local HF model folder, or a .gguf file, "
        "of a supported family (docs/engine.md: Model families; others are refused)",
    )
    model_cache_dir: Path | None = setting(
        "--model-cache-dir",
        env="KVD_MODEL_CACHE_DIR",
        convert=optional_path,
        help="where converted models are kept (a .gguf file is converted once, keyed by its content); "
        "empty: $XDG_CACHE_HOME/kvd/models, else ~/.cache/kvd/models",
    )
    dtype: str | None = setting(  # None: float32 on CPU, bfloat16 on GPU
        "--model-dtype",
        "--dtype",
        "dtype",
        env="KVD_MODEL_DTYPE",
        convert=optional_text,
        help="the model's dtype: float64, float32 (CPU default), bfloat16 (GPU default), float16",
    )
    device: str = setting("--device", env="KVD_ENGINE_DEVICE", default="auto", help="auto, cpu or cuda[:N]")
    kvd_address: str = setting(
        "--kvd-address",
        env="KVD_ADDRESS",
        default=lambda: f"unix:{default_socket()}",
        default_text=f"unix:{DEFAULT_SOCKET_TEXT}",
        help="the daemon: unix:PATH or HOST:PORT",
    )
    kvd_token: str | None = setting(  # what the daemon's TCP listener needs
        "--kvd-token-file",
        env="KVD_TOKEN_FILE",
        convert=read_token_file,
        help="a file with the token of the daemon's TCP listener",
    )
    listen: str = setting("--listen", env="KVD_ENGINE_ADDR", default=ENGINE_ADDRESS, help="gRPC address")
    token_budget: int = setting(
        "--token-budget",
        env="KVD_TOKEN_BUDGET",
        type=click.INT,
        default=TOKEN_BUDGET,
        help="tokens per step (longer prompts are chunked)",
    )
    max_num_seqs: int = setting(
        "--max-num-seqs", env="KVD_MAX_NUM_SEQS", type=click.INT, default=MAX_NUM_SEQS, help="running sequences"
    )
    max_open_requests: int = setting(
        "--max-open-requests",
        env="KVD_ENGINE_MAX_OPEN_REQUESTS",
        type=click.INT,
        default=256,
        help="Generate and Warm calls the engine holds at once, running or waiting; past it a call is refused"
        " with RESOURCE_EXHAUSTED (the gateway tries another replica)",
    )
    attention_backend: str = setting(
        "--attention-backend",
        env="KVD_ATTENTION_BACKEND",
        default="auto",
        help="auto (triton on a GPU, torch elsewhere), torch, triton, flash-attn",
    )
    cuda_graphs: str = setting(
        "--cuda-graphs",
        env="KVD_CUDA_GRAPHS",
        type=click.Choice(CUDA_GRAPHS),
        default="auto",
        help="replay CUDA graphs of decode and mixed steps (auto: on with CUDA and the triton backend)",
    )
    prefix_caching: bool = setting(
        "--no-prefix-caching",
        env="KVD_NO_PREFIX_CACHING",
        is_flag=True,
        default=False,
        convert=operator.not_,
        help="never reuse cached prefixes",
    )
    cpu_kernels: bool = setting(
        "--no-cpu-kernels",
        env="KVD_NO_CPU_KERNELS",
        is_flag=True,
        default=False,
        convert=operator.not_,
        help="on the CPU, leave out the C kernels the engine compiles at load (decode attention reading blocks"
        " in place; prefill attention; small-batch linear layers, which keep a second copy of the weights):"
        " docs/engine.md",
    )
    metrics_port: int = setting(
        "--metrics-port",
        env="KVD_ENGINE_METRICS_PORT",
        type=click.INT,
        default=0,
        help="Prometheus metrics HTTP port on 127.0.0.1 (the step loop's time by phase); 0: none",
    )
    drain_timeout_s: float = setting(
        "--drain-timeout-s",
        env="KVD_DRAIN_TIMEOUT_S",
        type=click.FLOAT,
        default=30.0,
        help="on SIGTERM or a Drain call: how long running requests may take to finish before the engine "
        "detaches (requests not started yet are handed back to the router at once)",
    )

    def __post_init__(self) -> None:
        from inference.attention import BACKENDS  # NOTE: loads torch, which `kvd-engine --help` needs not

        if self.attention_backend not in ("auto", *BACKENDS):
            choices = ", ".join(("auto", *BACKENDS))
            raise ValueError(f"attention_backend must be one of {choices}, got {self.attention_backend!r}")
        if self.cuda_graphs not in CUDA_GRAPHS:
            raise ValueError(f"cuda_graphs must be one of {', '.join(CUDA_GRAPHS)}, got {self.cuda_graphs!r}")
        if not self.kvd_address:
            raise ValueError("kvd_address must be set (unix:PATH or HOST:PORT)")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.max_open_requests < 1:
            raise ValueError(f"max_open_requests must be >= 1, got {self.max_open_requests}")


@dataclass(frozen=True)
class EngineConfig:
    """Attributes:
    max_num_seqs: the most sequences running at once.
    token_budget: the most tokens computed in one step (chunked prefill).
    reattach_interval_s: how often to try the daemon again after losing it.
    """

    max_num_seqs: int = MAX_NUM_SEQS
    token_budget: int = TOKEN_BUDGET
    reattach_interval_s: float = 0.5
    idle_poll_s: float = 0.002  # between Steps while all our requests wait (the pool is full)
    # Send the Step for step N+1 before reading forward N's results. It pays
    # where the forward runs asynchronously (a GPU); on the CPU the forward is
    # done before the next Step anyway, and lagging commits would only delay
    # the requests waiting for a shared prefix's blocks by a step.
    pipelined: bool = False
    # Replay CUDA graphs of the steps that fit a bucket (inference/cuda_graphs.py),
    # captured again after each attach; only the Triton backend is graphed.
    cuda_graphs: bool = False
    max_context: int = 0  # the model's context (tokens): sizes the graphs' block table (0: the whole cache)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {self.token_budget}")
