"""Quantized weights: checkpoint configs (config.py, int_config.py), Fp8Linear (fp8.py),
Int4Linear (int4.py), Int8Linear (int8.py)."""
