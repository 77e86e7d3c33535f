"""Package and plugin-API versions."""

__version__ = "0.1.0"

# Semver of the plugin contract (hookspecs.py + interfaces.py). Major: a breaking change
# to a hook or ABC; minor: something added.
PLUGIN_API_VERSION = "1.9.0"
