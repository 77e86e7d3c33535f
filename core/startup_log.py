"""What start-up is doing, said on stderr while the engine starts (loading weights,
building kernels, sizing the KV cache), even at the default WARNING log level: the first
start of a model can take a minute and used to print nothing.

``ENGINECORE_STARTUP_LOG=0`` silences it; ``ENGINECORE_LOG_LEVEL`` above INFO does too.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("enginecore.startup")


def enable() -> None:
    """Let start-up lines through in this process (called where a process sets up its
    logging)."""
    off = os.environ.get("ENGINECORE_STARTUP_LOG", "1").strip().lower() in ("0", "false", "no")
    level = logging.getLevelName(os.environ.get("ENGINECORE_LOG_LEVEL", "").upper())
    quieter = isinstance(level, int) and level > logging.INFO
    logger.setLevel(logging.WARNING if off or quieter else logging.INFO)
