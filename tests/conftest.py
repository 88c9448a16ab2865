"""Shared test helpers: real daemon processes on real sockets.

The fixtures are built from the benchmarks' process handles
(benchmarks/harness/handles.py), so the suite and the benchmarks start,
wait for and stop the stack alike.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

# NOTE: ChildProcess and wait_serving are imported by tests from here.
from benchmarks.harness.handles import ChildProcess, DaemonProcess, EngineProcess, GatewayProcess, RedisProcess  # noqa: F401
from benchmarks.harness.processes import free_port, stop_process, wait_for, wait_serving  # noqa: F401
from kvd.common.client import DaemonClient


def _interpret_triton_without_cuda() -> None:
    """Triton kernels run in Triton's interpreter on CPU tensors where there is
    no CUDA (set before anything imports Triton)."""
    import torch

    if torch.cuda.is_available():
        return
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from triton.runtime import interpreter
    except ImportError:  # the dev extra is not installed; the kernel tests will say so
        return
    patch_tensor = interpreter._patch_lang_tensor

    def patch_with_scalar_index(tensor, scope) -> None:
        # NOTE: Triton 3.6's interpreter turns its one-element scalars into ints
        # with int(array), which numpy >= 2.4 refuses (loops with run-time
        # bounds fail); triton-lang/triton#9171, fixed upstream after 3.6.
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_with_scalar_index


_interpret_triton_without_cuda()


def pytest_addoption(parser):
    parser.addoption(
        "--offload-churn-s",
        type=float,
        default=0.0,
        help="seconds of churn per stack in tests/integration/test_offload.py (default: two rounds)",
    )
    parser.addoption(
        "--long",
        action="store_true",
        help="also run the tests marked long (soak and overlapping churn variants; make test-long)",
    )
    parser.addoption(
        "--fast",
        action="store_true",
        help="only the unit tests that need neither the real model nor Triton (make test-fast)",
    )
    parser.addoption(
        "--families",
        default="",
        help="comma-separated model types for tests/integration/test_model_families.py (default: all)",
    )


# Every process the suite starts inherits this variable (children of children
# too), so the end of the session can find any left running, even one whose
# parent is gone, without mistaking another run's processes for ours.
SESSION_MARK = "KVD_TEST_SESSION"
os.environ.setdefault(SESSION_MARK, f"{os.getpid()}-{time.time_ns()}")


def pytest_sessionfinish(session, exitstatus):
    """Fails the run when a process it started outlives it (and ends those)."""
    left = wait_for_strays(os.environ[SESSION_MARK], timeout_s=10)
    if not left:
        return
    names = ", ".join(f"{p.pid} {' '.join(p.info['cmdline'] or [])[:120]}" for p in left)
    session.config.get_terminal_writer().line(f"processes left running by the tests (now killed): {names}", red=True)
    for process in left:
        with contextlib.suppress(psutil.Error):
            process.kill()
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def stray_processes(mark: str) -> list[psutil.Process]:
    """Processes (other than this one) whose environment carries ``mark``."""
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        if process.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error):
            if process.status() != psutil.STATUS_ZOMBIE and process.environ().get(SESSION_MARK) == mark:
                found.append(process)
    return found


def wait_for_strays(mark: str, timeout_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while (left := stray_processes(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


UNIT_TESTS = Path(__file__).parent / "unit"


def pytest_configure(config):
    if config.getoption("--fast"):
        _refuse_interpreted_kernels()


def pytest_collection_modifyitems(config, items):
    """Marks the tests of the real model; deselects (and counts as such) the tests
    marked `long` unless --long, and all but the fast unit tests with --fast;
    puts the unit tests first; skips the tests marked `gpu` without CUDA."""
    _mark_model_tests(items)
    if not config.getoption("--long"):
        _deselect(config, items, lambda item: item.get_closest_marker("long") is not None)
    if config.getoption("--fast"):
        _deselect(config, items, lambda item: _run_order(item) != 0)
    items.sort(key=_run_order)  # stable: each module's tests keep their order
    _skip_gpu_tests_without_cuda(items)


def _mark_model_tests(items) -> None:
    """Marks `needs_model` every test that reaches the real model: all its
    fixtures (``tokenizer``, ``reference_model``, the stacks) start from
    ``model_dir``, so a new test that uses one can never land in the fast set."""
    for item in items:
        if "model_dir" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.needs_model)


def _run_order(item) -> int:
    """0: a fast unit test, 1: another unit test, 2: the rest. A broken
    invariant then fails in the first minute of a full run, not after the stacks'."""
    if not item.path.is_relative_to(UNIT_TESTS):
        return 2
    slow = item.get_closest_marker("needs_model") or item.get_closest_marker("needs_triton")
    return 1 if slow else 0


