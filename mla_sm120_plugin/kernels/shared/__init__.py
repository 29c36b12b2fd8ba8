"""What both kernel families use (:mod:`..dsa` and :mod:`..dsv4`), beside them rather than in either.

- :mod:`.host`: pure-Python helpers (``cdiv``, ``interpreting``, the ``LOG2E`` / ``LN2`` constants);
  importing it costs nothing, so the pure launch planner can use it.
- :mod:`.triton`: the Triton parts: :class:`~.triton.Launch` (one kernel launch, what a kernel runs
  and the compile gate compiles) and the ``@triton.jit`` helpers for bf16 rounding, dots, rounded
  stores and the e2m1 / e8m0 decoders.
- :mod:`.formats`: the number formats in torch (e2m1 codes and values, e4m3 with saturation).
- :mod:`.combine`: the one combine of split partials (and :func:`~.combine.finalize`, the store an
  unsplit program ends in too: the sink once, the rounded output, the LSE).
- :mod:`.launch_plan`: the launch-plan rule every split count comes from, the GPU families it is
  evaluated for and the traffic record (pure Python).

Importing this package imports neither torch nor triton.
"""
