"""An executor plugin that wraps another executor and logs every collective_rpc."""

from enginecore_echo_executor.executor import EchoExecutor, RpcRecord

__all__ = ["EchoExecutor", "RpcRecord"]
