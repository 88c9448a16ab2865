"""Generated gRPC/protobuf code for kvd's services. Regenerate with `make protos`."""
