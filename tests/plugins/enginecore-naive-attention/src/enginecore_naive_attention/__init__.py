"""A third-party attention backend for enginecore (see README.md)."""
