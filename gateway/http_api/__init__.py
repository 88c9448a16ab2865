"""The gateway's OpenAI-compatible HTTP API, served beside the gRPC one.

Every route calls the gateway's own ``GatewayService`` in-process (through a
stand-in for the gRPC call context, ``calls.LocalCall``): the same tenants,
keys, templates, routing, limits and checks as the gRPC API, and no second
hop. ``server`` runs it (uvicorn, in a thread of the gateway process); the
other modules each hold one part: the call context and error statuses
(``calls``), the request bodies (``schemas``), requests and replies in
OpenAI's shapes (``translate``), the threads a stream runs on (``relay``) and
the routes (``completions``, ``templates_routes``, ``app``).
"""
