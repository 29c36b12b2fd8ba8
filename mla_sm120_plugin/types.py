"""Frozen dataclasses passed between the plugin's parts.

Plugin-provided objects (:class:`ModelProfile` from ``mla_sm120_model_profiles``,
:class:`KernelSpec` from ``mla_sm120_kernels``) validate and normalise themselves in
``__post_init__``, so a broken third-party plugin fails where it is loaded, with its
own name in the message, not deep inside the selection.

Pure Python: importing this module imports nothing heavy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from .errors import PluginError, format_error
from .kernels.accuracy import EXACT_BAR, AccuracyBound
from .kernels import CACHE_LAYOUTS
from .kernels.dsa.layout import KV_LAYOUTS, KV_LORA_RANK, ROPE_DIM, SCALE_FORMATS

PREFILL = "prefill"
DECODE = "decode"
PHASES = (PREFILL, DECODE)
AUTO = "auto"

# How a kernel computes: "exact" multiplies bf16 (or fp32) operands, as the torch reference does up
# to rounding; "fast" quantizes q and the probabilities to fp8 e4m3 for fp8 MMAs (FlashInfer's SM120
# kernels, triton_sparse_mla_fast). The plugin config's ``precision`` sets the least a model accepts.
EXACT = "exact"
FAST = "fast"
PRECISIONS = (FAST, EXACT)

# Impl names other engines use (SGLang's --attention-backend choices, vLLM's backend names).
# A stale per-model config often carries one over; naming one is not a typo, so it gets the
# "cannot run here, these can" error rather than "unknown name".
ENGINE_NATIVE_IMPLS = (
    "flashmla_sparse",
    "flashmla_kv",
    "flashmla_auto",
    "fa3",
    "tilelang",
    "aiter",
    "trtllm",
    "flashinfer_mla_sparse",
    "flashinfer_mla_sparse_sm120",
)

VENDORS = ("nvidia", "amd", "cpu")

# The model family a profile or a context names when it names none: DSA, the one-latent-cache family
# every third-party profile written before there were families meant (mla_sm120_plugin.families holds the table).
DEFAULT_FAMILY = "dsa"
# A key no config.json has: a built-in model config (ModelProfile.model_configs) that lists each
# layer kind once because the model's per-layer list is in its own config.json only.
LAYER_COUNTS_UNKNOWN = "_mla_sm120_layer_counts_unknown"

# Where a device comes from when it is the one the decision runs on: found on this machine, or
# reported by the engine that is starting. Any other source (--sm, MLA_SM120_DEVICE) plans ahead.
PRESENT_SOURCES = ("detected", "vllm", "sglang")

_NAME_RE = re.compile(r"^[a-z][a-z0-9_.\-]*$")
_CONFIG_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.\-]*(/[a-z0-9][a-z0-9_.\-]*)?$")  # a name or an HF repo id


def _frozenset_of_str(value: object, what: str, owner: str) -> frozenset[str]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise PluginError(
            format_error(
                f"{owner}.{what}={value!r}",
                "an iterable of strings (a set, tuple or list)",
                f"pass {what}=({value!r},) rather than a bare value",
            )
        )
    items = frozenset(value)
    bad = sorted(repr(v) for v in items if not isinstance(v, str))
    if bad:
        raise PluginError(
            format_error(f"{owner}.{what} contains {', '.join(bad)}", "strings only", f"fix {what}")
        )
    return items


@dataclass(frozen=True)
class DeviceInfo:
    """The GPU (or CPU) a decision is made for.

    :param vendor: ``"nvidia"``, ``"amd"`` or ``"cpu"``.
    :param sm_major: CUDA compute capability major (12 for SM120 and SM121); None off NVIDIA.
    :param sm_minor: compute capability minor.
    :param cuda_version: the CUDA toolkit/runtime version string where known.
    :param name: a human name (``"NVIDIA GeForce RTX 5090"``, ``"planned sm_121"``).
    :param source: where this came from: ``"detected"``, ``"MLA_SM120_DEVICE"``, ``"--sm"``,
        ``"vllm"``, ``"sglang"``. Anything but those in :data:`PRESENT_SOURCES` is a *planned* device: hardware probes
        are not run for it, because this machine is not the one being planned for.
    """

    vendor: str
    sm_major: int | None = None
    sm_minor: int | None = None
    cuda_version: str | None = None
    name: str = ""
    source: str = "detected"

    def __post_init__(self) -> None:
        if self.vendor not in VENDORS:
            raise ValueError(
                format_error(f"vendor={self.vendor!r}", f"one of {VENDORS}", "pick a listed vendor")
            )
        if self.vendor == "nvidia" and (self.sm_major is None or self.sm_minor is None):
            raise ValueError(
                format_error(
                    "an NVIDIA device without sm_major/sm_minor",
                    "both set (e.g. 12, 0)",
                    "pass the compute capability",
                )
            )

    @property
    def sm_family(self) -> int | None:
        """The SM family: the major version, so SM121 counts as part of SM12x."""
        return self.sm_major if self.vendor == "nvidia" else None

    @property
    def sm(self) -> str:
        """``"12.0"``-style capability, or the vendor name off NVIDIA."""
        if self.vendor != "nvidia":
            return "rocm" if self.vendor == "amd" else "cpu"
        return f"{self.sm_major}.{self.sm_minor}"

    @property
    def is_gpu(self) -> bool:
        return self.vendor in ("nvidia", "amd")

    @property
    def is_planned(self) -> bool:
        """True when this device was named by the user rather than found on this machine."""
        return self.source not in PRESENT_SOURCES

    @property
    def label(self) -> str:
        """``"sm_120"``-style name, or ``"cpu"`` / ``"rocm"``."""
        return f"sm_{self.sm_major}{self.sm_minor}" if self.vendor == "nvidia" else self.sm

    def describe(self) -> str:
        """The label with the device's name, unless the name only repeats that it is planned."""
        name = f" {self.name}" if self.name and not (self.is_planned and self.name == "planned") else ""
        return f"{self.label}{name}"


