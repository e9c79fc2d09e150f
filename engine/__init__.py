"""kvrelay engine: model runtime shared by the prefill and decode pools (no Ray, gRPC or Redis)."""
