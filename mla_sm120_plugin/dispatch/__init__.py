"""What makes the kernels a plugin: the layer between the pure kernels and the decision layer.

- :mod:`.catalog`: the built-in kernels' specs, registered through the ``mla_sm120_kernels`` hook
  like any third-party plugin's (envelopes, probes, tolerances, precision classes);
- :mod:`.binding`: a registered kernel name turned into a callable, the one path for the public
  entry and the engines;
- :mod:`.forward`: the public ``sparse_mla_forward(kernel="auto")``, which validates every input once;
- :mod:`.flashinfer` and :mod:`.flashinfer_table`: FlashInfer's native SM120/SM121 kernel bound to
  the plugin's contract, and its envelope packaged per FlashInfer version
  (``flashinfer_envelope.json``); :mod:`.flashinfer_dsv4`: its DeepSeek-V4 kernels' envelope and probe;
- :mod:`.dsv4`: the plugin's DeepSeek-V4 kernels on FlashInfer's SM120 call surface (the engines' call);
- :mod:`.selfcheck`: each bound kernel proven against float64 at engine init, one runner for every
  family, with a case module per family (:mod:`.selfcheck_dsa`, :mod:`.selfcheck_dsv4`, named by the
  family's ``selfcheck_case``);
- :mod:`.bound`: a decision bound for an engine (verified, bound, logged once): the one service every
  engine binding calls;
- :mod:`.dcp`: a decode-context-parallel rank's share of a call (the one sink rule, the LSE in the
  base the engine's merge reads), the one home both engines' adapters call.

Imports point down only: these modules import :mod:`mla_sm120_plugin.kernels`, never the reverse.
Importing this package imports nothing heavy.
"""
