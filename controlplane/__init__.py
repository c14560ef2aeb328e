"""The fleet controller: config, gRPC servers, store, detection, orchestration and CLI."""
