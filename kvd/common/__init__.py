"""What the three processes share: the daemon's client and wire format, the KV-cache
memory mapping and layout, prompt hashing, the gRPC server scaffolding, settings,
logging and process supervision.

The daemon's own modules sit beside this package in ``kvd/``; ``inference/`` and
``gateway/`` import only from here (a test checks it).
"""
