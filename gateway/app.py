"""Wires one gateway process: Redis, the engine replicas, keys, the keeper, the server."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc

from gateway import redis_conn
from gateway.config import GatewaySettings
from gateway.error_statuses import STATUS_BY_ERROR
from gateway.keeper import TemplateKeeper
from gateway.replicas import ReplicaPool
from gateway.request_path import RequestPath
from gateway.router import Router
from gateway.service import GatewayService
from gateway.templates import TemplateStore
from gateway.tenants import Authenticator, FileKeys, KeyStore, RedisKeys
from kvd.common.grpc_server import CallLimit, OpenCalls, build_server
from kvd_api.engine.v1 import engine_pb2 as epb
from kvd_api.gateway.v1 import gateway_pb2 as pb
from kvd_api.gateway.v1 import gateway_pb2_grpc as pb_grpc

log = logging.getLogger("gateway.app")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Gateway"].full_name


def default_data_dir() -> Path:
    return Path.home() / ".local" / "share" / "kvd"


class GatewayApp:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.redis, self.embedded_redis = redis_conn.connect(
            settings.redis_url, settings.data_dir or default_data_dir()
        )
        try:
            self._build()
        except BaseException:
            self._stop_redis()
            raise

    def _build(self) -> None:
        settings = self.settings
        self.store = TemplateStore(self.redis, settings.redis_prefix)
        self.pool = ReplicaPool(
            settings.engines,
            Router(settings.routing),
            health_interval_s=settings.health_interval_s,
            resolve_interval_s=settings.dns_interval_s,
            replica_wait_s=settings.replica_wait_s,
            on_health=self._engine_health,
        )
        self.auth = Authenticator(self._key_store())
        self.keeper = TemplateKeeper(self.store, self.pool, settings.keeper_interval_s)
        tool_prompt = epb.ToolPrompt.Value(f"TOOL_PROMPT_{settings.tool_prompt.upper()}")
        service = GatewayService(
            RequestPath(
                self.store, self.pool, self.keeper, self.auth, settings.limits, tool_prompt, settings.cache_ttls
            )
        )
        # One count of generations for both APIs.
        self.open_calls = OpenCalls(settings.max_open_requests, "--max-open-requests")
        # The gateway serves (templates, info) while at least one replica does.
        self.server = build_server(
            [(pb_grpc.add_GatewayServicer_to_server, service, SERVICE_NAME)],
            STATUS_BY_ERROR,
            serving=False,
            max_workers=32,  # templates, Info, health
            thread_name_prefix="gateway-rpc",
            long_calls=CallLimit(frozenset({"Generate", "Complete"}), self.open_calls),
        )
        self.port = self._add_port()
        self.http = self._http_server(service)

    def _key_store(self) -> KeyStore | None:
        keys = self.settings.api_keys
        if not keys:
            return None
        if keys == "redis":
            return RedisKeys(self.redis, self.settings.redis_prefix)
        return FileKeys(Path(keys))

    def _add_port(self) -> int:
        s = self.settings
        if s.tls_cert is None or s.tls_key is None:
            return self.server.add_port(s.listen)
        credentials = grpc.ssl_server_credentials([(s.tls_key.read_bytes(), s.tls_cert.read_bytes())])
        return self.server.add_port(s.listen, credentials)

    def _http_server(self, service: GatewayService):
        """The HTTP API's listener (bound now: a taken port fails the start), or None."""
        if not self.settings.http_listen:
            return None
        from gateway.http_api.server import HttpServer  # the ASGI stack loads only when it serves

        s = self.settings
        return HttpServer(service.requests, self.open_calls, s.http_listen, s.tls_cert, s.tls_key, s.served_model_names)

    def _engine_health(self, up: bool) -> None:
        self.server.set_serving(up)

    def start(self) -> None:
        self.server.start()
        self.pool.start()
        self.keeper.start()
        if self.http is not None:
            self.http.start()
        s = self.settings
        log.info(
            "gateway serving",
            extra={"listen": s.listen, "engines": s.engines, "redis": redis_conn.describe(self.redis),
                   "tls": s.tls_cert is not None, "routing": s.routing.policy,
                   "http": self.http.address if self.http is not None else ""},
        )  # fmt: skip
        if self.auth.single_user:
            log.warning("single-user mode: no API keys are checked; every call is the tenant 'default'")

    def stop(self) -> None:
        if self.http is not None:
            self.http.stop()
        self.keeper.stop()
        self.server.stop(grace_s=2)
        self.pool.stop()
        self._stop_redis()

    def _stop_redis(self) -> None:
        self.redis.close()
        if self.embedded_redis is not None:
            self.embedded_redis.stop()
