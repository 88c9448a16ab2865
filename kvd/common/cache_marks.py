"""The one check of a request's cache marks (``kvd.daemon.v1.CacheMarks``).

The daemon refuses a Step with bad marks whole, so the engine checks them
when a request arrives (INVALID_ARGUMENT for that request alone), with the
same function the daemon uses: the two can never disagree.
"""

from __future__ import annotations

from kvd.common.field_error import FieldError
from kvd_api.daemon.v1 import daemon_pb2 as dpb

#: Anthropic's limit, kept: more breakpoints would pin more of the pool per request.
MAX_MARKS = 4
#: The longest a mark may keep its prefix (a week): pins must end.
MAX_TTL_S = 7 * 24 * 3600


def check_marks(marks: dpb.CacheMarks, num_prompt_tokens: int) -> None:
    """Raises FieldError (naming ``marks[i].…``, ``owner_max_blocks``) for marks
    the daemon cannot honour as given."""
    if len(marks.marks) > MAX_MARKS:
        raise FieldError("marks", f"marks: at most {MAX_MARKS} cache marks, got {len(marks.marks)}")
    if marks.owner_max_blocks < 0:
        raise FieldError("owner_max_blocks", f"owner_max_blocks must be >= 0, got {marks.owner_max_blocks}")
    previous = 0
    for i, mark in enumerate(marks.marks):
        if not previous < mark.num_tokens <= num_prompt_tokens:
            raise FieldError(
                f"marks[{i}].num_tokens",
                f"marks[{i}].num_tokens must be in ({previous}, {num_prompt_tokens}] "
                f"(increasing, within the prompt), got {mark.num_tokens}",
            )
        if not 0 < mark.ttl_seconds <= MAX_TTL_S:
            raise FieldError(
                f"marks[{i}].ttl_seconds", f"marks[{i}].ttl_seconds must be in (0, {MAX_TTL_S}], got {mark.ttl_seconds}"
            )
        previous = mark.num_tokens
