"""The engine's gRPC service: validation, streaming, and the Engine in between."""

from __future__ import annotations

import functools
import logging
import secrets
import tempfile
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from inference.constraints import Constraint, GrammarCompiler, GrammarState
from inference.engine import Engine, EngineUnavailable
from inference.requests import Finish, Sequence
from inference.sampling import SamplingParams
from inference.streams import StreamError, StreamFinished, StreamPromptLogprobs, StreamTokens
from kvd.common.cache_marks import check_marks
from kvd.common.client import DaemonClient
from kvd.common.field_error import FieldError
from kvd.common.grpc_server import CallLimit, OpenCalls, Server, StatusTable
from kvd.common.grpc_server import build_server as build_grpc_server
from kvd_api.engine.v1 import engine_pb2 as pb
from kvd_api.engine.v1 import engine_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from inference.app import DrainResult

log = logging.getLogger("inference.service")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Engine"].full_name
DEFAULT_MAX_NEW_TOKENS = 64

_FINISH_TO_PB = {
    Finish.LENGTH: pb.FINISH_REASON_LENGTH,
    Finish.STOP: pb.FINISH_REASON_STOP,
    Finish.EOS: pb.FINISH_REASON_EOS,
    Finish.CANCELLED: pb.FINISH_REASON_CANCELLED,
}


class ModelInfo:
    """What the service needs to know of the model."""

    def __init__(self, name: str, dtype: str, device: str, backend: str, max_context: int, vocab_size: int,
                 eos_token_ids: set[int], block_size: int, model_type: str = "",
                 num_blocks: int = 0, default_sampling: dict[str, float] | None = None,
                 hub_id: str = "") -> None:  # fmt: skip
        self.name, self.dtype, self.device, self.backend = name, dtype, device, backend
        self.model_type = model_type
        self.max_context, self.vocab_size, self.block_size = max_context, vocab_size, block_size
        self.num_blocks = num_blocks  # the daemon's device pool (0: not attached yet)
        self.eos_token_ids = eos_token_ids
        #: the sampling its generation_config recommends (model_store.default_sampling)
        self.default_sampling = default_sampling or {}
        self.hub_id = hub_id  # its Hugging Face id where known (model_store.hub_id)

    @property
    def token_capacity(self) -> int:
        """The most tokens (prompt and output) one request may hold: the
        model's context, and what the KV cache holds less the pipelined
        loop's speculative slot (see ``EngineService._check_fits``)."""
        if self.num_blocks and self.block_size:
            return min(self.max_context, self.num_blocks * self.block_size - 1)
        return self.max_context


