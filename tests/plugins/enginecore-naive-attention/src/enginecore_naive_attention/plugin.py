import enginecore

plugin_api_versions = ">=1.1,<2"


@enginecore.hookimpl
def register_attention_backends(registry):
    registry.add(
        "naive",
        "enginecore_naive_attention.backend:NaiveAttentionBackend",
        summary="request-by-request paged attention in plain torch",
    )
