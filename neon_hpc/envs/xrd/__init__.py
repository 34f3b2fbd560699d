"""The XRD environment (powder X-ray diffraction): everything of it lives in this folder.

``entry.py`` registers it (entry point ``neon_hpc.envs: xrd``) and imports only its settings
(``config.py``: its ``env:`` section, ``kind: xrd``); ``plugin.py`` is the plugin (``PLUGIN``: task source,
episode adapter, demonstrations); ``science/`` is the phase analysis it is built on (library,
simulation, fitting, grader, tools, the dated system of record), which imports nothing of the
agent loop.  This ``__init__`` imports nothing, so reading the entry stays light.
"""
