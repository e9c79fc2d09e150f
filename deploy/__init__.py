"""Operator entry points: the `kvrelay` command line."""
