"""The engines behind the public API: :class:`~synkhronos.engines.base.Engine`, with one
implementation per way of running the ranks.

* :mod:`synkhronos.engines.ranks` -- the per-rank engine (CPU mode's default): every group rank
  computes its share with a program of its own; the master computes too and combines the replies.
* :mod:`synkhronos.engines.jax_engine` -- the JAX engine (GPU mode's default, and CPU emulation
  with ``SYNK_EMULATE_GPUS``): one program over every rank on JAX's multi-process runtime; the
  master computes nothing (its machinery: :mod:`synkhronos.engine`).

The public API (:mod:`synkhronos.function`, :mod:`synkhronos.chain`, :mod:`synkhronos.collectives`,
:mod:`synkhronos.forking`) checks its arguments, plans, and calls ``Runtime.driver``, the run's
engine; it never asks which one it is.
"""
