"""The step loop's parts and the request records: scheduling, launching, finishing."""
