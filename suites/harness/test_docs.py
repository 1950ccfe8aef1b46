"""What the README and docs/*.md show a newcomer to copy must work: links, `harness.` paths, file
paths, `import` lines, `mrh` commands and their options, `make` targets and `--mrh-*` pytest
options. Each is a case of its own, named `doc:line:item`, so a failure points at the line to fix.

CPU only and fast: no rank process starts. The `mrh` help texts come from two subprocesses, once
per session: the installed `mrh --help` (the console script itself), and one Python walking every
subcommand's `--help` through `harness.cli.main` (one torch import instead of fifteen).
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Paths the harness writes, absent from a checkout: each with the file whose code names it as its
# default (checked below, so an entry cannot outlive the code that writes there).
OUTPUTS = {
    "reports/runs": "harness/pytest_plugin/collection.py",  # --mrh-report-dir, --mrh-run-dir
    "reports/loops": "harness/rl/cli.py",                   # mrh loop --out
    "reports/trend": "harness/report/trend.py",             # mrh report trend --out
}
PATH_ROOTS = ("harness", "suites", "ci", ".ci", "reports", "docs")


# ---------------------------------------------------------------------------------------- parsing
@dataclasses.dataclass(frozen=True)
class Snippet:
    """A piece of code a doc shows: an inline code span or one line of a fenced block."""

    doc: str    # path relative to ROOT
    line: int   # 1-based
    text: str
    lang: str   # "inline", or the fence's info string ("bash", "python", "" ...)


@dataclasses.dataclass(frozen=True)
class Parsed:
    snippets: tuple[Snippet, ...]
    links: tuple[tuple[str, int, str], ...]  # (doc, line, target)


def _parse(path: Path) -> Parsed:
    rel = path.relative_to(ROOT).as_posix()
    lines = path.read_text().split("\n")
    snippets, prose = [], []
    fence = None  # the info string of the open fenced block
    for number, line in enumerate(lines, 1):
        marker = re.match(r"^\s*```(.*)$", line)
        if marker:
            fence = marker.group(1).strip() if fence is None else None
            prose.append("")
        elif fence is not None:
            snippets.append(Snippet(rel, number, line, fence))
            prose.append("")
        else:
            prose.append(line)
    text = "\n".join(prose)  # fenced blocks blanked, line numbers kept
    spans = []
    for match in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", text, re.S):
        if "\n\n" in match.group(2):  # a stray backtick: a span never crosses a paragraph
            continue
        start = text.count("\n", 0, match.start()) + 1
        spans.append((match.start(), match.end()))
        # A span wrapped over lines reads with a space where the newline was (as Markdown renders it).
        snippets.append(Snippet(rel, start, re.sub(r"\s*\n\s*", " ", match.group(2).strip()), "inline"))
    outside = list(text)
    for begin, end in spans:
        outside[begin:end] = " " * (end - begin)
    outside = "".join(outside)
    links = [(rel, outside.count("\n", 0, m.start()) + 1, m.group(1))
             for m in re.finditer(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", outside)]
    return Parsed(tuple(snippets), tuple(links))


PARSED = {path.relative_to(ROOT).as_posix(): _parse(path) for path in DOCS}
SNIPPETS = [s for parsed in PARSED.values() for s in parsed.snippets]


def _case(snippet: Snippet, item: str):
    return pytest.param(snippet, item, id=f"{snippet.doc}:{snippet.line}:{item}")


def _commands(text: str) -> list[str]:
    """A shell line's commands: split at &&, ||, a pipe between spaces, ; and $( ), a comment
    dropped. A bar with no space around it is a usage's alternatives (`--caller temporal|both`)."""
    text = re.sub(r"(^|\s)#.*$", "", text)
    return [part.strip() for part in re.split(r"&&|\|\||\s\|\s|;|\$\(|\)", text) if part.strip()]


def _shell(snippet: Snippet) -> bool:
    """Inline code and shell blocks: where commands and paths are shown."""
    return snippet.lang in ("inline", "bash", "sh", "shell", "console", "")


def _dotted_paths():
    cases = []
    for s in SNIPPETS:
        if s.lang == "inline":
            match = re.match(r"harness(?:\.[A-Za-z_]\w*)+", s.text)
            if match:
                cases.append(_case(s, match.group(0)))
    return cases


