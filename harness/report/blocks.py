"""The content of a report as blocks (headings, paragraphs, tables, images) and their two
renderers, Markdown (summary.md, compare) and self-contained HTML (report.html), so both say the
same thing; plus the number formatting every report uses."""
from __future__ import annotations

import base64
import html
import math
from dataclasses import dataclass, field
from typing import Any


def fmt_value(value: Any) -> str:
    """Numbers short but faithful: 3 significant digits, except ratios a hair off an integer
    (token_mult_prob_error 1.0000005 would print as "1") which print as "1+5e-07"."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        v = float(value)
        if math.isnan(v) or math.isinf(v):
            return str(v)
        nearest = round(v)
        if nearest != 0 and v != nearest and abs(v - nearest) < 1e-3 and abs(v) < 10:
            return f"{nearest}{v - nearest:+.2g}"
        return f"{v:.3g}"
    return str(value)


def one_line(text: Any, limit: int = 240) -> str:
    text = " ".join(str(text or "").split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass
class Table:
    columns: list[str]
    rows: list[list[str]]
    more: int = 0  # rows left out by a cap: rendered as "... N more"
    failing: set[tuple[int, int]] = field(default_factory=set)  # (row, col) cells to highlight
    more_hint: str = "see report.html / results.csv"  # where the capped rows can be found


Block = tuple[str, Any]  # ("h1"|"h2"|"h3"|"p", text) or ("table", Table) or ("img", (title, png))


def _md_cell(text: Any) -> str:
    return one_line(text, 400).replace("|", "\\|")


def blocks_to_markdown(blocks: list[Block]) -> str:
    out: list[str] = []
    for kind, value in blocks:
        if kind in ("h1", "h2", "h3"):
            out.append("#" * int(kind[1]) + " " + value)
        elif kind == "p":
            out.append(value)
        elif kind == "table":
            out.append("| " + " | ".join(_md_cell(c) for c in value.columns) + " |")
            out.append("|" + "---|" * len(value.columns))
            out.extend("| " + " | ".join(_md_cell(c) for c in row) + " |" for row in value.rows)
            if value.more:
                out.append(f"\n... {value.more} more ({value.more_hint})")
        out.append("")
    return "\n".join(out)


def blocks_to_html(blocks: list[Block], title: str) -> str:
    body: list[str] = []
    for kind, value in blocks:
        if kind in ("h1", "h2", "h3"):
            body.append(f"<{kind}>{html.escape(value)}</{kind}>")
        elif kind == "p":
            body.append(f"<p>{_inline_code(value)}</p>")
        elif kind == "table":
            head = "".join(f"<th>{html.escape(c)}</th>" for c in value.columns)
            trs = []
            for r, row in enumerate(value.rows):
                tds = "".join(
                    ("<td class='fail'>" if (r, c) in value.failing else "<td>") + html.escape(cell) + "</td>"
                    for c, cell in enumerate(row))
                trs.append(f"<tr>{tds}</tr>")
            more = (f"<p class='more'>... {value.more} more ({html.escape(value.more_hint)})</p>"
                    if value.more else "")
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(trs)}</tbody></table>{more}")
        elif kind == "img":
            name, png = value
            data = base64.b64encode(png).decode("ascii")
            body.append(f"<figure><img alt=\"{html.escape(name)}\" src=\"data:image/png;base64,{data}\">"
                        f"<figcaption>{html.escape(name)}</figcaption></figure>")
    style = ("body{font-family:sans-serif;margin:1.5em;max-width:1400px}"
             "table{border-collapse:collapse;margin:.5em 0;font-size:13px}"
             "td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}"
             "th{background:#f0f0f0}td.fail{background:#fdd;font-weight:bold}"
             "img{max-width:100%}figcaption{color:#555;font-size:13px}.more{color:#777}")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def _inline_code(text: str) -> str:
    """The paragraphs use **bold** and `code` only: translate those two, escape the rest."""
    out, parts = [], html.escape(text).split("`")
    for i, part in enumerate(parts):
        bolds = part.split("**")
        part = "".join(f"<b>{b}</b>" if j % 2 else b for j, b in enumerate(bolds))
        out.append(f"<code>{part}</code>" if i % 2 else part)
    return "".join(out)
