"""Built-in stat loggers (``logging``, ``prometheus``), registered through the public hook.

They implement :class:`enginecore.interfaces.StatLogger` like any plugin's logger; the
config list ``observability.stat_loggers`` selects which run.
"""
