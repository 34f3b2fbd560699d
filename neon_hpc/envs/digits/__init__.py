"""The digits environment (add two digits, no tools): ``entry.py`` registers it, ``plugin.py`` is it.
This ``__init__`` imports nothing, so reading the entry stays light."""
