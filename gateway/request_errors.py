"""The error the gateway's request path raises for a request it refuses: a
status, a message, and the request field it is about.

The gRPC API turns it into its status, the HTTP API into its status code and
OpenAI's error JSON, whose ``param`` is ``field`` in OpenAI's naming
(``gateway.error_statuses`` maps every exception of the request path). A
field is named as the gRPC request names it: ``sampling.max_new_tokens``,
``chat.messages[2].role``.
"""

from __future__ import annotations

import grpc


class RequestError(Exception):
    """A request refused with ``code``; ``field`` names the request field it is about (None: the whole request)."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field

    def status(self) -> tuple[grpc.StatusCode, str]:
        return self.code, self.message


class InvalidField(RequestError, ValueError):
    """A field's value is refused (INVALID_ARGUMENT). Also a ``ValueError``:
    caller misuse, as every check of a value in this project raises."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message, field)