class EngineService(pb_grpc.EngineServicer):
    """Args:
    prefix_caching: when False every request gets a salt of its own, so
        nothing it computes is ever reused (the cache's worth, measured).
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer,
        info: ModelInfo,
        prefix_caching: bool = True,
        drain: Callable[[float], DrainResult] | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.info = info
        self.prefix_caching = prefix_caching
        self._drain = drain
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()

    def _grammars(self) -> GrammarCompiler:
        """The engine's grammar compiler, made by the first constrained request."""
        with self._grammars_lock:
            if self._grammar_compiler is None:
                i = self.info
                self._grammar_compiler = GrammarCompiler(self.tokenizer, i.vocab_size, i.eos_token_ids)
            return self._grammar_compiler

    def _grammar_state(self, constraint: Constraint) -> GrammarState:
        """Compiled here, on the request's own thread: the step loop never waits for a grammar."""
        try:
            return self._grammars().state(constraint)
        except FieldError as exc:
            raise exc.within("sampling") from None

    def _salt(self, requested: bytes) -> bytes:
        return requested if self.prefix_caching else secrets.token_bytes(16)

    # ----------------------------------------------------------- Generate

    def Generate(self, request, context):
        prompt = self._prompt_ids(request, "prompt")
        params = sampling_params(request.sampling, self._default_max_new_tokens(request.sampling, len(prompt)))
        self._check_stop_ids(params.stop_token_ids)
        self._check_bias_ids(params.logit_bias)
        self._check_fits(len(prompt), params.max_new_tokens)
        seq = Sequence(uuid.uuid4().hex, prompt, params, cache_salt=self._salt(request.cache_salt))
        if request.HasField("cache_marks") and request.cache_marks.marks:
            try:
                check_marks(request.cache_marks, len(prompt))
            except FieldError as exc:
                raise exc.within("cache_marks") from None
            seq.cache_marks = request.cache_marks
        if params.constraint is not None:
            seq.grammar = self._grammar_state(params.constraint)
        response_id = request.request_id or seq.request_id
        yield from self._stream(seq, response_id, context)

    def _stream(self, seq: Sequence, response_id: str, context):
        self.engine.submit(seq)
        # Fires when the client cancels, the deadline passes, or the call
        # ends; cancelling a finished sequence does nothing.
        context.add_callback(lambda: self.engine.cancel(seq.request_id))
        while True:
            match seq.events.get():
                case StreamPromptLogprobs(first, logprobs, top):
                    yield pb.GenerateResponse(
                        request_id=response_id,
                        prompt_logprobs=pb.PromptLogprobs(
                            token_ids=seq.prompt_ids, first_position=first, logprobs=logprobs,
                            top_logprobs=[pb.TopLogprobs(token_ids=ids, logprobs=lps) for ids, lps in top],
                        ),
                    )  # fmt: skip
                case StreamTokens(token_ids, logprobs, text, top):
                    yield pb.GenerateResponse(
                        request_id=response_id,
                        token_ids=token_ids,
                        logprobs=logprobs,
                        text=text,
                        top_logprobs=[pb.TopLogprobs(token_ids=ids, logprobs=lps) for ids, lps in top],
                    )
                case StreamFinished(finish, completion_tokens):
                    yield pb.GenerateResponse(
                        request_id=response_id,
                        finish_reason=_FINISH_TO_PB[finish],
                        usage=usage(seq, completion_tokens),
                    )
                    return
                case StreamError(message):
                    context.abort(grpc.StatusCode.UNAVAILABLE, message)

    # ----------------------------------------------------- unary methods

    def Tokenize(self, request, context):
        kind = request.WhichOneof("input")
        if kind is None:
            raise FieldError("input", "input: give text or chat messages")
        ids = self._chat_ids(request.chat) if kind == "chat" else self._text_ids(request.text)
        return pb.TokenizeResponse(token_ids=ids)

    def TokenizerFiles(self, request, context):
        return pb.TokenizerFilesResponse(files=self._tokenizer_files, model=self.info.name)

    @functools.cached_property
    def _tokenizer_files(self) -> dict[str, bytes]:
        return tokenizer_files(self.tokenizer)

    def Warm(self, request, context):
        prompt = self._checked_ids(list(request.token_ids), "token_ids")
        self._check_fits(len(prompt), 0)
        seq = Sequence(uuid.uuid4().hex, prompt, SamplingParams(max_new_tokens=0), request.cache_salt)
        for _ in self._stream(seq, seq.request_id, context):
            pass
        daemon = self._daemon()
        cached = daemon.device_cached_tokens(prompt, request.cache_salt)
        pinned = daemon.pin(request.pin_id, prompt, request.cache_salt) if request.pin_id else 0
        return pb.WarmResponse(cached_tokens=cached, pinned_tokens=pinned)

    def Drain(self, request, context):
        if self._drain is None:
            raise EngineUnavailable("this engine cannot be drained (it was not started by kvd-engine)")
        if request.timeout_s < 0:
            raise FieldError("timeout_s", f"timeout_s must be >= 0, got {request.timeout_s}")
        result = self._drain(request.timeout_s)
        return pb.DrainResponse(handed_back=result.handed_back, cut_short=result.cut_short, seconds=result.seconds)

    def Unpin(self, request, context):
        if not request.pin_id:
            raise FieldError("pin_id", "pin_id is empty")
        return pb.UnpinResponse(unpinned_blocks=self._daemon().unpin(request.pin_id))

    def BlockEvents(self, request, context):
        # NOTE: the gateway knows engine addresses only (the daemon may sit on a
        # unix socket inside the engine's pod), so the engine relays its daemon's
        # events as they are. A daemon lost mid-stream ends the call; the
        # caller subscribes again and reaches whichever daemon is attached then.
        events = self._daemon().events()
        context.add_callback(events.cancel)  # the client left: stop the daemon's stream
        try:
            yield from events
        except grpc.RpcError as err:
            if context.is_active():
                context.abort(grpc.StatusCode.UNAVAILABLE, f"KV-cache daemon events: {err.details()}")

    def Load(self, request, context):
        seen = -1
        while context.is_active():
            seen, r = self.engine.load.wait(seen, timeout_s=1.0)
            yield pb.LoadReport(
                queued_tokens=r.queued_tokens, waiting=r.waiting, running=r.running, free_blocks=r.free_blocks,
                forward_s=r.forward_s, token_s=r.token_s, token_budget=r.token_budget,
            )  # fmt: skip

    def _daemon(self) -> DaemonClient:
        session = self.engine.session
        if session is None:
            raise EngineUnavailable("the engine is not attached to the KV-cache daemon")
        return session.client

    def Info(self, request, context):
        i = self.info
        return pb.InfoResponse(
            model=i.name,
            dtype=i.dtype,
            block_size=i.block_size,
            max_context=i.max_context,
            attention_backend=i.backend,
            vocab_size=i.vocab_size,
            eos_token_ids=sorted(i.eos_token_ids),
            device=i.device,
            cache_id=session.cache_id if (session := self.engine.session) is not None else "",
            model_type=i.model_type,
            draining=bool(self.engine.draining),
            default_sampling=pb.SamplingParams(**i.default_sampling),
            hub_id=i.hub_id,
        )

    # ---------------------------------------------------------- helpers

    def _prompt_ids(self, request, field: str) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            ids = self._text_ids(request.text)
        elif kind == "chat":
            ids = self._chat_ids(request.chat)
        elif kind == "token_ids":
            ids = self._checked_ids(list(request.token_ids.ids), "prompt.token_ids")
        else:
            raise FieldError(field, f"{field}: give text, chat messages or token ids")
        if not ids:
            raise FieldError(field, f"{field} is empty")
        return ids

    def _text_ids(self, text: str) -> list[int]:
        from kvd.common import chat as prompts  # the gateway renders with it too: its block hashes must match

        return prompts.text_ids(self.tokenizer, text)

    def _chat_ids(self, chat) -> list[int]:
        from kvd.common import chat as prompts

        return prompts.chat_ids(self.tokenizer, chat)

    def _checked_ids(self, ids: list[int], field: str) -> list[int]:
        if not ids:
            raise FieldError(field, f"{field} is empty")
        vocab = self.info.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise FieldError(field, f"{field}: token id {bad} is outside the vocabulary [0, {vocab})")
        return ids

    def _check_stop_ids(self, ids: tuple[int, ...]) -> None:
        vocab = self.info.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise FieldError(
                "sampling.stop_token_ids",
                f"sampling.stop_token_ids: token id {bad} is outside the vocabulary [0, {vocab})",
            )

    def _check_bias_ids(self, logit_bias) -> None:
        vocab = self.info.vocab_size
        bad = next((t for t in logit_bias if not 0 <= t < vocab), None)
        if bad is not None:
            raise FieldError(
                "sampling.logit_bias", f"sampling.logit_bias: token id {bad} is outside the vocabulary [0, {vocab})"
            )

    def _default_max_new_tokens(self, msg: pb.SamplingParams, prompt_len: int) -> int:
        """max_new_tokens when the request leaves it unset: 64, or with
        ``max_new_tokens_to_context`` what room the context and the KV cache leave."""
        if not msg.max_new_tokens_to_context or msg.HasField("max_new_tokens"):
            return DEFAULT_MAX_NEW_TOKENS
        room = self.info.token_capacity - prompt_len
        if room < 1:
            raise FieldError(
                "prompt",
                f"prompt ({prompt_len} tokens) fills the context: a request holds at most "
                f"{self.info.token_capacity} tokens here (the model's context and the KV cache's size)",
            )
        return room

    def _check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        if prompt_len + max_new_tokens > self.info.max_context:
            raise FieldError(
                "prompt",
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context "
                f"of {self.info.max_context} tokens",
            )
        # NOTE: a request whose blocks outnumber the whole pool would be
        # admitted, preempted when it outgrows the pool, and admitted again,
        # forever. One more position: the pipelined loop's speculative slot.
        block_size, num_blocks = self.info.block_size, self.info.num_blocks
        if num_blocks and block_size:
            needed = -(-(prompt_len + max_new_tokens) // block_size)
            if needed > num_blocks:
                raise FieldError(
                    "prompt",
                    f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) need {needed} KV blocks of "
                    f"{block_size} tokens; the KV cache holds {num_blocks} in all",
                )


