"""Structured outputs: a request's constraint (a JSON schema, any JSON
object, a regular expression, a choice among strings, a grammar) compiled
into a grammar whose allowed next tokens mask the sampler's logits.

The grammar library is xgrammar (docs/structured-outputs.md says why: on
this project's CPU it compiled a ten-tool schema in 12 ms against
llguidance's 1.2 s to its first mask, and fills a mask in about 1 us).

- :class:`GrammarCompiler` (one per engine) turns a ``Constraint`` message
  into a compiled grammar. xgrammar's compiler keeps what it compiled, keyed
  by the constraint's text, so a schema every request repeats is compiled
  once. It runs on the gRPC handler's thread, not the step loop's: a request
  waits for its own grammar, the others go on.
- :class:`GrammarState` (one per constrained sequence) follows the tokens
  the sequence takes and says which may come next.
- :func:`mask_logits` sets the logits of every token a row's grammar does
  not allow to -inf, on the logits' device; rows without a grammar are not
  touched. Where the grammar allows the most likely token, greedy decoding
  picks the same token it would have picked without it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from inference.host_values import host_to, to_device
from kvd.common.field_error import FieldError
from kvd_api.engine.v1 import engine_pb2 as pb

FIELD = "constraint"  # within SamplingParams
#: Whitespace characters in a row that a JSON output may hold between its tokens:
#: room for indented output, not for a sampled run of blank lines that never ends.
MAX_JSON_WHITESPACE = 20
#: Bytes of compiled grammars xgrammar keeps (its cache, by the constraint's text).
CACHE_BYTES = 256 << 20

_BITS = 32


@dataclass(frozen=True)
class Constraint:
    """One request's constraint, as its message gave it (hashable: the cache's key)."""

    kind: str  # json_schema, json_object, regex, choice, grammar
    spec: str  # the schema, regex or grammar text; the choices as a JSON list

    @classmethod
    def from_pb(cls, msg: pb.Constraint) -> Constraint | None:
        kind = msg.WhichOneof("kind")
        if kind is None:
            return None
        if kind == "json_object":
            if not msg.json_object:
                raise FieldError(FIELD, f"{FIELD}.json_object: set it to true (or leave the constraint out)")
            return cls(kind, "")
        if kind == "choice":
            options = list(msg.choice.options)
            if not options or any(not o for o in options):
                raise FieldError(FIELD, f"{FIELD}.choice: give one or more options, none of them empty")
            return cls(kind, json.dumps(options, ensure_ascii=False))
        spec = getattr(msg, kind)
        if not spec.strip():
            raise FieldError(FIELD, f"{FIELD}.{kind} is empty")
        return cls(kind, spec)


class GrammarCompiler:
    """Compiles constraints against one tokenizer (thread-safe).

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the model's logits' width (may exceed the tokenizer's).
        eos_token_ids: the tokens that end an output: a finished grammar allows only these.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        import xgrammar  # noqa: PLC0415 (its native library loads only in an engine that needs it)

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_token_ids) or None
        )
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_limit_bytes=CACHE_BYTES)
        self.vocab_size = vocab_size

    def state(self, constraint: Constraint) -> GrammarState:
        """A new sequence's state under ``constraint``, compiled (or found) first.

        Raises:
            FieldError: the constraint does not compile, or matches nothing.
        """
        grammar = self._compile(constraint)
        state = GrammarState(self._xgr.GrammarMatcher(grammar), self.vocab_size)
        if not state.allows_anything():
            raise FieldError(FIELD, f"{FIELD}.{constraint.kind}: no output can match it")
        return state

    def _compile(self, c: Constraint):
        compiler = self._compiler
        try:
            if c.kind == "json_schema":
                schema = json.loads(c.spec)
                if not isinstance(schema, dict):
                    raise ValueError("a JSON schema is a JSON object")
                if (where := unenforced(schema)) is not None:
                    raise ValueError(f"{where}: this schema feature is not enforced, so outputs could break it")
                # NOTE: strict, as OpenAI's strict schemas and vLLM: an object
                # whose schema leaves additionalProperties out gets no others.
                return compiler.compile_json_schema(c.spec, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if c.kind == "json_object":
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE
                )
            if c.kind == "regex":
                return compiler.compile_regex(c.spec)
            if c.kind == "choice":
                options = json.loads(c.spec)
                return compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)
                )
            return compiler.compile_grammar(c.spec)
        except (ValueError, RuntimeError, TypeError) as exc:  # xgrammar raises RuntimeError for a bad input
            raise FieldError(FIELD, f"{FIELD}.{c.kind}: {_reason(exc)}") from None


