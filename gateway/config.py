"""The gateway's settings: one frozen, validated object, each field declaring its setting.

``kvd-gateway`` (``gateway/cli.py``) lists these settings in its command and
builds the object from the flags and ``KVD_*`` variables (see
``kvd.common.config_fields``). The routing settings are ``RouterConfig``'s
(``gateway.route_types``), the per-tenant limits ``TenantLimits``'s
(``gateway.tenants``): each declared where its value lives.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import click

from gateway.cache_marks import CacheTtls
from gateway.endpoints import check_endpoint
from gateway.route_types import ROUTING, RouterConfig
from gateway.tenants import TenantLimits
from kvd.common.config_fields import nested, optional_path, setting
from kvd.common.defaults import ENGINE_ADDRESS, GATEWAY_ADDRESS


def endpoint_list(text: str) -> list[str]:
    """``--engines``' comma-separated entries."""
    return [entry.strip() for entry in text.split(",") if entry.strip()]


def name_list(text: str | None) -> tuple[str, ...]:
    """``--served-model-name``'s comma-separated names."""
    return tuple(name.strip() for name in (text or "").split(",") if name.strip())


#: --tool-prompt's values (ChatPrompt.tool_prompt's, by name).
TOOL_PROMPTS = ("auto", "template", "kvd")


@dataclass(frozen=True)
class GatewaySettings:
    """Everything one gateway process is configured with (the CLI fills it).

    Attributes:
        engines: ``HOST:PORT`` and ``dns:NAME:PORT`` entries (see ``gateway.endpoints``).
        api_keys: "" (single-user mode), "redis", or a JSON keys file.
        keeper_interval_s: how often templates are re-checked: expired ones
            unpinned, placed again when a replica's cache is new or it left.
        routing: how requests pick a replica (``gateway.router``).
        health_interval_s: how often each replica's health is checked.
        dns_interval_s: how often ``dns:`` entries are resolved again.
        replica_wait_s: how long a request waits for a replica when none
            serves but one did lately (``ReplicaPool.await_serving``).
        http_listen: the OpenAI-compatible HTTP API's ``HOST:PORT``; "": none.
        served_model_names: the model's names in the HTTP API (empty: its own).
        tool_prompt: how tools reach the model, for requests that leave it
            unset (``kvd.common.tool_prompt``): auto, template or kvd.
        cache_ttls: how long cache breakpoints keep their prefixes (``gateway.cache_marks``).
        max_open_requests: generations (gRPC Generate and Complete, HTTP
            completions) held at once; more are refused (RESOURCE_EXHAUSTED, 429).
    """

    listen: str = setting("--listen", env="KVD_GATEWAY_ADDR", default=GATEWAY_ADDRESS, help="gRPC address")
    http_listen: str = setting(  # kvd-serve takes it too, and passes it on
        "--http-listen",
        env="KVD_HTTP_LISTEN",
        default="127.0.0.1:8000",
        help="the OpenAI-compatible HTTP API's address (docs/gateway.md); empty: no HTTP API",
    )
    served_model_names: tuple[str, ...] = setting(
        "--served-model-name",
        env="KVD_SERVED_MODEL_NAME",
        convert=name_list,
        help="the names the model answers to in the HTTP API's `model`, comma-separated; the first is the one"
        " /v1/models lists; empty: the model's folder name (and its Hugging Face id, for the bundled SmolLM2)",
    )
    max_open_requests: int = setting(
        "--max-open-requests",
        env="KVD_GATEWAY_MAX_OPEN_REQUESTS",
        type=click.INT,
        default=512,
        help="generations the gateway holds at once (gRPC Generate and Complete, HTTP completions), all"
        " tenants together; past it one is refused with RESOURCE_EXHAUSTED (HTTP 429)",
    )
    engines: list[str] = setting(
        "--engines",
        "--engine",
        "engines",
        env="KVD_ENGINES",
        default=ENGINE_ADDRESS,
        convert=endpoint_list,
        help="engine replicas, comma-separated HOST:PORT; dns:NAME:PORT stands for every address NAME resolves to",
    )
    # Where templates and keys are kept: add-key takes these three too.
    redis_url: str = setting(
        "--redis-url", env="KVD_REDIS_URL", help="redis://HOST:PORT/DB; empty: an embedded Redis in --data-dir"
    )
    data_dir: Path | None = setting(
        "--data-dir",
        env="KVD_DATA_DIR",
        convert=optional_path,
        help="where the embedded Redis keeps its files; empty: ~/.local/share/kvd",
    )
    redis_prefix: str = setting(
        "--redis-prefix", env="KVD_REDIS_PREFIX", default="kvd:", help="prefix of every Redis key"
    )
    api_keys: str = setting(
        "--api-keys", env="KVD_API_KEYS", help="a JSON keys file, or 'redis'; empty: single-user mode, no keys"
    )
    tls_cert: Path | None = setting(
        "--tls-cert", env="KVD_TLS_CERT", convert=optional_path, help="PEM certificate chain (with --tls-key)"
    )
    tls_key: Path | None = setting(
        "--tls-key", env="KVD_TLS_KEY", convert=optional_path, help="PEM private key (with --tls-cert)"
    )
    keeper_interval_s: float = setting(
        "--keeper-interval-s",
        env="KVD_KEEPER_INTERVAL_S",
        type=click.FLOAT,
        default=1.0,
        help="how often expired templates are unpinned and templates placed again on replicas whose cache is new"
        " or that left",
    )
    routing: RouterConfig = nested(RouterConfig)
    health_interval_s: float = setting(
        "--health-interval-s",
        env="KVD_HEALTH_INTERVAL_S",
        type=click.FLOAT,
        default=0.5,
        section=ROUTING,
        help="how often each replica's gRPC health is checked",
    )
    replica_wait_s: float = setting(
        "--replica-wait-s",
        env="KVD_REPLICA_WAIT_S",
        type=click.FLOAT,
        default=30.0,
        section=ROUTING,
        help="how long a request waits for a replica to serve when none does (or every one refused it before"
        " its first token) but one served in the last SECONDS: a drain or a restart under way; never past the"
        " request's deadline; 0: no wait",
    )
    dns_interval_s: float = setting(
        "--dns-interval-s",
        env="KVD_DNS_INTERVAL_S",
        type=click.FLOAT,
        default=5.0,
        section=ROUTING,
        help="how often dns: entries of --engines are resolved again",
    )
    tool_prompt: str = setting(
        "--tool-prompt",
        env="KVD_TOOL_PROMPT",
        type=click.Choice(TOOL_PROMPTS),
        default="auto",
        help="how a chat request's tools reach the model (docs/structured-outputs.md): template, through its"
        " chat template's tools variable; kvd, in the system message, calls written as <tool_call>JSON</tool_call>;"
        " auto, the template's where it reads tools, else kvd's",
    )
    limits: TenantLimits = nested(TenantLimits)
    cache_ttls: CacheTtls = nested(CacheTtls)

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        if not self.engines:
            raise ValueError("at least one engine endpoint is needed")
        for entry in self.engines:
            check_endpoint(entry)
        for name in ("keeper_interval_s", "health_interval_s", "dns_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.replica_wait_s < 0:
            raise ValueError(f"replica_wait_s must be >= 0, got {self.replica_wait_s}")
        if self.max_open_requests < 1:
            raise ValueError(f"max_open_requests must be >= 1, got {self.max_open_requests}")
