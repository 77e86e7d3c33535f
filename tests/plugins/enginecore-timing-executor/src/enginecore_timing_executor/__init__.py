"""An executor that times every collective_rpc, written from docs/plugins.md."""
