"""fleet wire contract: generated protobuf/gRPC stubs (see scripts/gen_proto.py)."""
