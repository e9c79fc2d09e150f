"""Helpers shared by the bench scripts (clients, launchers, workloads, engine configs); no state."""
