"""`kvd-engine`: runs the inference engine against a KV-cache daemon.

Every flag can also be set by an environment variable (for containers); the
variables are read here, once, and nowhere deeper.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from kvd import logs
from kvd.auth import read_token
from kvd.cli import default_socket, env_default, refuse_retired_variables

log = logging.getLogger("inference")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvd-engine",
        description="The inference engine: a Hugging Face model on the KV-cache daemon's paged memory.",
        epilog="Each flag's environment variable is named in its help; a flag given on the command line wins.",
    )
    p.add_argument(
        "--model",
        default=env_default("KVD_MODEL", "smollm2"),
        help="'smollm2' (the bundled SmolLM2-135M-Instruct), a local HF model folder, or a .gguf file, "
        "of a supported family (README: Model families; others are refused) (KVD_MODEL)",
    )
    p.add_argument(
        "--model-cache-dir",
        default=env_default("KVD_MODEL_CACHE_DIR", ""),
        help="where converted models are kept (KVD_MODEL_CACHE_DIR)",
    )
    p.add_argument(
        "--model-dtype",
        "--dtype",
        dest="dtype",
        default=env_default("KVD_MODEL_DTYPE", ""),
        help="the model's dtype: float64, float32 (CPU default), bfloat16 (GPU default), float16 (KVD_MODEL_DTYPE)",
    )
    p.add_argument(
        "--device", default=env_default("KVD_ENGINE_DEVICE", "auto"), help="auto, cpu or cuda[:N] (KVD_ENGINE_DEVICE)"
    )
    p.add_argument(
        "--kvd-address",
        default=env_default("KVD_ADDRESS", f"unix:{default_socket()}"),
        help="the daemon: unix:PATH or HOST:PORT (KVD_ADDRESS)",
    )
    p.add_argument(
        "--kvd-token-file",
        default=env_default("KVD_TOKEN_FILE", ""),
        help="a file with the token of the daemon's TCP listener (KVD_TOKEN_FILE)",
    )
    p.add_argument(
        "--listen", default=env_default("KVD_ENGINE_ADDR", "127.0.0.1:50052"), help="gRPC address (KVD_ENGINE_ADDR)"
    )
    p.add_argument(
        "--token-budget",
        type=int,
        default=int(env_default("KVD_TOKEN_BUDGET", 512)),
        help="tokens per step (KVD_TOKEN_BUDGET)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=int(env_default("KVD_MAX_NUM_SEQS", 64)),
        help="running sequences (KVD_MAX_NUM_SEQS)",
    )
    p.add_argument(
        "--attention-backend",
        default=env_default("KVD_ATTENTION_BACKEND", "auto"),
        help="auto (triton on a GPU, torch elsewhere), torch, triton, flash-attn (KVD_ATTENTION_BACKEND)",
    )
    p.add_argument(
        "--cuda-graphs",
        choices=("auto", "on", "off"),
        default=env_default("KVD_CUDA_GRAPHS", "auto"),
        help="replay CUDA graphs of decode and mixed steps (auto: on with CUDA and the triton backend) "
        "(KVD_CUDA_GRAPHS)",
    )
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        default=env_default("KVD_NO_PREFIX_CACHING", "") not in ("", "0"),
        help="never reuse cached prefixes (KVD_NO_PREFIX_CACHING=1)",
    )
    p.add_argument("--log-level", default=env_default("KVD_LOG_LEVEL", "info"), help="(KVD_LOG_LEVEL)")
    return p


def main(argv: list[str] | None = None) -> int:
    refuse_retired_variables("kvd-engine")
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level)
    # NOTE: before torch loads OpenMP. Spinning worker threads cost 3-5x per
    # step when the cores are shared (daemon, gateway, tests); a dedicated
    # box may set OMP_WAIT_POLICY=ACTIVE.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from inference.app import EngineApp, EngineSettings

    try:
        settings = EngineSettings(
            model=args.model,
            model_cache_dir=Path(args.model_cache_dir) if args.model_cache_dir else None,
            dtype=args.dtype or None,
            device=args.device,
            kvd_address=args.kvd_address,
            kvd_token=read_token(args.kvd_token_file, "daemon token") if args.kvd_token_file else None,
            listen=args.listen,
            token_budget=args.token_budget,
            max_num_seqs=args.max_num_seqs,
            attention_backend=args.attention_backend,
            prefix_caching=not args.no_prefix_caching,
            cuda_graphs=args.cuda_graphs,
        )
        app = EngineApp(settings)
    except ValueError as exc:
        print(f"kvd-engine: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    app.start()
    while not stop.wait(0.5):
        if app.engine.fatal:
            print(f"kvd-engine: {app.engine.fatal}", file=sys.stderr)
            app.stop()
            return 2
    log.info("engine stopping")
    app.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
