"""Shortest-job-first scheduling policy for enginecore (an example plugin to copy)."""

from enginecore_sjf.policy import ShortestJobFirstPolicy

__version__ = "0.1.0"
__all__ = ["ShortestJobFirstPolicy", "__version__"]
