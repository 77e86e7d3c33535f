"""Built-in statistics: the per-request record and the ``logging`` and ``prometheus`` loggers.

Stat loggers are plugins like any other: :mod:`enginecore.metrics.plugin` registers the two
built-in ones through ``register_stat_loggers``; the config list
``observability.stat_loggers`` selects which run.
"""
