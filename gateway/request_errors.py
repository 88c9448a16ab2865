"""The error the gateway's request path raises for a request it refuses: a
status, a message, and the request field it is about.

The gRPC API turns it into its status, the HTTP API into its status code and
OpenAI's error JSON, whose ``param`` is ``field`` in OpenAI's naming
(``gateway.error_statuses`` maps every exception of the request path). A
field is named as the gRPC request names it: ``sampling.max_new_tokens``,
``chat.messages[2].role``. A refused field's value raises the processes'
shared ``kvd.common.field_error.FieldError`` instead (INVALID_ARGUMENT), which
the gRPC API also names beside its status, as the engines do.
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
