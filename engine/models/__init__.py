"""Model definitions: forward over packed tokens with an attention backend."""
