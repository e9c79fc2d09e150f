"""Sampling and logits processing; the torch-free request rules (sampling_params, validation)."""
