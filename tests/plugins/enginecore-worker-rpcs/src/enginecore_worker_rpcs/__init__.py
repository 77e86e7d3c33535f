"""Worker RPCs for enginecore, written from docs/plugins.md."""
