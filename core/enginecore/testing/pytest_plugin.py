"""The module the ``pytest11`` entry point names: the kit's fixtures and its option.

A module of its own (not ``enginecore.testing`` itself) so that the entry point and an
explicit ``pytest -p enginecore.testing`` can both be active without pytest refusing one
module registered under two names; either provides the same fixtures.
"""

from enginecore.testing.fixtures import (  # noqa: F401  (pytest collects these)
    enginecore_config_overrides,
    enginecore_engine_process,
    enginecore_llm,
    enginecore_model,
    enginecore_server,
    pytest_addoption,
)
