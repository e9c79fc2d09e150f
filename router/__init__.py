"""The router: gRPC + HTTP front ends, KV-aware placement, Redis prefix index (no torch)."""
