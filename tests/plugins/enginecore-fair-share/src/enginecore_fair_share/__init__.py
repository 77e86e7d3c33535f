"""A fair-share scheduling policy for enginecore, written from docs/plugins.md."""
