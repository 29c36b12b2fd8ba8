"""The tests' helpers, one package (``tests/`` is on pytest's pythonpath: ``from support.oracle import ...``).

Torch-free (import without torch; tests/unit/test_support_imports.py holds them to it):

- :mod:`support.cli`: running ``mla-sm120`` as a user would (:func:`~support.cli.clean_env`,
  :func:`~support.cli.run_cli`), :func:`~support.cli.decision_of`, the three-part message check
  :func:`~support.cli.assert_three_parts`, the demo third-party plugins' names, a plugin config with one
  setting in several sections.
- :mod:`support.decisions`: the refusal ``mla-sm120 check`` prints, and a third-party kernel ``edge`` of
  the highest priority with a chosen envelope (the unit tests of selection, report, rules, hooks, the DCP plan).
- :mod:`support.model_configs`: tiny HF configs (no weights) of the models, written as a model directory.
- :mod:`support.internals_sites`: the engine internals an adapter's code touches, read from its source.
- :mod:`support.engine_sources`: the values an installed engine's source names, read without importing it.

With torch:

- :mod:`support.layout_oracle`: the independent reader of the cache bytes (``struct`` and integer
  arithmetic, never the package's code): every DSA layout, DeepSeek-V4's two records, the NVFP4 writers'
  formulas.
- :mod:`support.oracle`: the one float64 attention every kernel, dispatch, engine and DCP test checks
  against: :func:`~support.oracle.sparse_attention` over dequantized rows (optional sink, the LSE in a
  stated base, the sink in it or not) and DeepSeek-V4's two-cache call, :func:`~support.oracle.dsv4_sparse_attention`.
- :mod:`support.kernel_checks`: the test device, kernel-vs-reference tolerances, a tensor against an
  unreadable page, FlashInfer's refusal on this machine, an allocation counter.
- :mod:`support.kernel_cases`: random caches in any DSA layout with candidates and q (the ``make_case``
  fixture).
- :mod:`support.faulty_lse_kernels`: third-party kernels whose LSE is wrong in one way each (registered by
  tests/dispatch/test_selfcheck_dcp.py under ``support.faulty_lse_kernels:<name>``).
- :mod:`support.dcp`: the DCP tests' skeleton, both engines': the case's fields, the rows rank 0 owns all or
  none of, each rank's partial and the merged output expected (the oracle, the sink in the LSE), ``world``
  gloo ranks spawned on the CPU.

With an engine:

- :mod:`support.vllm_engine`: vLLM's GPU start-up reproduced on the CPU with its own objects.
- :mod:`support.sglang_launch`: SGLang's launcher passes for a model directory.
- :mod:`support.vllm_dcp`, :mod:`support.sglang_dcp`: one DCP rank of each engine on :mod:`support.dcp`'s
  skeleton: its cache placement, its problem's draws, its parallel state, its call and its merge.
"""
