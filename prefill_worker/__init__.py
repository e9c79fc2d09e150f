"""Prefill pool: a Ray actor whose engine computes prompts and keeps their blocks under leases."""
