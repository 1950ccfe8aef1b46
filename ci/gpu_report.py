"""Turn a device run's JUnit XML into a committed report: JSON + Markdown with machine, versions,
commit, date and command (until the report recorder of harness/report lands, this is the GPU record).

The commit comes from harness.report.fingerprint.git_revision, as in every run report: from git, or
on a machine whose tree came without .git from $MRH_GIT_COMMIT / $MRH_GIT_DIRTY ("unknown" without)."""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

from harness.report.fingerprint import git_revision
from harness.report.packed import RESULTS_FORMS, read_json


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True).stdout.split("\n")[0].strip()
    except OSError:
        driver = None
    return {
        "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "driver": driver, "gpus": gpus, "gpu_count": len(gpus),
        **{name: _version(name) for name in ("megatron-core", "mbridge", "megatron-bridge", "transformers",
                                             "transformer-engine")},
        **git_revision(),
    }


def cases(junit: Path) -> list[dict]:
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.get("classname") is None and case.get("name") is None:
            # What pytest writes for a run stopped by SIGINT (RUN_TIMEOUT): no test; the log says which
            # test was running (a 4x H100 run of 2026-11-27 had counted it as a passed "None::None").
            continue
        outcome = "passed"
        detail = ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                detail = (node.get("message") or "")[:300]
        rows.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                     "time_s": float(case.get("time") or 0), "detail": detail})
    return rows


def _metric_rows(rows_dir: str | None) -> list[dict]:
    if not rows_dir:
        return []
    found = []
    runs = sorted({path.parent for path in Path(rows_dir).glob("*/results.json*") if path.name in RESULTS_FORMS})
    for run in runs:  # results.json, or a packed results.json.gz (harness.report.packed)
        found += read_json(run / "results.json")["rows"]
    return found


def _metric_table(rows: list[dict]) -> list[str]:
    """One line per comparison (model, layout, dtype, variant): its metrics and verdict."""
    if not rows:
        return []
    groups: dict[tuple, dict] = {}
    for row in rows:
        extra = row.get("extra") or {}
        key = (row["model"], row["dtype"], row["layout"], extra.get("variant") or "", extra.get("packing") or "", row["test"])
        groups.setdefault(key, {})[row["metric"]] = (row["value"], row["passed"])
    lines = ["", "## Comparisons", "", "| model | dtype | layout | variant / packing | max abs | mean abs | "
             "token_mult_prob_error | top-1 | all pass |", "|---|---|---|---|---|---|---|---|---|"]
    for (model, dtype, layout, variant, packing, _), metrics in sorted(groups.items()):
        value = lambda m: f"{metrics[m][0]:.3g}" if m in metrics else ""
        verdict = all(ok for _, ok in metrics.values())
        lines.append(f"| {model} | {dtype} | {layout} | {variant or packing} | {value('max_abs')} | "
                     f"{value('mean_abs')} | {value('token_mult_prob_error')} | {value('top1_agreement')} | "
                     f"{'yes' if verdict else 'NO'} |")
    return lines


def _commit_line(env: dict) -> str:
    dirty = " +dirty (tracked files differed from it)" if env.get("git_dirty") else ""
    return f"- commit: `{env.get('git_commit')}`{dirty}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--name", "--junit", "--log", "--started", "--command", "--out"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--wall-s", type=float, required=True)
    parser.add_argument("--rows-dir", help="a --mrh-report-dir: its results.json rows are embedded")
    args = parser.parse_args(argv)
    rows = cases(Path(args.junit))
    metric_rows = _metric_rows(args.rows_dir)
    counts = {k: sum(r["outcome"] == k for r in rows) for k in ("passed", "failed", "error", "skipped")}
    interrupted = "KeyboardInterrupt" in Path(args.log).read_text(errors="replace")
    report = {"name": args.name, "command": args.command, "started": args.started,
              "wall_s": args.wall_s, "counts": counts, "interrupted": interrupted, "environment": environment(),
              "tests": rows, "rows": metric_rows}
    out = Path(args.out)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=2))
    env = report["environment"]
    lines = [f"# {args.name}", "", f"- command: `{args.command}`", f"- started: {args.started}, wall {args.wall_s:.0f} s",
             f"- machine: {env['gpu_count']}x {env['gpus'][0] if env['gpus'] else 'no GPU'}, driver {env['driver']}, host {env['host']}",
             f"- versions: python {env['python']}, torch {env['torch']} (CUDA {env['cuda']}), megatron-core {env['megatron-core']}, "
             f"mbridge {env['mbridge']}, megatron-bridge {env.get('megatron-bridge')}, transformers {env['transformers']}, transformer-engine {env['transformer-engine']}",
             _commit_line(env),
             "- outcome: " + ", ".join(f"{v} {k}" for k, v in counts.items())
             + ("; interrupted (SIGINT: the time limit): the test running then has no row, the log names it"
                if interrupted else ""), "",
             "| test | outcome | time (s) | detail |", "|---|---|---|---|"]
    lines += [f"| `{r['test']}` | {r['outcome']} | {r['time_s']:.2f} | {r['detail'].replace('|', '/')} |"
              for r in sorted(rows, key=lambda r: (r["outcome"] == "passed", r["test"]))]
    lines += _metric_table(metric_rows)
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print(f"report: {out / (args.name + '.json')} and .md; {counts}")


if __name__ == "__main__":
    main()
