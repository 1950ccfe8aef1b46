"""`mrh repro`: the catalog of wrong variants, and one entry reproduced on the variant and the fix.

    mrh repro --list                      # every entry: component, kind, upstream reference, check
    mrh repro scaled-norm                 # at its default layout, bf16, on CPU
    mrh repro shared-adam-step --layout pp2->pp2 --dtype fp32 --device cuda --json

Exit 0 when the bug reproduces (the variant fails its check by the stated margin) and the fix
holds (the fixed path passes); 1 otherwise; 2 for bad input, reported before any rank starts.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from harness.variants.catalog import VariantError


def add_arguments(parser) -> None:
    parser.add_argument("id", nargs="?", help="a catalog entry (see --list)")
    parser.add_argument("--list", action="store_true", help="list the catalog and exit")
    parser.add_argument("--layout", default=None,
                        help="where to run it (default: the entry's); a checkpoint entry takes 'source->target'")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per call on the ranks")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def _listing(as_json: bool) -> str:
    from harness.variants.repro import catalog_rows

    rows = catalog_rows()
    if as_json:
        return json.dumps(rows, indent=1)
    lines = []
    for row in rows:
        lines += [f"{row['id']}  [{row['component']}, {row['kind']}, default {row['default_layout']}]",
                  f"    wrong:    {row['description']}", f"    symptom:  {row['symptom']}",
                  f"    upstream: {row['upstream'] or '-'}", f"    check:    {row['caught_by']}"]
    return "\n".join(lines)


def main(args) -> int:
    if args.list:
        print(_listing(args.json))
        return 0
    from harness.variants.repro import Runner, as_dict, describe, preflight, reproduce

    try:
        if not args.id:
            raise VariantError("name a catalog entry (mrh repro --list shows them)")
        preflight(args.id, args.layout, args.dtype, device=args.device)
    except (VariantError, ValueError, FileNotFoundError) as exc:
        print(f"mrh repro: {exc}", file=sys.stderr)
        return 2
    from harness.launch import WorldPool

    pool = WorldPool(timeout=args.timeout, echo_output=False)
    print(f"mrh repro {args.id}: running the check on the variant and on the fixed path ...",
          file=sys.stderr, flush=True)
    try:
        with tempfile.TemporaryDirectory(prefix="mrh-repro-") as workdir:
            repro = reproduce(args.id, layout=args.layout, dtype=args.dtype,
                              runner=Runner.from_pool(pool, args.device, Path(workdir)))
    finally:
        pool.close()
    print(json.dumps(as_dict(repro), indent=1) if args.json else describe(repro))
    return 0 if repro.reproduced and repro.fix_holds else 1