# Keywords xgrammar 0.2.9 accepts but does not enforce (outputs sampled under
# them broke them: tests/unit/test_constraints.py): refused, not silently weakened.
_NOT_ENFORCED = frozenset({
    "not", "uniqueItems", "contains", "minContains", "maxContains", "if", "then", "else",
    "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedItems",
})  # fmt: skip
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties")


def unenforced(schema: object, path: str = "") -> str | None:
    """Where ``schema`` uses a feature the grammar would not enforce (its
    path and keyword), or None: ``not``, ``uniqueItems``, ``if``, ...; an
    ``allOf`` of several schemas (one is fine); a ``oneOf`` without a
    ``discriminator`` (its branches may overlap: give ``anyOf``); a ``$ref``
    to another document."""
    if not isinstance(schema, dict):
        return None
    here = f"{path}." if path else ""
    found = next((key for key in schema if key in _NOT_ENFORCED), None)
    if found is not None:
        return here + found
    if len(schema.get("allOf") or ()) > 1:
        return f"{here}allOf (of more than one schema)"
    if "oneOf" in schema and "discriminator" not in schema:
        return f"{here}oneOf (without a discriminator; give anyOf)"
    if isinstance(ref := schema.get("$ref"), str) and not ref.startswith("#"):
        return f"{here}$ref (to another document)"
    children = [(f"{here}{key}.{name}", sub) for key in _SCHEMA_MAPS for name, sub in _items(schema.get(key))]
    children += [(f"{here}{key}[{i}]", sub) for key in _SCHEMA_LISTS for i, sub in enumerate(_list(schema.get(key)))]
    children += [(f"{here}{key}", schema[key]) for key in _SCHEMA_VALUES if key in schema]
    return next((where for child_path, sub in children if (where := unenforced(sub, child_path))), None)


def _items(value: object) -> list:
    return list(value.items()) if isinstance(value, dict) else []


def _list(value: object) -> list:
    return value if isinstance(value, list) else []


def _reason(exc: Exception) -> str:
    """xgrammar's message without its source location (``[12:00:00] /project/cpp/x.cc:94: ``)."""
    text = str(exc).strip()
    return re.sub(r"^\[[\d:]+\] \S+?:\d+: ", "", text) or type(exc).__name__


class GrammarState:
    """Where one sequence stands in its grammar."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Writes the tokens allowed next into ``bitmask[row]`` (a bit per
        token); False when every token is allowed (the row needs no mask)."""
        return bool(self._matcher.fill_next_token_bitmask(bitmask, row))

    def accept(self, token: int) -> bool:
        """Advances past ``token``; False when the grammar does not allow it."""
        return bool(self._matcher.accept_token(token))

    @property
    def finished(self) -> bool:
        """The grammar took an end-of-sequence token: nothing may follow."""
        return bool(self._matcher.is_terminated())

    def allows_anything(self) -> bool:
        bitmask = new_bitmask(1, self.vocab_size)
        self.fill(bitmask, 0)
        return bool(bitmask.any())


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask for ``rows`` rows (int32 words, a bit per token)."""
    return torch.full((rows, -(-vocab_size // _BITS)), -1, dtype=torch.int32)


def mask_logits(logits: torch.Tensor, states: Sequence[GrammarState | None]) -> None:
    """Sets, in place, the logits of the tokens each row's grammar forbids to
    -inf (rows whose state is None, or whose grammar allows everything, keep theirs)."""
    rows = [row for row, state in enumerate(states) if state is not None]
    if not rows:
        return
    bitmask = new_bitmask(len(rows), logits.shape[1])
    masked = [i for i, row in enumerate(rows) if states[row].fill(bitmask, i)]  # type: ignore[union-attr]
    if not masked:
        return
    rows = [rows[i] for i in masked]
    forbidden = _forbidden(bitmask[masked], logits)
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(forbidden, -torch.inf)
        return
    index = host_to(logits, rows, torch.long)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(forbidden, -torch.inf))


def _forbidden(bitmask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A bool per token of each row of a bitmask (bit j of word w: token 32w + j),
    true where the token is forbidden, on ``like``'s device."""
    vocab_size = like.shape[1]
    inverted = ~bitmask
    if not like.is_cuda:
        # NOTE: numpy's unpackbits is a table lookup: a tenth of the shifts' time on the CPU.
        bits = np.unpackbits(inverted.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
        return torch.from_numpy(bits).view(torch.bool).to(like.device)
    # On a GPU: a bitmask's worth of bytes crosses over (a bool per token would be 32 times more).
    words = to_device(like, inverted)
    shifts = torch.arange(_BITS, dtype=torch.int32, device=like.device)
    return ((words[:, :, None] >> shifts) & 1).reshape(words.shape[0], -1)[:, :vocab_size].bool()
