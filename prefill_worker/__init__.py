"""Prefill pool: a Ray actor running the engine in prefill role, holding KV under leases."""
