"""FP8 weights: the checkpoint's quantization config (config.py), Fp8Linear (fp8.py)."""
