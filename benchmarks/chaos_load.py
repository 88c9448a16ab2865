"""The clients of ``benchmarks/chaos.py``: gRPC and HTTP streams through the
gateway, plain and templated, each answer checked against transformers.

Every request is greedy with EOS ignored, so its answer is known in advance:
``Prompt.expected_ids`` (transformers' ``generate`` in float64, the engines'
dtype: exact). A gRPC answer is checked token by token; an HTTP stream
carries text, so it is checked against the text the stack streams for the
expected tokens (``Prompt.expected_text``, read once before any fault, its
tokens checked). A stream cut short by a fault is checked too: what it
carried must begin the expected answer.

Each client keeps one connection and opens a new one after a failure, as a
client that retries would (gRPC's own reconnect backoff grows to minutes).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import grpc
import httpx2 as httpx

from gateway.client import GatewayClient

NEW_TOKENS = 6
#: A request's deadline: a fault must end a request with a status, never hang it.
REQUEST_TIMEOUT_S = 120.0
#: The statuses the docs give for these faults (docs/deploy.md, docs/gateway.md):
#: gRPC codes, HTTP statuses, an error event in an HTTP stream that already
#: started, and a connection refused or cut (the gateway itself went away).
DOCUMENTED = frozenset(
    {
        "UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED",
        "HTTP 503", "HTTP 429", "HTTP 504",
        "stream error: unavailable", "stream error: resource_exhausted", "stream error: deadline_exceeded",
        "connection",
    }
)  # fmt: skip


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    template: str  # "" or the template's name (its tokens come first)
    expected_ids: tuple[int, ...]
    expected_text: str = ""


@dataclass
class Attempt:
    """One request as its client saw it."""

    client: str  # "grpc" or "http"
    prompt: int
    sent: float  # time.monotonic()
    ended: float | None = None
    status: str = ""  # "OK", a gRPC code's name, "HTTP 503", "stream error: ...", "connection"
    wrong_tokens: int = 0  # gRPC: positions unlike the expected ones; HTTP: 1 for a text unlike the expected
    disk_tokens: int = 0  # prompt tokens read back from the disk tier (gRPC's usage)

    def in_flight_at(self, t: float) -> bool:
        return self.sent <= t and (self.ended is None or self.ended >= t)


def wrong_token_count(got: list[int], expected: tuple[int, ...], whole: bool) -> int:
    """Positions of ``got`` unlike ``expected``'s; a whole answer's missing or extra tokens count too."""
    wrong = sum(a != b for a, b in zip(got, expected, strict=False)) + max(0, len(got) - len(expected))
    return wrong + (max(0, len(expected) - len(got)) if whole else 0)


@dataclass
class Load:
    """Client threads sending requests back to back until stopped."""

    gateway: str
    http: str  # the gateway's HTTP API, HOST:PORT
    model: str  # the served model's name (HTTP requests name it)
    prompts: list[Prompt]
    grpc_clients: int = 2
    http_clients: int = 1
    attempts: list[Attempt] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        workers = [(self._grpc_client, n) for n in range(self.grpc_clients)]
        workers += [(self._http_client, n) for n in range(self.http_clients)]
        for target, n in workers:
            thread = threading.Thread(target=target, args=(n,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(REQUEST_TIMEOUT_S + 10)

    def first_ok_after(self, t: float) -> float | None:
        """When the first request sent after ``t`` ended OK (None: none yet)."""
        ends = [a.ended for a in list(self.attempts) if a.sent >= t and a.status == "OK" and a.ended is not None]
        return min(ends, default=None)

    # ----------------------------------------------------------- clients

    def _next(self, n: int, i: int) -> tuple[int, Prompt]:
        index = (n * 7 + i) % len(self.prompts)
        return index, self.prompts[index]

    def _grpc_client(self, n: int) -> None:
        client, i = GatewayClient(self.gateway, timeout_s=REQUEST_TIMEOUT_S), 0
        while not self._stop.is_set():
            i += 1
            index, prompt = self._next(n, i)
            attempt = Attempt("grpc", index, time.monotonic())
            self.attempts.append(attempt)
            tokens: list[int] = []
            try:
                for message in client.generate(list(prompt.ids), template=prompt.template,
                                               max_new_tokens=NEW_TOKENS, ignore_eos=True):  # fmt: skip
                    tokens.extend(message.token_ids)
                    if message.HasField("usage"):
                        attempt.disk_tokens = message.usage.disk_cached_prompt_tokens
                attempt.status = "OK"
            except grpc.RpcError as err:
                attempt.status = err.code().name
            attempt.ended = time.monotonic()
            attempt.wrong_tokens = wrong_token_count(tokens, prompt.expected_ids, attempt.status == "OK")
            if attempt.status != "OK":
                client.close()
                client = GatewayClient(self.gateway, timeout_s=REQUEST_TIMEOUT_S)
                self._stop.wait(0.1)  # the stack is between processes: do not spin
        client.close()

    def _http_client(self, n: int) -> None:
        url = f"http://{self.http}/v1/completions"
        http, i = httpx.Client(timeout=REQUEST_TIMEOUT_S), 0
        while not self._stop.is_set():
            i += 1
            index, prompt = self._next(n + 100, i)
            attempt = Attempt("http", index, time.monotonic())
            self.attempts.append(attempt)
            body = {
                "model": self.model, "prompt": list(prompt.ids), "max_tokens": NEW_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True, "template": prompt.template or None,
            }  # fmt: skip
            text = ""
            try:
                attempt.status, text = _stream_text(http, url, body)
            except httpx.HTTPError:
                attempt.status = "connection"
            attempt.ended = time.monotonic()
            whole_ok = attempt.status == "OK" and text == prompt.expected_text
            cut_ok = attempt.status != "OK" and prompt.expected_text.startswith(text)
            attempt.wrong_tokens = 0 if whole_ok or cut_ok else 1
            if attempt.status != "OK":
                http.close()
                http = httpx.Client(timeout=REQUEST_TIMEOUT_S)
                self._stop.wait(0.1)
        http.close()


def _stream_text(http: httpx.Client, url: str, body: dict) -> tuple[str, str]:
    """One streamed completion: its status ("OK", "HTTP 503", "stream error: CODE") and the text it carried."""
    text = ""
    with http.stream("POST", url, json=body) as reply:
        if reply.status_code != 200:
            return f"HTTP {reply.status_code}", text
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                return f"stream error: {event['error'].get('code')}", text
            text += event["choices"][0]["text"] if event.get("choices") else ""
    return "OK", text
