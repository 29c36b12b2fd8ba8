"""Pure sparse-MLA kernels and the bytes they read, one family per folder.

- :mod:`.dsa`: DeepSeek Sparse Attention over one paged latent cache (GLM-5, DeepSeek-V3.2, the
  rope-less GLM-5.3-Flash): cache layouts as data (:mod:`.dsa.layout`), packers and dequantization
  (:mod:`.dsa.pack`, :mod:`.dsa.nvfp4`), the torch reference (:mod:`.dsa.reference`), the Triton
  kernels (:mod:`.dsa.triton`, :mod:`.dsa.triton_fast`, their shared parts :mod:`.dsa.triton_parts`) and their
  launch plans (:mod:`.dsa.plan`).
- :mod:`.dsv4`: DeepSeek-V4 attention over two paged caches in one call (a sliding window and a
  compressed cache) with per-head sinks: the 584-byte record as data (:mod:`.dsv4.layout`), its
  packer and dequantization (:mod:`.dsv4.pack`), the torch reference (:mod:`.dsv4.reference`), the
  Triton kernel (:mod:`.dsv4.triton`), its launch plan (:mod:`.dsv4.plan`) and the NVFP4 record's
  writers (:mod:`.dsv4.nvfp4_writer`).
- :mod:`.shared`: what both families use, beside them (neither family imports the other): the
  launch record and the Triton numerics helpers (:mod:`.shared.triton`), the one combine of split
  partials (:mod:`.shared.combine`), the launch-plan rule (:mod:`.shared.launch_plan`), the number
  formats in torch (:mod:`.shared.formats`), pure host helpers (:mod:`.shared.host`). The DSA kernels' own shared
  parts are :mod:`.dsa.triton_parts`. :mod:`.accuracy`: the metrics every kernel is measured and
  bounded in (cos_diff, relRMS, max error against float64). Design notes and measurements: docs/kernels.md; the external
  facts the code relies on: docs/facts.md.

A module here knows nothing of the plugin: it imports no hook, registry, selection, config, engine
or integration module, and only :mod:`mla_sm120_plugin.errors` from outside this package
(``tests/unit/test_import_boundary.py`` pins it). What makes these kernels a plugin sits above
them: :mod:`mla_sm120_plugin.dispatch` (the catalog of built-in kernels, binding, the public
``sparse_mla_forward(kernel="auto")``, the FlashInfer binding and its envelope, the self-check) and
:mod:`mla_sm120_plugin.tools` (the compile gate and ``bench``).

Importing this package imports neither torch nor triton; each kernel module imports what it runs on.
"""

from .dsa.layout import KV_LAYOUTS as _ONE_CACHE_LAYOUTS
from .dsv4.layout import RECORDS as _TWO_CACHE_RECORDS

# Every cache layout (or record) a kernel here reads, over every folder: what a kernel spec may name.
CACHE_LAYOUTS: tuple[str, ...] = (*_ONE_CACHE_LAYOUTS, *_TWO_CACHE_RECORDS)
