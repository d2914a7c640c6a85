"""Layer tools: minimize, the lookup choice, the explain text. Imports the
engine, the what-if, the sources and below (docs/architecture.md)."""
