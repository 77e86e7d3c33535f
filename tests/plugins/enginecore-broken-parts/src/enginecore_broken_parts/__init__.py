"""Broken components, one per way a plugin can fail, beside one that works."""
