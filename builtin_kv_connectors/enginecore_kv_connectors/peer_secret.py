"""The secret two KV connector instances on one machine share without being configured.

Between peers, authentication is on whenever the transport is TCP. Instances on other
hosts must be given the same secret; instances on this machine's loopback find a
generated one in an owner-only file, so every process of the same user derives the same
keys and a process of any other local user cannot read them (and gets nothing through
the sockets). ``$ENGINECORE_KV_SECRET_FILE`` names another file.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from enginecore.errors import ConfigError

SECRET_FILE_ENV = "ENGINECORE_KV_SECRET_FILE"


def secret_file() -> Path:
    configured = os.environ.get(SECRET_FILE_ENV)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "enginecore" / "kv_connector.secret"


def local_secret() -> str:
    """The user's generated loopback secret, created (0600, atomically) on first use."""
    path = secret_file()
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not path.exists():
            staged = path.with_name(f".{path.name}.{os.getpid()}")
            fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
            try:
                os.link(staged, path)  # fails if another instance won the race: use theirs
            except FileExistsError:
                pass
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(staged)
        info = path.stat()
        if info.st_uid != os.getuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(
                f"{path}: the KV connector's secret file must belong to this user and be "
                "readable by no one else (chmod 600); or configure 'secret'"
            )
        secret = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"the KV connector's loopback secret ({path}) cannot be read or created ({exc}); "
            f"set ${SECRET_FILE_ENV} to a writable path, or configure 'secret'"
        ) from None
    if len(secret) < 32:
        raise ConfigError(f"{path}: the KV connector's secret file holds no usable secret")
    return secret
