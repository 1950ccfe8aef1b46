"""`mrh parity`: HF vs Megatron logprob parity of one model over a list of layouts.

Progress goes to stderr while it runs; a table (or JSON with --json) goes to stdout at the end;
the exit status is 1 when any row fails its tolerance.
"""
from __future__ import annotations

import json
import sys
import time

from harness.bridge import specs
from harness.bridge.norms import resolve_norm_precision
from harness.launch import WorldPool
from harness.parallel.layout import LayoutError, check_backend, parse_layout_list, resolve, sliding_window, validate
from harness.parity.runner import CP_COMM_TYPES, DTYPES, REFERENCES, ParityCase, prepare_model, run_parity
from harness.parity.variants import check_variant
from harness.variants import VariantError, get


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="tiny-qwen3", help="zoo name or local HF checkpoint dir (default tiny-qwen3)")
    parser.add_argument("--layouts", default="tp1,tp2,pp2", help="comma list, e.g. tp1,tp2,pp2,tp2pp2 (default tp1,tp2,pp2)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--spec", choices=("local", "te"), default="local",
                        help="layer spec the Megatron model is built with: Megatron's local modules (default) "
                             "or Transformer Engine's (cuda only)")
    parser.add_argument("--variant", default=None, help="a wrong variant from the catalog (mrh repro --list); it must fail")
    parser.add_argument("--reference", choices=REFERENCES, default="arranged",
                        help="HF reference arithmetic: 'arranged' rounds where Megatron does (default), "
                             "'plain' is HF's eager forward as is (approximate regime)")
    parser.add_argument("--norm-precision", choices=("auto", "hf", "fused"), default="auto",
                        help="Megatron RMSNorm rounding (local spec): 'hf' (auto) or torch's 'fused'")
    parser.add_argument("--packing", choices=("right", "thd"), default="right",
                        help="how a micro-batch is fed: left padding removed ('right', default) or packed THD "
                             "sequences with cu_seqlens (TE spec)")
    parser.add_argument("--cp-comm-type", choices=CP_COMM_TYPES, default=None,
                        help="context parallelism's exchange (megatron-core's cp_comm_type; default p2p; a2a+p2p at cp >= 4); cp layouts only")
    parser.add_argument("--cache-dir", default=None, help="where zoo models are materialized")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per layout before stacks are dumped")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _preflight(args) -> list:
    """Every input checked before any rank starts: one clear error, exit 2."""
    layouts = parse_layout_list(args.layouts)
    # prepare_model runs harness.bridge.preflight.check_model_supported: an unsupported model
    # feature (model type, activation, sliding window, RoPE type, a tensor Megatron would drop)
    # is an UnsupportedModelError here, before the world starts.
    _, config = prepare_model(args.model, args.cache_dir)
    specs.for_world(args.device, args.spec)
    if args.spec == "te" and not specs.installed():
        raise ValueError("--spec te needs Transformer Engine: `transformer_engine` is not installed")
    resolve_norm_precision(args.norm_precision, args.spec)
    if args.packing == "thd" and sliding_window(config):
        raise LayoutError(f"--packing thd with sliding-window attention (sliding_window={sliding_window(config)}): "
                          "the harness feeds a windowed model rows or a block-diagonal mask")
    if args.cp_comm_type and not any(layout.cp > 1 for layout in layouts):
        raise ValueError(f"--cp-comm-type {args.cp_comm_type} needs a context-parallel layout (cp2, ...)")
    if args.variant and args.device not in get(args.variant).devices:
        raise VariantError(f"variant {args.variant!r} shows on {', '.join(get(args.variant).devices)} only, "
                           f"not {args.device}")
    resolved = []
    for layout in layouts:
        size = layout.world_size
        layout = resolve(layout, size)
        validate(layout, size, config)
        check_backend(layout, args.device, args.spec, args.dtype, args.packing)  # e.g. CP on TE: bf16
        check_variant(args.variant, layout, config)
        resolved.append(layout)
    return resolved


def main(args) -> int:
    try:
        layouts = _preflight(args)
    except (LayoutError, VariantError, FileNotFoundError, ValueError) as exc:
        print(f"mrh parity: {exc}", file=sys.stderr)
        return 2
    pool = WorldPool(timeout=args.timeout, echo_output=False)
    results = []
    try:
        for i, layout in enumerate(layouts, 1):
            _log(f"[{i}/{len(layouts)}] {args.model} {layout} {args.dtype} on {layout.world_size} {args.device} "
                 f"rank(s), {args.spec} spec ...")
            start = time.perf_counter()
            world = pool.get(layout.world_size, args.device, args.spec,
                             env=dict(get(args.variant).world_env) if args.variant else None)
            case = ParityCase(args.model, layout, args.dtype, args.variant, packing=args.packing,
                              norm_precision=args.norm_precision, reference=args.reference,
                              cp_comm_type=args.cp_comm_type if layout.cp > 1 else None)
            result = run_parity(world, case,
                                cache_dir=args.cache_dir, suite="parity", test="mrh parity")
            results.append(result)
            _log(f"      {'PASS' if result.passed else 'FAIL'} in {time.perf_counter() - start:.1f}s: {result.summary()}")
    finally:
        pool.close()
    rows = [row for result in results for row in result.rows]
    if args.json:
        print(json.dumps([row.as_dict() for row in rows], indent=1))
    else:
        print(_table(rows))
    failed = [r for r in rows if not r.passed]
    _log(f"{len(rows) - len(failed)}/{len(rows)} rows pass" + (f"; {len(failed)} FAIL" if failed else ""))
    return 1 if failed else 0


def _table(rows) -> str:
    header = f"{'layout':<12} {'regime':<12} {'metric':<22} {'value':>12} {'tolerance':>11}  result"
    lines = [header, "-" * len(header)]
    for row in rows:
        if row.tolerance is None:  # an observed figure (the bf16 noise rows): no bound, no verdict
            lines.append(f"{row.layout:<12} {row.extra.get('regime', ''):<12} {row.metric:<22} {row.value:>12.4g} "
                         f"{'-':>11}  observed")
            continue
        sign = ">=" if row.extra.get("tolerance_kind") == "min" else "<="
        lines.append(f"{row.layout:<12} {row.extra.get('regime', ''):<12} {row.metric:<22} {row.value:>12.4g} "
                     f"{sign}{row.tolerance:>9.6g}  "
                     f"{'pass' if row.passed else 'FAIL'}")
    return "\n".join(lines)
