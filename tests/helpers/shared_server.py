"""One ``enginecore serve`` that several test modules send requests to.

Started on first use; a module asking for it after a test killed it (or it died) gets a
fresh one, so a failing test cannot break the modules after it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.helpers.serve_process import serve, stop

#: The server/ folder's ``compat_server``: its context length, and the new tokens its
#: checkpoint's generation_config.json recommends.
COMPAT_MAX_MODEL_LEN = 512
COMPAT_MAX_NEW_TOKENS = 7
#: The server/ folder's ``surface_server``: its first served model name, and its alias.
SURFACE_NAME, SURFACE_ALIAS = "primary", "alias"
#: The server/ folder's ``guarded_server``: its prompt-token limit per request, and the
#: requests it admits at once before it answers 503.
GUARDED_MAX_PROMPT_TOKENS = 4000
GUARDED_MAX_PENDING = 4


class SharedServer:
    def __init__(
        self, model: Path | str, log_dir: Path, flags: list[str], env: dict[str, str]
    ) -> None:
        self.model = model
        self.log_dir = log_dir
        self.flags = flags
        self.env = env
        self.proc: subprocess.Popen | None = None
        self._url = ""
        self._starts = 0

    @property
    def log_path(self) -> Path:
        """The log of the running server (each start writes its own)."""
        return self.log_dir / f"server-{self._starts}.log"

    def url(self) -> str:
        """The running server's URL, started (again) if it is not running."""
        if self.proc is None or self.proc.poll() is not None:
            self._starts += 1
            self.proc, self._url = serve(self.model, self.log_path, *self.flags, env=self.env)
        return self._url

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop(self.proc)
