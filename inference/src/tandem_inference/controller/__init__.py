"""The controller wing: it keeps the engine serving what Redis announces."""
