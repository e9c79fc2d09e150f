"""Speculative decoding: n-gram and draft-model drafting, verification, the cost guard."""
