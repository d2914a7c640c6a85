"""Polars analyses over a replay's results and its trace: flags, diffs, reports."""
