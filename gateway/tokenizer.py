"""The engines' tokenizer, loaded once in the gateway.

Every replica serves the same model, so the gateway fetches the tokenizer's
files from one of them (the engine's ``TokenizerFiles``) the first time it
needs them, loads them with transformers, and tokenizes locally from then on:
a templated or routed request costs no tokenizing round trip. Text and chat
messages become exactly the ids the engine's own ``Tokenize`` returns: both
render with ``kvd.common.chat``.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from kvd.common import chat
from kvd.common.field_error import FieldError
from kvd_api.engine.v1 import engine_pb2 as epb

Message = tuple[str, str]  # (role, content)


class GatewayTokenizer:
    """Args:
    fetch_files: the tokenizer's files (name -> bytes); the gateway asks a
        serving replica (``gateway.replicas.EngineLink.tokenizer_files``).
    """

    def __init__(self, fetch_files: Callable[[], dict[str, bytes]]) -> None:
        self.fetch_files = fetch_files
        self._tokenizer = None
        self._lock = threading.Lock()

    def text_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids (``add_special_tokens=False``: a text that continues others' tokens)."""
        return chat.text_ids(self._loaded(), text, add_special_tokens)

    def chat_ids(self, prompt: epb.ChatPrompt | Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        """``prompt`` (a ChatPrompt, or (role, content) messages rendered with
        ``add_generation_prompt``) through the model's chat template, as token ids (FieldError: refused)."""
        if not isinstance(prompt, epb.ChatPrompt):
            prompt = chat_of(prompt, add_generation_prompt)
        return chat.chat_ids(self._loaded(), prompt)

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids``, special tokens included.

        Raises:
            FieldError: (naming ``tokens``) an id outside the vocabulary.
        """
        tokenizer = self._loaded()
        vocab = len(tokenizer)
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise FieldError("tokens", f"tokens: token id {bad} is outside the vocabulary [0, {vocab})")
        return tokenizer.decode(list(token_ids))

    def token_text(self, token_id: int) -> str:
        """One token's text alone (logprobs name their tokens by it)."""
        return self._loaded().decode([token_id])

    def _loaded(self):
        """The tokenizer, fetched on first use.

        Raises:
            NoReplica: no replica serves (the next call tries again).
            grpc.RpcError: the replica failed to answer.
        """
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = load(self.fetch_files())
            return self._tokenizer


def load(files: dict[str, bytes]):
    """A transformers tokenizer from the files ``save_pretrained`` wrote."""
    from transformers import AutoTokenizer  # heavy: only once a tokenizer is needed

    with tempfile.TemporaryDirectory(prefix="kvd-gateway-tokenizer-") as folder:
        for name, content in files.items():
            if Path(name).name != name:
                raise ValueError(f"tokenizer file name {name!r} is not a plain name")
            (Path(folder) / name).write_bytes(content)
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def chat_of(
    messages: Sequence[Message], add_generation_prompt: bool, like: epb.ChatPrompt | None = None
) -> epb.ChatPrompt:
    """A chat prompt of ``messages`` (role, content), rendered as ``like`` says
    (its ``continue_final_message``, ``chat_template_kwargs`` and tools), if given."""
    prompt = epb.ChatPrompt(add_generation_prompt=add_generation_prompt)
    if like is not None:
        prompt.continue_final_message = like.continue_final_message
        if like.HasField("chat_template_kwargs"):
            prompt.chat_template_kwargs.CopyFrom(like.chat_template_kwargs)
        prompt.tools.extend(like.tools)
        prompt.tool_prompt = like.tool_prompt
    prompt.messages.extend(epb.ChatMessage(role=role, content=content) for role, content in messages)
    return prompt
