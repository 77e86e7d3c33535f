"""A scripted model plugin for enginecore: replies with a marked span of its prompt."""
