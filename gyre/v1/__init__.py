"""Generated protobuf and gRPC stubs of proto/gyre/v1 (scripts/gen_proto.py). Do not edit."""
