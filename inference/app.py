"""Wires one engine process: model, attention backend, daemon session, server."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from inference import attention, cpu_linear, fused_layers, model_identity, model_store, model_support, openmp
from inference.config import EngineConfig, EngineSettings
from inference.engine import Engine
from inference.kernels import cpu
from inference.service import EngineService, ModelInfo, build_server
from kvd.common.client import DaemonClient, DaemonSession
from kvd.common.layout import CacheLayout

log = logging.getLogger("inference.app")


@dataclass(frozen=True)
class DrainResult:
    """How a drain went (the Drain RPC's answer)."""

    handed_back: int  # requests ended before their first token (a router retries them elsewhere)
    cut_short: int  # requests still running when the drain's time ran out
    seconds: float


class EngineApp:
    """Loads the model and serves it; attaches to the daemon in the background."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.device = _resolve_device(settings.device)
        self.dtype = settings.dtype or model_store.default_dtype(self.device)
        cache_dir = settings.model_cache_dir or model_store.default_cache_dir()
        path = model_store.resolve_model(settings.model, cache_dir)
        model_support.check_supported(model_store.load_config(path))  # before loading any weights
        # NOTE: not on this thread, whose OpenMP pool would outlive the load (inference/openmp.py)
        self.model = openmp.in_passing_thread(lambda: self._load_model(path))
        self.tokenizer = model_store.load_tokenizer(path)
        self.spec = model_store.model_spec(self.model.config, self.model.generation_config)
        self.backend = attention.choose_backend(settings.attention_backend, self.device)
        self.model.set_attn_implementation(attention.BACKENDS[self.backend])
        kv = self.spec.layout
        self.layout = CacheLayout(kv.num_layers, kv.num_kv_heads, kv.head_dim, 1, self.dtype)
        # NOTE: blocks of another model with the same layout would be garbage here (kvd.common.identity).
        self.identity = model_identity.identify(path, self.model.config.model_type, cache_dir / "digests")
        self.engine = Engine(
            self.model,
            self.tokenizer,
            self._attach,
            EngineConfig(
                max_num_seqs=settings.max_num_seqs,
                token_budget=settings.token_budget,
                pipelined=self.device.startswith("cuda"),
                cuda_graphs=_use_cuda_graphs(settings.cuda_graphs, self.device, self.backend),
                max_context=self.spec.max_context,
            ),
            eos_token_ids=set(self.spec.eos_token_ids),
            on_health=self._health_changed,
        )
        self.info = ModelInfo(
            name=path.name,
            dtype=self.dtype,
            device=self.device,
            backend=self.backend,
            max_context=self.spec.max_context,
            vocab_size=self.spec.vocab_size,
            eos_token_ids=set(self.spec.eos_token_ids),
            block_size=0,
            model_type=self.model.config.model_type,
            default_sampling=model_store.default_sampling(self.model.generation_config),
            hub_id=model_store.hub_id(path),
        )
        self._drain_lock = threading.Lock()
        self._drained: DrainResult | None = None
        service = EngineService(
            self.engine, self.tokenizer, self.info, prefix_caching=settings.prefix_caching, drain=self.drain
        )
        self.server = build_server(service, settings.max_open_requests)
        self.port = self.server.add_port(settings.listen)

    def _load_model(self, path: Path) -> torch.nn.Module:
        model = model_store.load_model(path, model_store.parse_dtype(self.dtype), self.device)
        # float32 on the CPU only; the C kernels are built now (under a second), not in the first step
        kernels = self.device == "cpu" and cpu.use(self.settings.cpu_kernels)
        if fused := kernels and fused_layers.fuse(model):  # first: its stacked projections are packed next
            log.info("Llama-code layers on the C kernels", extra={"modules": fused})
        if packed := cpu_linear.pack_linears(model, panels=kernels):
            log.info("linear layers on oneDNN, weights packed", extra={"layers": packed, "c_kernels": kernels})
        return model

    def start(self) -> None:
        self.server.start()
        self.engine.start()
        if self.settings.metrics_port:
            from prometheus_client import start_http_server

            from inference.metrics import engine_registry

            registry = engine_registry(self.engine.timings)
            start_http_server(self.settings.metrics_port, addr="127.0.0.1", registry=registry)
        log.info(
            "engine serving",
            extra={"listen": self.settings.listen, "model": self.info.name, "dtype": self.dtype, "device": self.device,
                   "backend": self.backend, "kvd": self.settings.kvd_address},
        )  # fmt: skip

    def stop(self) -> None:
        self.server.stop(grace_s=2)
        self.engine.stop()

    @property
    def drained(self) -> bool:
        return self._drained is not None

    def drain(self, timeout_s: float = 0.0) -> DrainResult:
        """Takes the engine out of service without losing a request (see the
        Drain RPC in protos/kvd_api/engine/v1/engine.proto), then detaches.
        Idempotent: a second call waits for the first and gets its result.

        Args:
            timeout_s: how long running requests may take to finish (0: the settings').
        """
        with self._drain_lock:
            if self._drained is not None:
                return self._drained
            started = time.monotonic()
            deadline = started + (timeout_s or self.settings.drain_timeout_s)
            self.server.set_serving(False)  # first: routers stop sending new work
            self.engine.start_draining("the engine is draining (being replaced or stopped); retry on another replica")
            log.info("engine draining", extra={"timeout_s": round(deadline - started, 1)})
            cut_short = 0
            while self.engine.busy and time.monotonic() < deadline:
                time.sleep(0.02)
            if self.engine.busy:
                cut_short = len(self.engine.requests.seqs)
                self.engine.end_all("the engine's drain ran out of time; retry the request")
                limit = time.monotonic() + 10
                while self.engine.busy and time.monotonic() < limit:
                    time.sleep(0.02)
            self.engine.stop()  # detaches once its last forward's writes landed: the daemon keeps every block
            self._drained = DrainResult(self.engine.num_handed_back, cut_short, time.monotonic() - started)
            log.info("engine drained and detached", extra=vars(self._drained))
            return self._drained

    def _attach(self) -> DaemonSession:
        client = DaemonClient.connect(self.settings.kvd_address, timeout_s=2.0, token=self.settings.kvd_token)
        try:
            session = client.attach(f"engine:{self.info.name}", self.layout, model=self.identity)
        except grpc.RpcError as err:
            client.close()
            if err.code() == grpc.StatusCode.FAILED_PRECONDITION:  # another model, layout or release: final
                raise ValueError(f"the KV-cache daemon refused this engine: {err.details()}") from None
            raise
        except Exception:
            client.close()
            raise
        block_size = session.layout.block_size
        if not attention.block_size_fits(self.backend, block_size):
            if self.settings.attention_backend != "auto":
                session.detach()
                raise ValueError(attention.block_size_message(self.backend, block_size))
            log.warning(attention.block_size_message(self.backend, block_size) + "; using the torch backend")
            self.backend = self.info.backend = "torch"
            self.model.set_attn_implementation(attention.BACKENDS["torch"])
        self.info.block_size, self.info.num_blocks = block_size, session.num_blocks
        return session

    def _health_changed(self, healthy: bool) -> None:
        if healthy and self.engine.draining:
            return  # a drained engine never serves again, re-attached or not
        self.server.set_serving(healthy)


def _use_cuda_graphs(setting: str, device: str, backend: str) -> bool:
    """Whether the engine captures CUDA graphs (``setting``: one of ``inference.config.CUDA_GRAPHS``).

    Raises:
        ValueError: ``on`` where graphs cannot run.
    """
    possible = device.startswith("cuda") and backend == "triton"
    if setting == "on" and not possible:
        raise ValueError(f"--cuda-graphs on needs a CUDA device and the triton backend (here: {device}, {backend})")
    return possible and setting != "off"


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device
