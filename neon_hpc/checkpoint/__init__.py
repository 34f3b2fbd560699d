"""The torch_dist checkpoint format neon-hpc's trainer writes and reshard (and the trainer's resume) reads.

``metadata``: ``.metadata`` through an allowlist unpickler and ``metadata.json``'s marker;
``integrity``: ``integrity.json`` (xxh3 per file and per blob), written and checked;
``configsource``: the model config a checkpoint carries (its ``config.json``, its run's ``run.yaml``).
See README.md beside this file.
"""
