"""`enginecore plugin new`: a complete, installable plugin package from a template."""