def _daemon_status(err: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    """The daemon's refusals (pin cap, unknown pin) pass on with their status;
    a lost or failing daemon is UNAVAILABLE."""
    code = err.code()
    if code not in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND):
        code = grpc.StatusCode.UNAVAILABLE
    return code, f"KV-cache daemon: {err.details()}"


# The engine's exceptions and the statuses callers get for them (kvd.common.grpc_server).
# NOTE: the only gRPC calls an engine's handlers make are to its daemon.
STATUS_BY_ERROR: StatusTable = (
    (grpc.RpcError, _daemon_status),
    (EngineUnavailable, grpc.StatusCode.UNAVAILABLE),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


def tokenizer_files(tokenizer) -> dict[str, bytes]:
    """The files ``save_pretrained`` writes (name -> bytes): what another
    process needs to load exactly this tokenizer, chat template included."""
    with tempfile.TemporaryDirectory(prefix="kvd-tokenizer-") as folder:
        tokenizer.save_pretrained(folder)
        return {path.name: path.read_bytes() for path in Path(folder).iterdir() if path.is_file()}


def sampling_params(msg: pb.SamplingParams, default_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> SamplingParams:
    """Raises ``FieldError`` naming the field (``sampling.top_p``, ...) on a bad value.

    Args:
        default_max_new_tokens: max_new_tokens when ``msg`` leaves it unset.
    """
    try:
        return _sampling_params(msg, default_max_new_tokens)
    except FieldError as exc:
        raise exc.within("sampling") from None


def _sampling_params(msg: pb.SamplingParams, default_max_new_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else 0.0,
        top_k=msg.top_k if msg.HasField("top_k") else 0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
        max_new_tokens=msg.max_new_tokens if msg.HasField("max_new_tokens") else default_max_new_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
        stop=tuple(msg.stop),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs,
        top_logprobs=msg.top_logprobs,
        min_p=msg.min_p if msg.HasField("min_p") else 0.0,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        logit_bias=dict(msg.logit_bias),
        min_tokens=msg.min_tokens,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        prompt_logprobs=msg.prompt_logprobs,
        prompt_top_logprobs=msg.prompt_top_logprobs,
        prompt_logprobs_from=msg.prompt_logprobs_from or 1,
        constraint=Constraint.from_pb(msg.constraint),
    )


def usage(seq: Sequence, completion_tokens: int) -> pb.Usage:
    """``completion_tokens``: the tokens streamed (a stop string drops those sampled after it)."""
    ttft = (seq.first_token_s - seq.arrival_s) if seq.first_token_s is not None else 0.0
    return pb.Usage(
        prompt_tokens=len(seq.prompt_ids),
        cached_prompt_tokens=max(seq.num_cached_prompt, 0),
        host_cached_prompt_tokens=seq.num_host_cached_prompt,
        disk_cached_prompt_tokens=seq.num_disk_cached_prompt,
        completion_tokens=completion_tokens,
        time_to_first_token_s=ttft,
        marks=seq.marks,
    )


#: Threads for the engine's other calls: the gateways' BlockEvents and Load
#: streams (two per gateway, for its life), Tokenize, Info, health, Drain.
CONTROL_THREADS = 64


def build_server(service: EngineService, max_open_requests: int) -> Server:
    """The engine's server: health NOT_SERVING until the engine is attached,
    reflection, at most ``max_open_requests`` generations at once (no port yet)."""
    return build_grpc_server(
        [(pb_grpc.add_EngineServicer_to_server, service, SERVICE_NAME)],
        STATUS_BY_ERROR,
        serving=False,
        max_workers=CONTROL_THREADS,
        thread_name_prefix="engine-rpc",
        long_calls=CallLimit(frozenset({"Generate", "Warm"}), OpenCalls(max_open_requests, "--max-open-requests")),
    )