def _file_paths():
    pattern = re.compile(r"(?<![\w./$-])((?:%s)/[\w./<>*-]*)" % "|".join(re.escape(r) for r in PATH_ROOTS))
    return [_case(s, match.group(1)) for s in SNIPPETS if _shell(s) for match in pattern.finditer(s.text)]


def _imports():
    cases = []
    for s in SNIPPETS:  # python blocks, and `python -c "from harness... import ..."` anywhere
        for match in re.finditer(r"\b(from\s+harness[\w.]*\s+import\s+[\w, ]+\w|import\s+harness[\w.]*)", s.text):
            cases.append(_case(s, re.sub(r"\s+", " ", match.group(1))))
    return cases


def _mrh_commands():
    cases = []
    for s in SNIPPETS:
        if not _shell(s):
            continue
        for command in _commands(s.text):
            match = re.search(r"(?:^|(?<=\s))(?:\S*/)?mrh\s+(.+)$", command)
            if match:
                cases.append(_case(s, "mrh " + match.group(1).strip()))
    return cases


def _make_targets():
    cases = []
    for s in SNIPPETS:
        if not _shell(s):
            continue
        for command in _commands(s.text):
            match = re.match(r"make\s+(.*)$", command)
            if match:
                for word in match.group(1).split():
                    if not word.startswith("-") and "=" not in word and re.fullmatch(r"[\w-]+", word):
                        cases.append(_case(s, word))
    return cases


def _pytest_options():
    return [_case(s, match.group(1)) for s in SNIPPETS if _shell(s)
            for match in re.finditer(r"(?<![\w-])(--mrh-[\w-]+)", s.text)]


def _links():
    return [pytest.param(doc, line, target, id=f"{doc}:{line}:{target}")
            for parsed in PARSED.values() for doc, line, target in parsed.links
            if not re.match(r"^[a-z][\w+.-]*:", target)]  # http:, mailto: (an in-page #anchor is checked)


# ---------------------------------------------------------------------------------------- the docs
def test_every_docs_page_is_in_the_index_and_the_readme_links_the_index():
    index = PARSED["docs/README.md"] if "docs/README.md" in PARSED else None
    assert index is not None, "docs/README.md (the index of docs/) is missing"
    linked = {target.split("#")[0] for _, _, target in index.links}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages - linked == set(), "pages missing from docs/README.md"
    readme = {target.split("#")[0] for _, _, target in PARSED["README.md"].links}
    assert "docs/README.md" in readme


