"""What start-up is doing, said on stderr while the engine starts (loading weights,
building kernels, sizing the KV cache), even at the default WARNING log level: the first
start of a model can take a minute and used to print nothing.

``ENGINECORE_STARTUP_LOG=0`` silences it; ``ENGINECORE_LOG_LEVEL`` above INFO does too.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

logger = logging.getLogger("enginecore.startup")
T = TypeVar("T")


def enable() -> None:
    """Let start-up lines through in this process (called where a process sets up its
    logging)."""
    off = os.environ.get("ENGINECORE_STARTUP_LOG", "1").strip().lower() in ("0", "false", "no")
    level = logging.getLevelName(os.environ.get("ENGINECORE_LOG_LEVEL", "").upper())
    quieter = isinstance(level, int) and level > logging.INFO
    logger.setLevel(logging.WARNING if off or quieter else logging.INFO)


def progress_bar(total: int, what: str, unit: str = " tensors") -> Any:
    """A progress bar (``tqdm``: ``update()``, a context manager) on stderr where the
    start-up lines show: a large checkpoint's tensors take minutes to read."""
    from tqdm import tqdm

    quiet = not logger.isEnabledFor(logging.INFO)
    return tqdm(total=total, desc=what, unit=unit, file=sys.stderr, disable=quiet)


def progress(items: Iterable[T], total: int, what: str, unit: str = " tensors") -> Iterator[T]:
    """``items``, counted on a :func:`progress_bar`."""
    with progress_bar(total, what, unit) as bar:
        for item in items:
            yield item
            bar.update()
