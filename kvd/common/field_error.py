"""A refused request field, named across the process boundary.

A check that refuses a field's value raises ``FieldError``; the status
interceptor (``kvd.common.grpc_server``) sends its field beside the status, as
the trailing metadata ``kvd-field``, so that a caller in another process (the
gateway calling an engine) knows which field it was without reading the message.
Fields are named as the request's proto names them: ``sampling.top_p``,
``prompt.token_ids``.
"""

from __future__ import annotations

import grpc

#: The trailing metadata key that carries an INVALID_ARGUMENT's field.
FIELD_METADATA_KEY = "kvd-field"


class FieldError(ValueError):
    """``field``'s value is refused (INVALID_ARGUMENT); None: the request as a whole."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field

    def within(self, parent: str) -> FieldError:
        """The same refusal, its field and message prefixed by the message that holds it
        (``top_p`` in ``SamplingParams`` is ``sampling.top_p`` in a request)."""
        return FieldError(f"{parent}.{self.field}" if self.field else parent, f"{parent}.{self}")


def trailing_field(field: str | None) -> tuple[tuple[str, str], ...]:
    """The trailing metadata that names ``field`` (none for the whole request)."""
    return ((FIELD_METADATA_KEY, field),) if field else ()


def field_of(err: grpc.RpcError) -> str | None:
    """The field a peer's INVALID_ARGUMENT names in its trailing metadata, if any."""
    metadata = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    return next((value for key, value in metadata or () if key == FIELD_METADATA_KEY), None)
