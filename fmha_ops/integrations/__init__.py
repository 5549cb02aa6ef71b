"""Integrations with model libraries (imported on demand: each needs its library installed)."""
