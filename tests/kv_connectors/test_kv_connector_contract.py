"""The built-in KV connectors pass the conformance kit's KVConnectorContract."""

from __future__ import annotations

from enginecore.testing import KVConnectorContract
from enginecore.testing.kv_connector_contract import free_port


class TestSharedStorageContract(KVConnectorContract):
    connector = "shared_storage"

    def producer_kv_transfer(self, tmp_path):
        return {"connector": "shared_storage", "extra_config": {"path": str(tmp_path / "kv")}}


class TestZmqP2PContract(KVConnectorContract):
    connector = "zmq_p2p"
    producer_finishes_alone = False  # it holds the blocks until the consumer pulls them
    port = free_port()

    def producer_kv_transfer(self, tmp_path):
        return {"connector": "zmq_p2p", "role": "kv_producer", "extra_config": {"port": self.port}}

    def consumer_kv_transfer(self, tmp_path):
        return {
            "connector": "zmq_p2p",
            "role": "kv_consumer",
            "extra_config": {"peers": [f"127.0.0.1:{self.port}"]},
        }

    def producer_request_params(self):
        return {"do_remote_decode": True}
