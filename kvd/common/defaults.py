"""Defaults more than one process takes: each written once, here.

A value that two processes must agree on (the engine's address, which the
gateway calls and ``kvd-serve`` passes on) or that one process sets for
another until it says otherwise (the daemon's session limits until the engine
sends its own) would drift if each wrote it out.
"""

from __future__ import annotations

#: Tokens computed in one step: the engine's ``--token-budget``, and a daemon
#: session's until its engine sends its own.
TOKEN_BUDGET = 512

#: Sequences running at once: the engine's ``--max-num-seqs``, and a daemon
#: session's until its engine sends its own.
MAX_NUM_SEQS = 64

#: The engine's gRPC address: where it listens, where the gateway calls it,
#: the first one ``kvd-serve`` starts.
ENGINE_ADDRESS = "127.0.0.1:50052"

#: The gateway's gRPC address: where it listens, where ``kvd-cli`` calls it,
#: the one ``kvd-serve`` starts.
GATEWAY_ADDRESS = "127.0.0.1:50051"
