"""Parallel layouts: the single source of truth for how ranks are split.

A :class:`Layout` names the Megatron-Core parallel dimensions of one run:

* ``tp``  tensor parallel size
* ``pp``  pipeline parallel size
* ``vpp`` virtual pipeline stages (model chunks) per pp rank, or ``None`` for the
  non-interleaved schedule
* ``cp``  context parallel size
* ``ep``  expert parallel size
* ``etp`` expert tensor parallel size (the experts' own tp), or ``None`` for
  Megatron's default, the dense tp; an ``etp`` equal to ``tp`` is that default
* ``dp``  data parallel size
* ``sequence_parallel`` (``sp``) Megatron sequence parallelism, which lives
  inside the tp group

World size is ``tp * pp * cp * dp``.  ``ep`` and ``etp`` do *not* multiply it:
Megatron lays the experts over the same ``tp * cp * dp`` ranks of each pipeline
stage as ``etp * ep * expert-dp``, so ``etp * ep`` must divide ``tp * cp * dp``
(with the default ``etp = tp``: ``ep`` divides ``dp * cp``).

Text grammar (``parse_layout``), case-insensitive::

    layout := part (sep? part)*
    part   := dim SIZE | flag
    dim    := "tp" | "pp" | "vpp" | "cp" | "ep" | "etp" | "dp"
    SIZE   := positive decimal integer
    flag   := "sp" | "sequence_parallel" | "sequence-parallel"
    sep    := any run of "-", "_" or whitespace, optionally containing one "x"

so ``tp2pp2``, ``TP2_PP2``, ``tp2-dp2-sp``, ``tp2 x pp2`` and ``pp2vpp2`` all
parse.  Each dim and the flag may appear at most once; omitted dims are 1.

``,`` is deliberately *not* a within-layout separator: it separates layouts in
a list (``parse_layout_list("tp1,tp2,pp2")``), which is how layouts are passed on
command lines and in environment variables.

Canonical names (``Layout.name``) concatenate the non-1 dims in the order
tp, pp, vpp, cp, ep, etp, dp and append ``-sp`` for sequence parallelism, e.g.
``tp2pp2dp2``, ``pp2vpp2``, ``tp2dp2-sp``, ``tp2ep2etp1``; the all-ones layout is ``tp1``.
``parse_layout(layout.name) == layout`` for every valid layout.

Data parallelism is derived, never chosen, in Megatron
(``dp = world_size // (tp * pp * cp)``).  The harness mirrors that: ``dp == 1``
(the default, and what an omitted ``dp`` parses to) means "fill from the world
size" for :func:`resolve`, so ``"tp2"`` on 4 ranks resolves to ``tp2dp2``.  An
explicit ``dp > 1`` is kept and must match the world size exactly.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from itertools import product
from typing import Any, Iterable, Optional

__all__ = [
    "Layout",
    "LayoutError",
    "enumerate_layouts",
    "is_valid",
    "parse_layout",
    "parse_layout_list",
    "resolve",
    "validate",
]

# Order of dims in canonical names; vpp sits next to the pp it refines.
_NAME_ORDER = ("tp", "pp", "vpp", "cp", "ep", "etp", "dp")

GRAMMAR = (
    "accepted grammar: parts '<dim><size>' with dim one of tp|pp|vpp|cp|ep|etp|dp and "
    "size a positive integer, plus the flag sp|sequence_parallel; parts may be joined "
    "directly or by '-', '_', whitespace or 'x', case-insensitive "
    "(e.g. 'tp2pp2', 'TP2_DP2_SP', 'pp2vpp2'); ',' separates layouts in a list"
)


class LayoutError(ValueError):
    """A layout string, a Layout, or a layout/world/model combination is invalid."""


class _FieldError(LayoutError):
    """Layout fields contradict each other; keeps the bare problems so parse can re-word them."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("invalid Layout: " + "; ".join(problems))
        self.problems = problems


