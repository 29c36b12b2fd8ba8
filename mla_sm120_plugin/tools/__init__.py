"""Tools that prove and measure the kernels, above them and the dispatch layer.

- :mod:`.compile_gate`: every Triton variant the dispatcher can launch, compiled for sm_120a /
  sm_121a / sm_90a without a GPU and read from the cubin (registers, spills, CTAs per SM, MMA kinds);
- :mod:`.bench`: ``mla-sm120 bench``: timings on this device, the traffic model and the gate;
- :mod:`.bench_dsv4`: ``mla-sm120 bench --dsv4``: the DeepSeek-V4 kernels' timings on this device;
- :mod:`.accuracy_cases`: the accuracy regimes the tests and ``benchmarks/kernel_accuracy.py`` share.
"""