def _deselect(config, items, leave_out) -> None:
    left_out = [item for item in items if leave_out(item)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if not leave_out(item)]


def _skip_gpu_tests_without_cuda(items) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run tests/gpu/run.sh on a GPU machine")
    for item in items:
        # NOTE: the marker, not item.keywords: those hold every parent folder's
        # name too, so a checkout under a folder named gpu skipped everything.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def _refuse_interpreted_kernels() -> None:
    """In a --fast run, a test that launches a Triton kernel in the interpreter
    (seconds each) fails and says how to mark it."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return

    def refuse(*args, **kwargs):
        raise AssertionError("this test runs a Triton kernel: mark it needs_triton (make test-fast leaves those out)")

    interpreter.GridExecutor.__call__ = refuse


def blocks_held(daemon: DaemonProcess) -> int:
    """Blocks held by requests (pinned blocks excluded)."""
    with DaemonClient.connect(daemon.address) as client:
        stats = client.stats()
    return stats.num_used_blocks - stats.num_pinned_blocks


def health_status(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service)).status


def start_daemon(args: list[str], workdir: str) -> DaemonProcess:
    """A daemon on ``workdir/kvd.sock``, its shared memory in ``workdir/shm``, once it serves."""
    shm_dir = os.path.join(workdir, "shm")
    os.makedirs(shm_dir, exist_ok=True)
    # NOTE: generous ready timeouts: the test machines are shared.
    daemon = DaemonProcess(workdir, args, shm_dir=shm_dir, metrics_port=free_port(), append_log=True)
    return daemon.start()


@pytest.fixture
def workdir() -> Iterator[str]:
    # NOTE: unix socket paths are limited to ~107 bytes; pytest's tmp_path can
    # be longer, so daemons get a short folder of their own.
    path = tempfile.mkdtemp(prefix="kvd-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemon_factory(workdir: str) -> Iterator:
    started: list[DaemonProcess] = []

    def factory(*args: str, subdir: str = "") -> DaemonProcess:
        folder = os.path.join(workdir, subdir or f"d{len(started)}")
        os.makedirs(folder, exist_ok=True)
        daemon = start_daemon(list(args), folder)
        started.append(daemon)
        return daemon

    yield factory
    for daemon in started:
        daemon.stop()


SMALL_LAYOUT = ("--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "4", "--block-size", "4")


@pytest.fixture
def daemon(daemon_factory) -> DaemonProcess:
    """A daemon with a tiny layout, 32 blocks of 4 tokens, a 1 s lease."""
    return daemon_factory(*SMALL_LAYOUT, "--num-blocks", "32", "--lease-s", "1", "--max-pinned-fraction", "0.25")


# ------------------------------------------------------------------ engines


def start_engine(
    daemon: DaemonProcess, args: list[str], workdir: str, wait: bool = True, port: int = 0
) -> EngineProcess:
    """An engine on ``daemon``, its log ``workdir/engine-PORT.log``; with ``wait``, once it serves."""
    port = port or free_port()
    engine = EngineProcess(workdir, daemon.address, args, f"engine-{port}", 180, port, daemon, append_log=True)
    return engine.start(wait)


@pytest.fixture(scope="module")
def shared_stack(model_dir):
    """One daemon + float32 engine for a whole test module (tests must not depend on each other's cache)."""
    folder = tempfile.mkdtemp(prefix="kvd-", dir="/tmp")
    daemon = start_daemon(["--block-size", "16", "--num-blocks", "256", "--lease-s", "2"], folder)
    metrics_port = free_port()
    engine = start_engine(daemon, ["--model", str(model_dir), "--metrics-port", str(metrics_port)], folder)
    engine.metrics_port = metrics_port  # its step timings (inference/metrics.py)
    yield engine
    engine.stop()
    daemon.stop()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The real SmolLM2-135M-Instruct, converted once into the shared model cache."""
    from inference import model_store

    return model_store.resolve_model("smollm2", model_store.default_cache_dir())


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    """The real model's tokenizer."""
    from inference import model_store

    return model_store.load_tokenizer(model_dir)


@pytest.fixture(scope="session")
def reference_model(model_dir):
    """The real model in float64 on the CPU: the token-exact reference, loaded once for the run."""
    import torch

    from inference import model_store

    return model_store.load_model(model_dir, torch.float64, "cpu")


def memo_greedy(model, new_tokens: int):
    """``greedy(ids)``: the reference's greedy continuation, computed once per prompt."""
    from tests.integration.engine_client import reference_greedy

    memo: dict[tuple[int, ...], list[int]] = {}

    def greedy(ids: list[int]) -> list[int]:
        if tuple(ids) not in memo:
            memo[tuple(ids)] = reference_greedy(model, ids, new_tokens)
        return memo[tuple(ids)]

    return greedy


@pytest.fixture
def stack_factory(daemon_factory, workdir, model_dir):
    """Starts a daemon and an engine on it: ``stack_factory(daemon_args, engine_args)``."""
    engines: list[EngineProcess] = []

    def factory(daemon_args=(), engine_args=(), wait: bool = True) -> EngineProcess:
        daemon = daemon_factory("--block-size", "16", "--lease-s", "2", *daemon_args)
        engine = start_engine(daemon, ["--model", str(model_dir), *engine_args], workdir, wait=wait)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.stop()


# ----------------------------------------------------------------- gateways


def start_gateway(
    engine_address: str, args: list[str], workdir: str, port: int = 0, wait: bool = True
) -> GatewayProcess:
    """Starts a gateway and (with ``wait``) waits until it serves: its engine answers."""
    port = port or free_port()
    args = ["--keeper-interval-s", "0.2", *args]
    name = f"gateway-{port}"
    gateway = GatewayProcess(workdir, engine_address, args, name=name, port=port, data_dir="", append_log=True)
    return gateway.start(wait)


@contextlib.contextmanager
def gateway_on_local_redis(
    engines: str, workdir: str, replicas: int, args: Sequence[str] = (), api_key: str | None = None
) -> Iterator:
    """A gateway over ``engines`` whose keys live under a prefix of its own in
    the real Redis at 127.0.0.1:6379, yielded once ``replicas`` of them serve
    (asked with ``api_key`` when it checks keys); stopped and its keys deleted after."""
    import redis

    from gateway.client import GatewayClient

    prefix = f"kvd-test-{secrets.token_hex(4)}:"
    redis_args = ["--redis-url", "redis://127.0.0.1:6379/0", "--redis-prefix", prefix, "--health-interval-s", "0.2"]
    gateway = start_gateway(engines, [*redis_args, *args], workdir)
    try:
        with GatewayClient(gateway.address, api_key=api_key, timeout_s=120) as client:
            assert wait_for(lambda: sum(r.serving for r in client.info().replicas) == replicas, 30), gateway.log()
        yield gateway
    finally:
        gateway.stop()
        server = redis.Redis(host="127.0.0.1", port=6379)
        for key in server.scan_iter(f"{prefix}*"):
            server.delete(key)


@dataclass(frozen=True)
class HttpStack:
    """A daemon, an engine and a gateway serving the HTTP API (``base_url``: its ``/v1``)."""

    daemon: DaemonProcess
    engine: EngineProcess
    gateway: GatewayProcess
    base_url: str
    folder: str


@contextlib.contextmanager
def http_stack(
    model_dir: Path,
    daemon_args: Sequence[str],
    engine_args: Sequence[str] = (),
    gateway_args: Sequence[str] = (),
    folder: str | None = None,
    api_key: str | None = None,
) -> Iterator[HttpStack]:
    """A daemon, an engine on ``model_dir`` and a gateway on the real Redis
    serving HTTP on a free port, yielded once ``/ready`` answers 200; stopped
    after, and ``folder`` (default: a new one) removed."""
    import httpx2 as httpx

    folder = folder or tempfile.mkdtemp(prefix="kvd-http-", dir="/tmp")
    http = f"127.0.0.1:{free_port()}"
    daemon = start_daemon(list(daemon_args), folder)
    engine = start_engine(daemon, ["--model", str(model_dir), *engine_args], folder)
    try:
        args = ["--http-listen", http, *gateway_args]
        with gateway_on_local_redis(engine.address, folder, 1, args, api_key=api_key) as gateway:
            assert wait_for(lambda: httpx.get(f"http://{http}/ready").status_code == 200, 30), gateway.log()
            yield HttpStack(daemon, engine, gateway, f"http://{http}/v1", folder)
    finally:
        engine.stop()
        daemon.stop()
        shutil.rmtree(folder, ignore_errors=True)


def start_redis(workdir: str) -> RedisProcess:
    """A real redis-server of our own (one a test may stop), its files in ``workdir``."""
    return RedisProcess(workdir).start()
