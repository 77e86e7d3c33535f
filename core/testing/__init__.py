"""The plugin conformance kit: contract test suites a plugin author subclasses.

Registered as a pytest plugin (``pytest11``), so the suites are importable from any test
module without configuration::

    from enginecore.testing import ExecutorContract
"""

from enginecore.testing.executor_contract import ExecutorContract
from enginecore.testing.spec_decode_contract import SpecDecodeProposerContract

__all__ = ["ExecutorContract", "SpecDecodeProposerContract"]
