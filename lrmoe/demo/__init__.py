"""The ``lrmoe demo`` main job: a tiny byte-level MoE language model trained dense and with selective backward.

data:  the corpus (Python stdlib sources or a user text file) and a seeded batch sampler.
model: a decoder-only transformer whose feed-forward layers are :class:`lrmoe.nn.LRMoE`.
train: a torchtitan-style training loop returning a summary and per-step history.
cli:   the ``demo`` subcommand of ``python -m lrmoe``.
"""