@dataclass(frozen=True)
class ModelProfile:
    """What a DeepSeek-Sparse-Attention model needs; yielded by ``mla_sm120_model_profiles``.

    :param name: short name the CLI accepts (``"glm-5"``); lower case.
    :param architectures: HF ``architectures[0]`` values served by this profile, the base model
        first, MTP/NextN variants after it.
    :param model_type: HF ``model_type``.
    :param num_heads: attention heads before tensor parallelism.
    :param kv_lora_rank: latent width (512 for every known DSA model).
    :param qk_rope_head_dim: RoPE width (64; 0 for the rope-less GLM-5.3-Flash).
    :param index_topk: the indexer's top-k.
    :param index_kpool: indexer keys pooled per top-k pick (GLM-5.3-Flash: 4); the engines expand the
        picks to token slots plus a tail, so the ids a kernel gets are wider than ``index_topk``.
    :param kv_scale_format: ``"pow2"`` or ``"arbitrary"``: how the model writes fp8 scales.
    :param aliases: other names the CLI accepts (HF repo ids).
    :param family: the model family's name, a key of :data:`mla_sm120_plugin.families.FAMILIES` (its
        table says what each family is; ``"dsa"``, one latent cache and top-k slots, by default); the
        plugin manager refuses a name no family has.
    :param sinks: the model's attention carries a learned sink logit per head (HY V4's
        ``learnable_sink``): only a kernel that applies sinks (:attr:`KernelSpec.sinks`) serves it.
    :param model_configs: named model configs (a model's name -> the config.json keys that differ from
        the architecture's defaults) that the CLI accepts as ``--model``: several models can share one
        architecture (a Flash and a Pro size), and each is read by the same config reader as a
        config.json on disk.
    """

    name: str
    architectures: tuple[str, ...]
    model_type: str
    num_heads: int
    index_topk: int
    kv_scale_format: str
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    aliases: tuple[str, ...] = ()
    index_kpool: int = 1
    family: str = DEFAULT_FAMILY
    model_configs: Mapping[str, Mapping[str, object]] = field(default_factory=dict, compare=False)
    sinks: bool = False

    def __post_init__(self) -> None:
        owner = f"ModelProfile({self.name!r})"
        bad = (["<not a mapping>"] if not isinstance(self.model_configs, Mapping) else
               [repr(k) for k, v in self.model_configs.items()
                if not (isinstance(k, str) and _CONFIG_NAME_RE.match(k) and isinstance(v, Mapping))])
        if bad:
            raise PluginError(format_error(f"{owner}.model_configs entries {', '.join(bad[:5])}",
                                           "lower-case names (HF repo ids allowed) -> config.json-like mappings",
                                           "fix model_configs"))
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise PluginError(
                format_error(f"name={self.name!r}", "lower-case [a-z0-9_.-], starting with a letter", "rename the profile")
            )
        if not isinstance(self.sinks, bool):
            raise PluginError(format_error(f"{owner}.sinks={self.sinks!r}", "True or False",
                                           "say True for a model whose attention has learned per-head sinks"))
        _frozenset_of_str(self.architectures, "architectures", owner)  # type check only
        # Keep the given order (the first is the base model), dropping repeats.
        object.__setattr__(self, "architectures", tuple(dict.fromkeys(self.architectures)))
        if not self.architectures:
            raise PluginError(format_error(f"{owner}.architectures empty", "at least one HF architecture", "list them"))
        object.__setattr__(self, "aliases", tuple(_frozenset_of_str(self.aliases, "aliases", owner)))
        for attr, least in (("num_heads", 1), ("index_topk", 1), ("kv_lora_rank", 1), ("qk_rope_head_dim", 0),
                            ("index_kpool", 1)):
            value = getattr(self, attr)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise PluginError(format_error(f"{owner}.{attr}={value!r}", f"an int >= {least}", f"fix {attr}"))
        if self.kv_scale_format not in SCALE_FORMATS:
            raise PluginError(
                format_error(f"{owner}.kv_scale_format={self.kv_scale_format!r}", f"one of {SCALE_FORMATS}", "fix it")
            )


