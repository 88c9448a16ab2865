"""Errors the daemon reports to callers, beyond ``ValueError`` (bad input)."""


class NotFoundError(LookupError):
    """An unknown session, request or pin."""


class CapacityError(Exception):
    """A request for more than a configured cap allows (e.g. pinned blocks)."""


class PreconditionError(Exception):
    """The operation does not fit the daemon's current state."""
