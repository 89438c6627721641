"""Analysis of tracked runs: pure screen statistics and the report."""