Probe = Callable[[DeviceInfo], Iterable[str]]
"""A kernel's probe: reasons it cannot run on this device (empty: it can)."""

Envelope = Callable[["SelectionContext", str, "ModelProfile | None"], Iterable[str]]
"""A kernel's dynamic envelope check for one phase: reasons the shape is outside it.

Called with the context (``kv_scale_format`` already resolved), the phase and the matched
model profile (None when deciding for a bare tensor shape)."""


@dataclass(frozen=True)
class KernelSpec:
    """What a sparse-MLA kernel covers; yielded by ``mla_sm120_kernels``.

    The static fields are the envelope the selection checks as data; ``envelope`` adds checks
    that need the kernel's own package (FlashInfer's table of calibrated shapes), ``probe`` says
    whether this machine can run it at all.

    :param name: unique kernel name (``"triton_sparse_mla"``), as users write it in config.
    :param phases: subset of ``{"prefill", "decode"}``.
    :param kv_cache_dtypes: KV layouts it reads (``"fp8_ds_mla"``, ``"bf16"``).
    :param vendors: device vendors it runs on (``"nvidia"``, ``"amd"``, ``"cpu"``).
    :param sm_families: NVIDIA SM majors it runs on; None for any.
    :param heads: inclusive (min, max) heads per rank.
    :param topk_min: smallest index top-k.
    :param topk_multiple: top-k must be a multiple of this.
    :param max_tokens: most query tokens one call takes; None for any.
    :param priority: higher wins under ``auto``.
    :param entry: ``"module:function"`` with the signature of
        :func:`mla_sm120_plugin.dispatch.forward.sparse_mla_forward` minus ``kernel``; imported only when bound.
    :param probe: reasons it cannot run on a device; run once per device and cached.
    :param envelope: extra per-phase shape checks.
    :param graph_safe: safe to capture in a CUDA graph (no host sync, no allocation).
    :param sinks: applies a per-head sink logit in both phases (the entry's ``sink=``, or ``sinks=``
        on a two-cache family's call surface); a model with sinks is served only by such kernels.
    :param returns_lse: the entry returns the softmax LSE with its output (``return_lse=True``,
        ``lse_base``); decode context parallelism merges the ranks' partial outputs by it, so only
        such kernels serve a context with ``decode_context_parallel_size > 1``.
    :param description: one line for tables.
    :param envelope_note: where ``envelope``'s facts come from when they are not the installed
        package's (a table shipped with the plugin for a package missing here); the decision
        carries it as a note, so a core-only install says which facts it used.
    :param precision: the kernel's accuracy class: ``"exact"`` (within FlashMLA's bar against
        float64 over the dequantized rows: cos_diff <= 5e-6 and relRMS <= 0.3 %, whatever its
        operands: bf16, fp32 or fp8 hi + lo pairs) or ``"fast"`` (a single fp8 q and probability:
        a few % relRMS); a context asking ``precision="exact"`` rejects fast kernels.
    :param tolerance: the largest difference from the torch reference the kernel promises, as a
        fraction of the reference output's largest magnitude (the self-check's bound for a kernel
        that states no ``accuracy``).
    :param accuracy: what the kernel promises in FlashMLA's metrics
        (:class:`~mla_sm120_plugin.kernels.accuracy.AccuracyBound`: cos_diff, relRMS and max error
        against float64 over the dequantized rows); the self-check at engine init
        (:mod:`mla_sm120_plugin.dispatch.selfcheck`) holds the kernel to it. An ``"exact"`` kernel
        that states one must state one of exact class.
    """

    name: str
    phases: frozenset[str]
    kv_cache_dtypes: frozenset[str]
    vendors: frozenset[str]
    entry: str
    priority: int
    sm_families: frozenset[int] | None = None
    heads: tuple[int, int] = (1, 128)
    topk_min: int = 1
    topk_multiple: int = 1
    max_tokens: int | None = None
    probe: Probe | None = field(default=None, compare=False)
    envelope: Envelope | None = field(default=None, compare=False)
    graph_safe: bool = True
    description: str = ""
    tolerance: float = 1e-2
    envelope_note: Callable[[], "str | None"] | None = field(default=None, compare=False)
    precision: str = EXACT
    accuracy: AccuracyBound | None = None
    sinks: bool = False
    returns_lse: bool = False

    def __post_init__(self) -> None:
        owner = f"KernelSpec({self.name!r})"
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise PluginError(
                format_error(f"name={self.name!r}", "lower-case [a-z0-9_.-], starting with a letter", "rename the kernel")
            )
        for attr, allowed in (("phases", PHASES), ("kv_cache_dtypes", CACHE_LAYOUTS),
                              ("vendors", VENDORS)):
            items = _frozenset_of_str(getattr(self, attr), attr, owner)
            unknown = sorted(items - set(allowed))
            if unknown or not items:
                raise PluginError(
                    format_error(f"{owner}.{attr}={sorted(items)}", f"a non-empty subset of {list(allowed)}", f"fix {attr}")
                )
            object.__setattr__(self, attr, items)
        if self.sm_families is not None:
            fams = frozenset(self.sm_families)
            if not all(isinstance(f, int) and f > 0 for f in fams):
                raise PluginError(format_error(f"{owner}.sm_families={self.sm_families!r}", "positive ints or None", "fix it"))
            object.__setattr__(self, "sm_families", fams)
        lo, hi = self.heads
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise PluginError(format_error(f"{owner}.heads={self.heads!r}", "(min, max) with 1 <= min <= max", "fix heads"))
        for attr in ("topk_min", "topk_multiple", "priority"):
            if not isinstance(getattr(self, attr), int):
                raise PluginError(format_error(f"{owner}.{attr}={getattr(self, attr)!r}", "an int", f"fix {attr}"))
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise PluginError(format_error(f"{owner}.max_tokens={self.max_tokens!r}", "a positive int or None", "fix it"))
        if not isinstance(self.entry, str) or self.entry.count(":") != 1:
            raise PluginError(format_error(f"{owner}.entry={self.entry!r}", "'package.module:function'", "fix entry"))
        for attr in ("probe", "envelope", "envelope_note"):
            if getattr(self, attr) is not None and not callable(getattr(self, attr)):
                raise PluginError(format_error(f"{owner}.{attr}={getattr(self, attr)!r}", "a callable or None", "fix it"))
        if self.precision not in PRECISIONS:
            raise PluginError(format_error(f"{owner}.precision={self.precision!r}", f"one of {list(PRECISIONS)}",
                                           "say 'fast' for a kernel that rounds q or p to fp8, else 'exact'"))
        if not isinstance(self.sinks, bool):
            raise PluginError(format_error(f"{owner}.sinks={self.sinks!r}", "True or False",
                                           "say True only if the entry applies a per-head sink logit"))
        tol = self.tolerance
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 < tol < 1:
            raise PluginError(format_error(f"{owner}.tolerance={tol!r}", "a float in (0, 1): a fraction of the "
                                           "reference output's magnitude", "state the kernel's accuracy, e.g. 1e-2"))
        if self.accuracy is not None and not isinstance(self.accuracy, AccuracyBound):
            raise PluginError(format_error(f"{owner}.accuracy={self.accuracy!r}", "an AccuracyBound or None",
                                           "state AccuracyBound(cos_diff=..., rel_rms=..., max_rel=...)"))
        if self.accuracy is not None and self.precision == EXACT and not self.accuracy.exact_class:
            raise PluginError(format_error(
                f"{owner}: precision='exact' with accuracy {self.accuracy.summary()}",
                f"an exact kernel's bound within {EXACT_BAR}",
                "say precision='fast', or state the exact-class bound the kernel meets"))


