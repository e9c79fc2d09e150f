"""kvrelay's benchmarks: each module here is a script run as `python -m bench.NAME`; no state."""
