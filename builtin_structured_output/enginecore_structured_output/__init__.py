"""Built-in structured-output backends (xgrammar), registered through the public hook."""
