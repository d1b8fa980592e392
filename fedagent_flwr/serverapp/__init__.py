"""ServerApp, strategies and the run record."""
