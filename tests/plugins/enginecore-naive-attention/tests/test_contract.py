"""The naive backend against enginecore's attention-backend contract."""

from enginecore.testing import AttentionBackendContract


class TestNaiveBackend(AttentionBackendContract):
    backend = "naive"
    dtypes = ("float32", "bfloat16")
