"""gateway: the public gRPC API — generation, named prefix templates in Redis, tenants."""
