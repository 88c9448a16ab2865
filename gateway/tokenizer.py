"""The engines' tokenizer, loaded once in the gateway.

Every replica serves the same model, so the gateway fetches the tokenizer's
files from one of them (the engine's ``TokenizerFiles``) the first time it
needs them, loads them with transformers, and tokenizes locally from then on:
a templated or routed request costs no tokenizing round trip. Text and chat
messages become exactly the ids the engine's own ``Tokenize`` returns.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

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

    def text_ids(self, text: str) -> list[int]:
        return self._loaded().encode(text, add_special_tokens=False)

    def chat_ids(self, messages: Sequence[Message], add_generation_prompt: bool) -> list[int]:
        """``messages`` rendered with the model's chat template, as token ids."""
        if not messages:
            raise FieldError("chat.messages", "chat.messages is empty")
        encoded = self._loaded().apply_chat_template(
            [{"role": role, "content": content} for role, content in messages],
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
        )
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)

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


def messages_of(chat: epb.ChatPrompt) -> list[Message]:
    return [(m.role, m.content) for m in chat.messages]


def generation_prompt(chat: epb.ChatPrompt) -> bool:
    """Whether to append the assistant header (the engine's default: yes)."""
    return chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
