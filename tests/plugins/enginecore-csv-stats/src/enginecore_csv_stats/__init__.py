"""A CSV stat logger, written from docs/plugins.md."""
