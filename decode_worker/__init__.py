"""Decode pool: a Ray actor that pulls prefilled KV over NIXL and batches decodes continuously."""
