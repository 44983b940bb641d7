"""gRPC service: the only package that imports generated protobuf code."""
