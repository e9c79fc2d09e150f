"""Paged KV cache: block hashing (torch-free), the block pool and the per-request manager."""
