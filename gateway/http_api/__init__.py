"""The gateway's HTTP API (OpenAI-compatible, and kvd's templates), served beside the gRPC one.

Every route calls the gateway's request path (``gateway.request_path``)
in-process, on a worker thread: the same tenants, keys, templates, routing,
limits and checks as the gRPC API, and no second hop. ``server`` runs it
(uvicorn, in a thread of the gateway process) and ``app`` assembles it.

One module of routes per API surface: ``openai_completions`` (with its
bodies, ``openai_schemas``, and its replies, ``openai_translate``),
``models`` and ``templates_routes``. A new surface (Anthropic's Messages,
say) is one more such module, listed in ``app.SURFACES``. What they share:
``common`` (the app's state, the caller's key, calls on worker threads, the
open-generation count, a stream that starts once its first message came),
``threads`` (the worker threads and each request's ``HttpCall``) and
``errors`` (every error in OpenAI's shape, its field as ``param``).
"""