@dataclass(frozen=True)
class SelectionContext:
    """Everything the constraint matrix decides on, for one model on one device.

    :param model_arch: HF ``architectures[0]``.
    :param model_name: the served model's name or path (matched by per-model config).
    :param kv_cache_dtype: ``"fp8_ds_mla"``, ``"bf16"``, or what the engine was given.
    :param num_heads: query heads one attention call sees: heads per rank after tensor parallelism,
        times ``decode_context_parallel_size`` (the engine gathers the DCP group's heads for the call).
    :param index_topk: top-k ids a query token's index row holds when the kernels get it: the
        indexer's top-k, or for a pooled indexer (GLM-5.3-Flash) the engine's wider row of token
        ids (vLLM 2176, SGLang 2051).
    :param device: the device decided for.
    :param prefill_kernel: ``"auto"`` or a forced kernel name.
    :param decode_kernel: ``"auto"`` or a forced kernel name.
    :param kv_scale_format: ``"auto"``, ``"pow2"`` or ``"arbitrary"``.
    :param max_decode_tokens: most query tokens one decode call may see (batch x speculative).
    :param max_prefill_tokens: most query tokens one prefill call may see.
    :param cuda_graphs: the engine captures decode in CUDA graphs.
    :param forced_by: where a forced kernel came from, for messages (``"--decode-kernel"``).
    :param tensor_parallel_size: the engine's TP size (``num_heads`` is already divided by it).
    :param features: engine features switched on that change how the cache is written or top-k
        is read (``"hisparse"``, ``"pcp"``, ...); the built-in policy refuses those no kernel reads.
    :param engine: the engine decided for (a key of :data:`mla_sm120_plugin.engines.ENGINES`):
        whose flags and spellings messages use.
    :param kv_cache_dtype_given: the ``--kv-cache-dtype`` value as the user wrote it for that
        engine (``kv_cache_dtype`` is the layout it means); None when the engine default applied.
    :param kv_lora_rank: the model's latent width (its config's ``kv_lora_rank``).
    :param qk_rope_head_dim: the model's RoPE width (its config's ``qk_rope_head_dim``).
    :param precision: ``"fast"`` (every kernel may serve, fp8 MMAs included) or ``"exact"`` (only
        kernels that keep bf16/fp32 operands).
    :param sinks: the model's attention carries a learned sink logit per head (HY V4).
    :param family: the model family decided for (a key of :data:`mla_sm120_plugin.families.FAMILIES`):
        which kernels are candidates and which rules apply.
    :param call: the layer kind's call as the family shapes it (a family with several call shapes gives
        its own call object, one context per layer kind: :attr:`Family.has_call`); None for a family with
        one call shape.
    :param release: the engine's release (a key of :data:`mla_sm120_plugin.engines.RELEASES` under
        ``engine``); None: its oldest supported one.
    :param decode_context_parallel_size: ranks the cache is sharded over by token (decode context
        parallelism); each call sees one rank's shard and returns its LSE for the engine's merge.
    :param cp_kv_cache_interleave_size: consecutive tokens a rank owns before the next rank's under DCP
        (vLLM's ``--cp-kv-cache-interleave-size``).
    :param index_kpool: indexer keys pooled per top-k pick (GLM-5.3-Flash: 4; else 1).
    :param index_picks: picks the indexer ranks a row (its top-k over pooled keys: ``index_topk //
        index_kpool`` of the model's config); None: ``index_topk``.
    """

    model_arch: str
    kv_cache_dtype: str
    num_heads: int
    index_topk: int
    device: DeviceInfo
    model_name: str | None = None
    prefill_kernel: str = "auto"
    decode_kernel: str = "auto"
    kv_scale_format: str = "auto"
    max_decode_tokens: int | None = None
    max_prefill_tokens: int | None = None
    cuda_graphs: bool = False
    forced_by: str = "config"
    tensor_parallel_size: int = 1
    features: frozenset[str] = frozenset()
    engine: str = "vllm"
    kv_cache_dtype_given: str | None = None
    kv_lora_rank: int = KV_LORA_RANK
    qk_rope_head_dim: int = ROPE_DIM
    precision: str = FAST
    sinks: bool = False
    family: str = DEFAULT_FAMILY
    call: Any = None
    release: str | None = None
    decode_context_parallel_size: int = 1
    cp_kv_cache_interleave_size: int = 1
    index_kpool: int = 1
    index_picks: int | None = None

    def kernel_for(self, phase: str) -> str:
        return self.prefill_kernel if phase == PREFILL else self.decode_kernel

    def max_tokens_for(self, phase: str) -> int | None:
        return self.max_prefill_tokens if phase == PREFILL else self.max_decode_tokens

    @property
    def heads_per_rank(self) -> int:
        """Query heads of one rank (``num_heads`` is what a call sees: the DCP group's, gathered)."""
        return self.num_heads // self.decode_context_parallel_size

    def heads_text(self) -> str:
        """The heads a call sees and where they come from, as messages name them."""
        dcp = self.decode_context_parallel_size
        if dcp == 1:
            return f"heads_per_rank={self.num_heads} (tp={self.tensor_parallel_size})"
        return (f"heads_per_call={self.num_heads} ({self.heads_per_rank} a rank x dcp={dcp}, "
                f"tp={self.tensor_parallel_size})")

    def describe(self) -> str:
        """The combination, as every selection error names it (the KV dtype as the user spelled it)."""
        given = self.kv_cache_dtype_given
        kv = self.kv_cache_dtype if given in (None, self.kv_cache_dtype) else f"{given} ({self.kv_cache_dtype} layout)"
        layer = "" if self.call is None else f", layer kind {self.call.kind}"
        return (
            f"model_arch={self.model_arch}{layer}, sm={self.device.sm}, kv_cache_dtype={kv}, "
            f"{self.heads_text()}, index_topk={self.index_topk}, "
            f"prefill_impl={self.prefill_kernel}, decode_impl={self.decode_kernel}"
        )


