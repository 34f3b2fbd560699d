"""The balancer's cost model fitted to the trainer's own step: ``neon-hpc costfit``.

``step``: the trainer's step timed and its memory measured (one rank, this machine's device);
``standin``: a plain-torch stand-in of the model's shape (``--stand-in``, the benchmarks);
``fit``: measure a grid of micro-batches with either, fit the cost model, check it; ``cli``: the
command, whose ``--out`` file ``balance.cost_file`` and ``plan.activation_file`` read.  The
balancer (``neon_hpc/balance/``) only reads the fitted figures: lengths in, assignment out.
"""