@pytest.mark.parametrize("kind, cases", [
    ("links", _links()), ("harness. paths", _dotted_paths()), ("file paths", _file_paths()),
    ("imports", _imports()), ("mrh commands", _mrh_commands()), ("make targets", _make_targets()),
])
def test_the_parser_finds_what_the_docs_show(kind, cases):
    """Guards the guards: a parser that found nothing would pass every check below vacuously."""
    assert len(cases) >= 3, kind


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation but - and _ dropped,
    spaces to -, a repeated one suffixed -1, -2 ..."""
    seen: dict[str, int] = {}
    fence = False
    for line in path.read_text().split("\n"):
        fence ^= line.lstrip().startswith("```")
        heading = None if fence else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
            if seen[slug]:
                seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


@pytest.mark.parametrize("doc, line, target", _links())
def test_relative_link_points_at_a_file(doc, line, target):
    path, _, anchor = target.partition("#")
    file = (ROOT / doc).parent.joinpath(path) if path else ROOT / doc
    assert file.exists(), f"{doc}:{line}: no file {path}"
    if anchor and file.suffix == ".md":
        assert anchor in _anchors(file), f"{doc}:{line}: {path or doc} has no heading #{anchor}"


@pytest.mark.parametrize("snippet, dotted", _dotted_paths())
def test_harness_path_resolves(snippet, dotted):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):  # the longest prefix that is a module, then attributes
        name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not (name == exc.name or name.startswith(exc.name + ".")):
                raise  # the module exists but something it imports does not
            continue
        for attr in parts[cut:]:
            fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
            assert hasattr(obj, attr) or attr in fields, f"{snippet.doc}:{snippet.line}: {name} has no {attr}"
            obj = getattr(obj, attr, None)
            name = f"{name}.{attr}"
        return
    pytest.fail(f"{snippet.doc}:{snippet.line}: no module {parts[0]}")


@pytest.mark.parametrize("snippet, path", _file_paths())
def test_file_path_exists(snippet, path):
    path = path.rstrip(".")  # a sentence's full stop
    if "<" in path or ">" in path:
        path = path[:min(i for i in (path.find("<"), path.find(">")) if i >= 0)]  # up to the placeholder
    if any(path == out or path.startswith(out + "/") for out in OUTPUTS):
        return
    found = glob.glob(str(ROOT / path)) if "*" in path else [p for p in [ROOT / path] if p.exists()]
    assert found, f"{snippet.doc}:{snippet.line}: no {path} in the repository"


def test_output_paths_are_the_codes_defaults():
    for out, writer in OUTPUTS.items():
        assert out in (ROOT / writer).read_text(), f"{writer} no longer writes {out}: update OUTPUTS"


@pytest.mark.parametrize("snippet, statement", _imports())
def test_import_line_imports(snippet, statement):
    match = re.fullmatch(r"from (\S+) import (.+)", statement)
    if match is None:
        importlib.import_module(statement.split()[1])
        return
    module = importlib.import_module(match.group(1))
    for name in (n.strip() for n in match.group(2).split(",")):
        if not hasattr(module, name):
            importlib.import_module(f"{match.group(1)}.{name}")  # a submodule imported by name


# ---------------------------------------------------------------------------------------- commands
def _help_walk() -> dict[str, str]:
    """Every command's and subcommand's --help text, from mrh's parser in this process."""
    import contextlib
    import io

    from harness.cli import main

    def help_of(argv):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main(argv + ["--help"])
        return out.getvalue()

    texts = {}
    for command in _usage_choices(help_of([])):
        texts[command] = help_of([command])
        for action in _usage_choices(texts[command]):
            texts[f"{command} {action}"] = help_of([command, action])
    return texts


def _usage_choices(text: str) -> list[str]:
    """The subcommands a help text lists: its positional shown as {a,b,c} (an option's choices are
    indented after the option's name, so they never start a line)."""
    group = re.search(r"^  \{([\w,-]+)\}", text, re.M)
    return group.group(1).split(",") if group else []


@functools.cache
def mrh_help() -> dict[str, str]:
    """Help text per command: "" is `mrh --help`, "bench" `mrh bench --help`, "bench ckpt" ..."""
    script = Path(sys.executable).parent / "mrh"
    assert script.exists(), f"no console script {script}: `make setup` installs it"
    top = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert top.returncode == 0, top.stderr
    texts = _help_walk()  # in process: the console script above is mrh's one start of its own
    assert set(_usage_choices(top.stdout)) == {c for c in texts if " " not in c}, "mrh --help and the parser disagree"
    return {"": top.stdout, **texts}


@pytest.mark.parametrize("snippet, command", _mrh_commands())
def test_mrh_command_and_its_options_exist(snippet, command):
    helps = mrh_help()
    where = f"{snippet.doc}:{snippet.line}"
    words = command.split()[1:]
    assert words[0] in _usage_choices(helps[""]), f"{where}: `mrh {words[0]}` is no subcommand of mrh"
    key = words[0]
    actions = _usage_choices(helps[key])
    if actions and len(words) > 1 and not words[1].startswith("-"):
        assert words[1] in actions, f"{where}: `mrh {key} {words[1]}`: {key} has only {actions}"
        key = f"{key} {words[1]}"
    for option in re.findall(r"(?<![\w-])(--[\w-]+)", command):
        assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", helps[key]), \
            f"{where}: `mrh {key}` has no option {option} (see `mrh {key} --help`)"


@functools.cache
def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", text, re.M))


@pytest.mark.parametrize("snippet, target", _make_targets())
def test_make_target_exists(snippet, target):
    assert target in make_targets(), f"{snippet.doc}:{snippet.line}: the Makefile has no target {target}"


@functools.cache
def plugin_source() -> str:
    return "\n".join(p.read_text() for p in sorted((ROOT / "harness" / "pytest_plugin").glob("*.py")))


@pytest.mark.parametrize("snippet, option", _pytest_options())
def test_pytest_option_is_the_plugins(snippet, option):
    assert f'"{option}"' in plugin_source(), f"{snippet.doc}:{snippet.line}: the plugin registers no {option}"