@dataclass(frozen=True)
class DcpService:
    """What a model family declares about decode context parallelism (its ``dcp`` attribute): whether its
    calls can be cut into ranks' shares that the engine merges by their LSE. A family that declares
    nothing is refused under DCP (:func:`mla_sm120_plugin.rules.dcp_refusals`).

    :param served: each rank's share is computed (by the one home, :mod:`mla_sm120_plugin.dispatch.dcp`).
    :param why_not: why not, in the refusal's words (required when not served).
    """

    served: bool
    why_not: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.served, bool) or (not self.served and not self.why_not):
            raise PluginError(format_error(f"DcpService(served={self.served!r}, why_not={self.why_not!r})",
                                           "served=True, or served=False with why_not saying why",
                                           "declare the family's decode context parallelism with a reason"))


@dataclass(frozen=True)
class Refusal:
    """A reason an ``mla_sm120_validate`` hook refuses a context (a plain string also works).

    :param reason: what about the context cannot be served.
    :param supported: what would be accepted instead.
    :param fix: what the user should change.
    """

    reason: str
    supported: str = ""
    fix: str = ""


@dataclass(frozen=True)
class Rejection:
    """A kernel not chosen for a phase, and every reason why."""

    kernel: str
    phase: str
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class Decision:
    """The outcome of :func:`mla_sm120_plugin.selection.select`: one kernel per phase (rendered by
    :mod:`mla_sm120_plugin.report`).

    :param context: what was decided for.
    :param profile: the model profile that matched ``context.model_arch``.
    :param kernels: phase -> kernel name.
    :param scale_format: the resolved fp8 scale format.
    :param rejections: every kernel not chosen, per phase, with its reasons.
    :param notes: things worth a log line that are not rejections (skipped probes).
    :param alternates: phase -> the other kernels that could serve it, best first (where the
        self-check falls back to when the chosen one fails on this machine).
    :param classes: phase -> the chosen kernel's accuracy class (``KernelSpec.precision``:
        ``"exact"`` or ``"fast"``).
    """

    context: SelectionContext
    profile: ModelProfile
    kernels: Mapping[str, str]
    scale_format: str
    rejections: tuple[Rejection, ...] = ()
    notes: tuple[str, ...] = ()
    alternates: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    classes: Mapping[str, str] = field(default_factory=dict)

    @property
    def prefill(self) -> str:
        return self.kernels[PREFILL]

    @property
    def decode(self) -> str:
        return self.kernels[DECODE]