def _is_positive_int(value: Any) -> bool:
    # bool is an int subclass; True as a parallel size is always a bug.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class Layout:
    """One parallel layout; see the module docstring for semantics."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: Optional[int] = None
    sequence_parallel: bool = False
    etp: Optional[int] = None  # None: Megatron's default, tp

    def __post_init__(self) -> None:
        problems = self._field_problems()
        if problems:
            raise _FieldError(problems)
        if self.etp == self.tp:  # the default spelled out: one layout, one name
            object.__setattr__(self, "etp", None)

    @property
    def expert_tp(self) -> int:
        """The experts' tensor parallel size (etp, or tp by default)."""
        return self.tp if self.etp is None else self.etp

    def _field_problems(self) -> list[str]:
        problems = [
            f"{dim}={getattr(self, dim)!r} must be a positive integer"
            for dim in ("tp", "pp", "dp", "cp", "ep")
            if not _is_positive_int(getattr(self, dim))
        ]
        if self.etp is not None and not _is_positive_int(self.etp):
            problems.append(f"etp={self.etp!r} must be None or a positive integer")
        if self.vpp is not None:
            if not _is_positive_int(self.vpp):
                problems.append(f"vpp={self.vpp!r} must be None or a positive integer")
            # Same rule as initialize_model_parallel: interleaving needs >= 2 stages.
            elif not (_is_positive_int(self.pp) and self.pp >= 2):
                problems.append(f"vpp={self.vpp} requires pp >= 2 (interleaved schedule), got pp={self.pp}")
        if not isinstance(self.sequence_parallel, bool):
            problems.append(f"sequence_parallel={self.sequence_parallel!r} must be a bool")
        elif self.sequence_parallel and not (_is_positive_int(self.tp) and self.tp > 1):
            # Megatron's sequence parallelism shards activations over the tp group.
            problems.append(f"sequence_parallel requires tp > 1, got tp={self.tp}")
        # ep vs dp*cp is checked in validate(), not here: dp is usually still the
        # "fill me" placeholder 1 until resolve() sees the world size.
        return problems

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one model replica: tp * pp * cp."""
        return self.tp * self.pp * self.cp

    @property
    def micro_batch_multiple(self) -> int:
        """Every schedule call's micro-batch count must be a multiple of this: megatron-core's
        interleaved (VPP) schedule runs pp micro-batches per virtual stage in a row, and 0.16.1
        fails deep inside with fewer ("contiguous micro-batches ... should range in [PP, M]")."""
        return self.pp if self.vpp else 1

    def fitted_micro_batches(self, count: int) -> int:
        """The least multiple of `count` this layout's schedule takes (`micro_batch_multiple`)."""
        return math.lcm(count, self.micro_batch_multiple)

    def fitted_rows(self, rows: int, micro_batches: int) -> int:
        """The least multiple of `rows` that every data-parallel rank splits into `micro_batches`
        equal micro-batches (a multiple of dp * micro_batches: dp4 refused 2 rows, 2026-11-27)."""
        return math.lcm(rows, self.dp * micro_batches)

    def check_micro_batches(self, count: Any, what: str = "micro-batch count") -> None:
        """ValueError, before any rank works, unless `count` suits this layout's schedule."""
        if not _is_positive_int(count):
            raise ValueError(f"{what} must be a positive integer, got {count!r}")
        if count % self.micro_batch_multiple:
            raise ValueError(f"{what} {count} does not suit {self.name}: the interleaved (VPP) schedule needs "
                             f"a multiple of pp={self.pp} micro-batches per call")

    @property
    def world_size(self) -> int:
        """tp * pp * cp * dp; ep is carved out of dp*cp and does not multiply."""
        return self.model_parallel_size * self.dp

    @property
    def name(self) -> str:
        """Canonical name, e.g. 'tp2pp2dp2', 'pp2vpp2', 'tp2dp2-sp'; all ones is 'tp1'."""
        # vpp=1 (single-chunk interleaving) is a real setting, and an etp that is given differs
        # from tp: both keep their 1.
        parts = [
            f"{dim}{value}"
            for dim in _NAME_ORDER
            if (value := getattr(self, dim)) is not None and (value != 1 or dim in ("vpp", "etp"))
        ]
        base = "".join(parts) or "tp1"
        return base + "-sp" if self.sequence_parallel else base

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """Same as :func:`parse_layout`."""
        return parse_layout(text)

    def with_dp_for(self, world_size: int) -> "Layout":
        """This layout with dp = world_size // (tp*pp*cp); LayoutError if not divisible."""
        if not _is_positive_int(world_size):
            raise LayoutError(f"world size must be a positive integer, got {world_size!r}")
        if world_size % self.model_parallel_size:
            raise LayoutError(
                f"layout {self.name} cannot fill world size {world_size}: "
                f"tp*pp*cp = {self.model_parallel_size} does not divide {world_size}"
            )
        return dataclasses.replace(self, dp=world_size // self.model_parallel_size)

    def megatron_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for megatron.core.parallel_state.initialize_model_parallel.

        dp is absent on purpose: Megatron derives it from the world size.
        sequence_parallel is absent because it is a model-config setting
        (see :meth:`config_kwargs`), not a process-group one.
        """
        return {
            "tensor_model_parallel_size": self.tp,
            "pipeline_model_parallel_size": self.pp,
            "virtual_pipeline_model_parallel_size": self.vpp,
            "context_parallel_size": self.cp,
            "hierarchical_context_parallel_sizes": self.hierarchical_cp_sizes,
            "expert_model_parallel_size": self.ep,
            "expert_tensor_parallel_size": self.etp,
        }

    @property
    def hierarchical_cp_sizes(self) -> Optional[list[int]]:
        """The CP group split in two levels, [2, cp // 2] (inner all-to-all, outer ring), where cp
        splits so: what megatron-core's `cp_comm_type="a2a+p2p"` runs over (its
        `hierarchical_context_parallel_sizes`). Made for every such layout, so one layout's groups
        serve every exchange; None below cp 4 (one level: no hierarchy)."""
        return [2, self.cp // 2] if self.cp >= 4 and self.cp % 2 == 0 else None

    def config_kwargs(self) -> dict[str, Any]:
        """Fields for megatron.core.ModelParallelConfig / TransformerConfig."""
        return {**self.megatron_kwargs(), "sequence_parallel": self.sequence_parallel}


# --------------------------------------------------------------------------- parsing

# One part at the current position; no dim name is a prefix of another, so order is free.
_PART = re.compile(
    r"(?P<flag>sequence[-_]?parallel|sp)"
    r"|(?P<dim>vpp|etp|tp|pp|dp|cp|ep)(?P<size>\d+)"
)
# Separator between parts: '-', '_', whitespace, with at most one 'x' that must
# be followed by another part (so a trailing or leading 'x' is an unknown token).
_SEP = re.compile(r"[-_\s]*(?:x(?=[-_\s]*[a-z]))?[-_\s]*")
_BAD_TOKEN = re.compile(r"[^-_\s]+")
_SEP_CHARS = "-_ \t\n\r\f\v"


def _parse_error(text: str, detail: str) -> LayoutError:
    return LayoutError(f"cannot parse layout {text!r}: {detail}; {GRAMMAR}")


def _tokens(text: str) -> list[tuple[str, Optional[int]]]:
    """(dim, size) for dims and ('sp', None) for the flag, in text order."""
    # Leading/trailing separators are harmless noise ("tp2-", " pp2 ").
    lowered = text.lower().strip(_SEP_CHARS)
    tokens: list[tuple[str, Optional[int]]] = []
    pos = 0
    while pos < len(lowered):
        if pos:
            pos = _SEP.match(lowered, pos).end()
        match = _PART.match(lowered, pos)
        if match is None:
            # Stripping guarantees a non-separator character sits at pos.
            bad = _BAD_TOKEN.match(lowered, pos).group(0)
            if bad in _NAME_ORDER:
                raise _parse_error(text, f"dim {bad!r} needs a size, e.g. '{bad}2'")
            raise _parse_error(text, f"unknown token {bad!r}")
        pos = match.end()
        if match.group("flag"):
            tokens.append(("sp", None))
        else:
            tokens.append((match.group("dim"), int(match.group("size"))))
    return tokens


def parse_layout(text: str) -> Layout:
    """Parse one layout string (grammar in the module docstring); dp defaults to 1 = fill."""
    if not isinstance(text, str):
        raise LayoutError(f"layout must be a string, got {type(text).__name__}")
    if "," in text:
        raise _parse_error(text, "',' separates layouts; use parse_layout_list for lists")
    tokens = _tokens(text)
    if not tokens:
        raise _parse_error(text, "empty layout")
    fields: dict[str, Any] = {}
    for dim, size in tokens:
        key = "sequence_parallel" if dim == "sp" else dim
        if key in fields:
            raise _parse_error(text, f"{dim!r} given more than once")
        if size == 0:
            raise _parse_error(text, f"{dim}0: size must be a positive integer")
        fields[key] = True if dim == "sp" else size
    try:
        return Layout(**fields)
    except _FieldError as err:
        raise LayoutError(f"layout {text!r} is not valid: " + "; ".join(err.problems)) from None


def parse_layout_list(text: str) -> list[Layout]:
    """Parse a ','-separated list such as 'tp1,tp2,pp2' (order kept, duplicates rejected)."""
    if not isinstance(text, str):
        raise LayoutError(f"layout list must be a string, got {type(text).__name__}")
    pieces = [piece.strip() for piece in text.split(",")]
    if any(not piece for piece in pieces):
        raise LayoutError(f"cannot parse layout list {text!r}: empty entry; {GRAMMAR}")
    layouts: list[Layout] = []
    for piece in pieces:
        layout = parse_layout(piece)
        if layout in layouts:
            raise LayoutError(f"layout list {text!r} names {layout.name} more than once")
        layouts.append(layout)
    return layouts


# ------------------------------------------------------------------------ resolving

def resolve(layout: Layout, world_size: int) -> Layout:
    """Fill dp from world_size when dp == 1 (the 'not given' value); else check it fits.

    Raises LayoutError when tp*pp*cp does not divide world_size, or when an
    explicit dp > 1 gives a different total than world_size.
    """
    if layout.dp == 1:
        return layout.with_dp_for(world_size)
    if layout.world_size != world_size:
        raise LayoutError(
            f"layout {layout.name} needs {layout.world_size} ranks (tp*pp*cp*dp) "
            f"but world size is {world_size}"
        )
    return layout


# ------------------------------------------------------------------- backends

# Where context parallelism runs. megatron-core's own attention for CP is TEDotProductAttention only
# ("Context parallelism is only supported by TEDotProductAttention"), and of TE's backends only its fused
# (cuDNN) and flash attention split a sequence over ranks, in fp16/bf16. The local spec (the CPU tier)
# runs CP with the harness's gathered-kv attention (harness.parallel.cp_attention): every dtype, rows
# and packed THD sequences.
CP_BACKEND = ("context parallelism runs with Transformer Engine's layer spec on CUDA or with the local spec "
              "(the harness's gathered-kv attention, harness.parallel.cp_attention)")
# TE's fused and flash attention compute in fp16/bf16; its unfused (fp32) attention has no CP.
CP_FP32 = ("context parallelism has no fp32 attention in Transformer Engine: its fused and flash attention are "
           "fp16/bf16 only and its unfused attention does not split a sequence; run bf16 (or the local spec)")


def check_backend(layout: Layout, device: str, spec: str, dtype: str | None = None,
                  packing: str | None = None) -> None:
    """Raise LayoutError where `layout` cannot run on (device, layer spec[, dtype, packing]): before
    any rank starts, one line (the CLIs exit 2 on it)."""
    if layout.cp == 1 or spec == "local":
        return
    if device != "cuda" or spec != "te":
        raise LayoutError(f"layout {layout.name} on {device} with the {spec} spec: {CP_BACKEND}")
    if dtype == "fp32":
        raise LayoutError(f"layout {layout.name} in fp32 on the te spec: {CP_FP32}")


# ----------------------------------------------------------------------- validation

def _model_attr(model: Any, *names: str) -> Optional[int]:
    """First non-None attribute among Megatron then HF spellings."""
    for name in names:
        value = getattr(model, name, None)
        if value is not None:
            return value
    return None


def _model_label(model: Any) -> str:
    label = _model_attr(model, "name", "_name_or_path", "name_or_path", "model_type")
    return f"model {label}" if label else "the given model config"


def sliding_window(model: Any) -> Optional[int]:
    """The model's attention window, None without one (Qwen2's configs carry a window they turn off)."""
    window = _model_attr(model, "sliding_window", "window_size")
    return window if window and getattr(model, "use_sliding_window", True) is not False else None


def _model_problems(layout: Layout, model: Any) -> list[str]:
    problems: list[str] = []
    heads = _model_attr(model, "num_attention_heads")
    groups = _model_attr(model, "num_query_groups", "num_key_value_heads") or heads
    layers = _model_attr(model, "num_layers", "num_hidden_layers")
    ffn = _model_attr(model, "ffn_hidden_size", "intermediate_size")
    experts = _model_attr(model, "num_moe_experts", "num_experts", "num_local_experts", "n_routed_experts")
    expert_ffn = _model_attr(model, "moe_ffn_hidden_size", "moe_intermediate_size")
    if experts and expert_ffn is None:  # Mixtral's experts are intermediate_size wide
        expert_ffn = ffn

    # Sliding-window attention (Gemma 3's, harness.bridge.gemma3; gpt-oss's) has no CP in the harness: the
    # local spec's gathered-kv attention builds a causal mask only, and no windowed model was run on TE's CP.
    if layout.cp > 1 and _model_attr(model, "kv_lora_rank") is not None:
        problems.append(f"cp={layout.cp} with multi-head latent attention (DeepSeek-V3's MLA): the harness's "
                        "context-parallel attention takes plain self-attention only")
    window = sliding_window(model)
    if layout.cp > 1 and window:
        problems.append(f"cp={layout.cp} with sliding-window attention (sliding_window={window}): context "
                        "parallelism runs full causal attention only")

    # Attention heads and KV groups are split whole across tp ranks.
    if heads is not None and heads % layout.tp:
        problems.append(f"tp={layout.tp} does not divide num_attention_heads={heads}")
    if groups is not None and groups % layout.tp:
        problems.append(f"tp={layout.tp} does not divide num_query_groups={groups}")
    # ColumnParallelLinear asserts the MLP width splits evenly over tp.
    if ffn is not None and ffn % layout.tp:
        problems.append(f"tp={layout.tp} does not divide ffn_hidden_size={ffn}")
    # Multi-head latent attention (DeepSeek-V3): the local spec's down projections are column-parallel
    # (their outputs split over tp, then gathered), the shared experts split over tp as the dense MLP.
    for name in ("q_lora_rank", "kv_lora_rank"):
        rank = _model_attr(model, name)
        width = rank if name == "q_lora_rank" else (rank or 0) + (_model_attr(model, "qk_rope_head_dim",
                                                                               "qk_pos_emb_head_dim") or 0)
        if rank is not None and width % layout.tp:
            what = "q_lora_rank" if name == "q_lora_rank" else "kv_lora_rank + qk_rope_head_dim"
            problems.append(f"tp={layout.tp} does not divide {what}={width} (MLA's down projection)")
    shared = _model_attr(model, "n_shared_experts")
    if shared and expert_ffn is not None and (shared * expert_ffn) % layout.tp:
        problems.append(f"tp={layout.tp} does not divide the shared experts' width={shared * expert_ffn}")
    # Every (virtual) pipeline stage must get the same whole number of layers.
    stages = layout.pp * (layout.vpp or 1)
    if layers is not None and layers % stages:
        what = f"pp*vpp = {layout.pp}*{layout.vpp} = {stages}" if layout.vpp else f"pp={layout.pp}"
        problems.append(f"{what} does not divide num_layers={layers}")
    if layout.ep > 1:
        if not experts:
            problems.append(f"ep={layout.ep} requires a MoE model, but the model has no experts")
        elif experts % layout.ep:
            problems.append(f"ep={layout.ep} does not divide num_moe_experts={experts}")
    # megatron-core's MoELayer refuses a training forward with tp > 1 and no sequence parallelism.
    if experts and layout.tp > 1 and not layout.sequence_parallel:
        problems.append(f"tp={layout.tp} with experts needs sequence parallelism (add 'sp'): megatron-core's "
                        "MoE layer refuses to train without it")
    if layout.etp is not None and not experts:
        problems.append(f"etp={layout.etp} requires a MoE model, but the model has no experts")
    # The experts' linear layers split their width over etp as the dense ones do over tp.
    if experts and expert_ffn is not None and expert_ffn % layout.expert_tp:
        problems.append(f"etp={layout.expert_tp} does not divide the expert ffn_hidden_size={expert_ffn}")
    # Expert biases (gpt-oss): megatron-core 0.19.2's MoE layer asserts "Bias in Moe is only supported
    # when ETP==1" once the ranks build it; said here first.
    if experts and layout.expert_tp > 1 and _model_attr(model, "model_type") == "gpt_oss":
        problems.append(f"etp={layout.expert_tp} with expert biases (gpt-oss): megatron-core's MoE supports "
                        "expert biases only at etp 1 (add 'etp1', e.g. tp2ep2etp1-sp)")
    return problems


def _layout_problems(layout: Layout, world_size: int) -> list[str]:
    problems: list[str] = []
    if layout.world_size != world_size:
        hint = ""
        if layout.dp == 1 and world_size % layout.model_parallel_size == 0:
            hint = " (resolve(layout, world_size) fills dp from the world size)"
        problems.append(
            f"tp*pp*cp*dp = {layout.world_size} != world size {world_size}{hint}"
        )
    # Megatron lays etp*ep*expert-dp over the tp*cp*dp ranks of each pipeline stage.
    if layout.etp is None and (layout.dp * layout.cp) % layout.ep:
        problems.append(
            f"ep={layout.ep} does not divide dp*cp = {layout.dp * layout.cp}"
        )
    elif layout.etp is not None and (layout.tp * layout.dp * layout.cp) % (layout.etp * layout.ep):
        problems.append(
            f"etp*ep = {layout.etp}*{layout.ep} does not divide tp*dp*cp = {layout.tp * layout.dp * layout.cp}"
        )
    return problems


def validate(layout: Layout, world_size: int, model: Any = None) -> Layout:
    """Raise LayoutError listing every problem (one per line); return layout if valid.

    Checks tp*pp*cp*dp == world_size and etp*ep | tp*dp*cp; with a model config
    (Megatron or HF attribute names) also heads, query groups and ffn width vs tp,
    layers vs pp*vpp, experts vs ep, and the expert ffn width vs etp.  dp is taken as given: call resolve() first to fill it.
    """
    if not _is_positive_int(world_size):
        raise LayoutError(f"world size must be a positive integer, got {world_size!r}")
    model_problems = _model_problems(layout, model) if model is not None else []
    world_problems = _layout_problems(layout, world_size)
    if model_problems or world_problems:
        # Name only what a problem is about: a caller that derived the world size from the layout
        # (the CLIs) would otherwise show the user a number they never typed.
        where = [f"world size {world_size}"] if world_problems else []
        where += [_model_label(model)] if model_problems else []
        lines = "\n".join(f"  - {problem}" for problem in model_problems + world_problems)
        raise LayoutError(f"layout {layout.name} is invalid for {' and '.join(where)}:\n{lines}")
    return layout


def is_valid(layout: Layout, world_size: int, model: Any = None) -> bool:
    """validate() as a predicate."""
    try:
        validate(layout, world_size, model)
    except LayoutError:
        return False
    return True


# ---------------------------------------------------------------------- enumeration

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _factorizations(world_size: int, with_cp: bool) -> Iterable[tuple[int, int, int, int]]:
    """All (tp, pp, cp, dp) with product world_size; cp fixed to 1 unless with_cp."""
    for tp in _divisors(world_size):
        for pp in _divisors(world_size // tp):
            rest = world_size // (tp * pp)
            for cp in _divisors(rest) if with_cp else [1]:
                yield tp, pp, cp, rest // cp


def _variants(base: Layout, allow_sp: bool, vpps: list[Optional[int]], with_ep: bool) -> Iterable[Layout]:
    sps = [False, True] if allow_sp and base.tp > 1 else [False]
    vpp_options = vpps if base.pp > 1 else [None]
    eps = _divisors(base.dp * base.cp) if with_ep else [1]
    for sp, vpp, ep in product(sps, vpp_options, eps):
        yield dataclasses.replace(base, sequence_parallel=sp, vpp=vpp, ep=ep)


def _sort_key(layout: Layout) -> tuple:
    return (layout.tp, layout.pp, layout.vpp or 0, layout.cp, layout.ep, layout.etp or 0, layout.dp,
            layout.sequence_parallel)


def enumerate_layouts(
    world_size: int,
    model: Any = None,
    *,
    allow_sp: bool = True,
    allow_vpp: bool = True,
    max_vpp: int = 2,
    cp: bool = False,
    ep: bool = False,
) -> list[Layout]:
    """Every valid layout using exactly world_size ranks, sorted by (tp, pp, vpp, cp, ep, dp, sp).

    Covers all tp*pp*dp factorizations (times cp when cp=True), sp variants for
    tp > 1, vpp = 2..max_vpp variants for pp > 1 (when allow_vpp), and ep values
    dividing dp*cp (when ep=True).  With a model, layouts failing validate() are dropped.
    """
    if not _is_positive_int(world_size):
        raise LayoutError(f"world size must be a positive integer, got {world_size!r}")
    vpps: list[Optional[int]] = [None]
    if allow_vpp:
        vpps += list(range(2, max_vpp + 1))
    layouts = [
        layout
        for tp, pp, cp_size, dp in _factorizations(world_size, cp)
        for layout in _variants(Layout(tp=tp, pp=pp, cp=cp_size, dp=dp), allow_sp, vpps, ep)
        if is_valid(layout, world_size, model)
    ]
    return sorted(layouts, key=_sort_key)
