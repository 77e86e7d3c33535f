"""Hook implementations only: the policy is registered as a lazy reference."""

import enginecore

plugin_api_versions = ">=1.0,<2"
plugin_settings = "enginecore_fair_share.policy:FairShareSettings"


@enginecore.hookimpl
def register_scheduling_policies(registry):
    registry.add(
        "tenant_cap",
        "enginecore_fair_share.policy:FairSharePolicy",
        summary="first come, first served, with at most N running requests per tenant",
    )
