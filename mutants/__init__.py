"""Mutants of vLLM's lookup path, applied at import time, and the kill
matrix of the regression corpus against them (``make mutants``)."""
