"""Attention backends: plan once per step from AttentionMetadata, then forward per layer."""
