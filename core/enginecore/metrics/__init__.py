"""Statistics plumbing for stat loggers: the per-request record (:mod:`.stats`), the
per-step stats the frontend builds (:mod:`.iteration`) and the fan-out to the selected
loggers (:mod:`.manager`).

The loggers themselves are plugins: the built-in ``logging`` and ``prometheus`` live in
``enginecore_stat_loggers`` and register through ``register_stat_loggers`` like
any third-party one; the config list ``observability.stat_loggers`` selects which run.
"""
