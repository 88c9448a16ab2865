"""`kvd-engine`: runs the inference engine against a KV-cache daemon.

Its settings are declared once, in ``COMMAND`` (see ``kvd.common.settings``): each
flag with the environment variable that sets it (for containers), read here,
once, into ``EngineSettings``, and nowhere deeper.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import click

from kvd.common import logs
from kvd.common.auth import read_token
from kvd.common.settings import (
    DEFAULT_SOCKET_TEXT,
    Setting,
    SettingsCommand,
    default_socket,
    log_level,
    parse,
    refuse_retired_variables,
)

log = logging.getLogger("inference")

COMMAND = SettingsCommand(
    "kvd-engine",
    help="The inference engine: a Hugging Face model on the KV-cache daemon's paged memory.",
    params=[
        Setting(
            "--model",
            env="KVD_MODEL",
            default="smollm2",
            help="'smollm2' (the bundled SmolLM2-135M-Instruct), a local HF model folder, or a .gguf file, "
            "of a supported family (docs/engine.md: Model families; others are refused)",
        ),
        Setting(
            "--model-cache-dir",
            env="KVD_MODEL_CACHE_DIR",
            help="where converted models are kept (a .gguf file is converted once, keyed by its content); "
            "empty: $XDG_CACHE_HOME/kvd/models, else ~/.cache/kvd/models",
        ),
        Setting(
            "--model-dtype",
            "--dtype",
            "dtype",
            env="KVD_MODEL_DTYPE",
            help="the model's dtype: float64, float32 (CPU default), bfloat16 (GPU default), float16",
        ),
        Setting("--device", env="KVD_ENGINE_DEVICE", default="auto", help="auto, cpu or cuda[:N]"),
        Setting(
            "--kvd-address",
            env="KVD_ADDRESS",
            default=lambda: f"unix:{default_socket()}",
            default_text=f"unix:{DEFAULT_SOCKET_TEXT}",
            help="the daemon: unix:PATH or HOST:PORT",
        ),
        Setting("--kvd-token-file", env="KVD_TOKEN_FILE", help="a file with the token of the daemon's TCP listener"),
        Setting("--listen", env="KVD_ENGINE_ADDR", default="127.0.0.1:50052", help="gRPC address"),
        Setting(
            "--token-budget",
            env="KVD_TOKEN_BUDGET",
            type=click.INT,
            default=512,
            help="tokens per step (longer prompts are chunked)",
        ),
        Setting("--max-num-seqs", env="KVD_MAX_NUM_SEQS", type=click.INT, default=64, help="running sequences"),
        Setting(
            "--max-open-requests",
            env="KVD_ENGINE_MAX_OPEN_REQUESTS",
            type=click.INT,
            default=256,
            help="Generate and Warm calls the engine holds at once, running or waiting; past it a call is refused"
            " with RESOURCE_EXHAUSTED (the gateway tries another replica)",
        ),
        Setting(
            "--attention-backend",
            env="KVD_ATTENTION_BACKEND",
            default="auto",
            help="auto (triton on a GPU, torch elsewhere), torch, triton, flash-attn",
        ),
        Setting(
            "--cuda-graphs",
            env="KVD_CUDA_GRAPHS",
            type=click.Choice(("auto", "on", "off")),
            default="auto",
            help="replay CUDA graphs of decode and mixed steps (auto: on with CUDA and the triton backend)",
        ),
        Setting(
            "--no-prefix-caching",
            env="KVD_NO_PREFIX_CACHING",
            is_flag=True,
            default=False,
            help="never reuse cached prefixes",
        ),
        Setting(
            "--drain-timeout-s",
            env="KVD_DRAIN_TIMEOUT_S",
            type=click.FLOAT,
            default=30.0,
            help="on SIGTERM or a Drain call: how long running requests may take to finish before the engine "
            "detaches (requests not started yet are handed back to the router at once)",
        ),
        log_level(),
    ],
)


def config_from(args: SimpleNamespace):
    """The engine's settings from its flags' values (reads the token file; ValueError: invalid)."""
    from inference.app import EngineSettings

    return EngineSettings(
        model=args.model,
        model_cache_dir=Path(args.model_cache_dir) if args.model_cache_dir else None,
        dtype=args.dtype or None,
        device=args.device,
        kvd_address=args.kvd_address,
        kvd_token=read_token(args.kvd_token_file, "daemon token") if args.kvd_token_file else None,
        listen=args.listen,
        token_budget=args.token_budget,
        max_num_seqs=args.max_num_seqs,
        max_open_requests=args.max_open_requests,
        attention_backend=args.attention_backend,
        prefix_caching=not args.no_prefix_caching,
        cuda_graphs=args.cuda_graphs,
        drain_timeout_s=args.drain_timeout_s,
    )


def main(argv: list[str] | None = None) -> int:
    refuse_retired_variables("kvd-engine")
    args = parse(COMMAND, argv)
    logs.configure(args.log_level)
    # NOTE: before torch loads OpenMP. Spinning worker threads cost 3-5x per
    # step when the cores are shared (daemon, gateway, tests); a dedicated
    # box may set OMP_WAIT_POLICY=ACTIVE.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from inference.app import EngineApp

    try:
        settings = config_from(args)
        app = EngineApp(settings)
    except ValueError as exc:
        print(f"kvd-engine: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    app.start()
    while not stop.wait(0.2):
        if app.engine.fatal:
            print(f"kvd-engine: {app.engine.fatal}", file=sys.stderr)
            app.stop()
            return 2
        if app.drained:  # a Drain call: it has answered, the engine is detached
            break
    # NOTE: SIGTERM (a rolling replacement, docker stop, Kubernetes) drains:
    # no request is lost and the daemon keeps every block this engine computed.
    log.info("engine stopping")
    app.drain()
    app.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
