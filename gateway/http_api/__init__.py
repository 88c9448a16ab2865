"""The gateway's HTTP API (OpenAI-compatible, and kvd's templates), served beside the gRPC one.

Every route calls the gateway's request path (``gateway.request_path``)
in-process, on a worker thread: the same tenants, keys, templates, routing,
limits and checks as the gRPC API, and no second hop. ``server`` runs it
(uvicorn, in a thread of the gateway process) and ``app`` assembles it.

One module of routes per API surface: ``openai_completions`` (with its
bodies, ``openai_schemas``, its replies, ``openai_translate``, and a
request's several prompts, ``prompt_batch``), ``models``,
``tokenize_routes`` (vLLM's ``/tokenize``, ``/detokenize``),
``templates_routes`` and ``server_routes`` (``/version``, ``/metrics``,
counted by ``metrics``). A new surface (Anthropic's Messages,
say) is one more such module, listed in ``app.SURFACES``. What they share:
``common`` (the app's state, the caller's key, calls on worker threads, the
open-generation count, a stream that starts once its first message came),
``threads`` (the worker threads and each request's ``HttpCall``) and
``errors`` (every error in OpenAI's shape, its field as ``param``).
"""
