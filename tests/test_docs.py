"""The documentation stays true to the tree: the README is a front door, links resolve, docs/architecture.md names
every package and module of the code as it is at test time, and the benchmark tables are what the committed
bench JSON renders (scripts/render_benchmarks.py)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
ARCHITECTURE = DOCS / "architecture.md"
README_MAX_LINES = 260
SKIP_DIRS = {"tests", "deploy", "scripts", "docs", "build", "dist", "requirements"}


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _strip_code(text: str) -> str:
    """The text outside fenced code blocks and inline code (links there are examples, not links)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (but - and _), spaces to hyphens."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _strip_code_keep_headings(path.read_text()):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _strip_code_keep_headings(text: str) -> list[str]:
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def _links(path: Path) -> list[str]:
    return LINK.findall(_strip_code(path.read_text()))


def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move " \
                                           f"detail into docs/"


def test_readme_two_commands_match_the_makefile():
    text = README.read_text()
    block = re.search(r"## The two commands\s+```bash\n(.*?)```", text, re.S)
    assert block, "README.md lost its 'The two commands' block"
    commands = [ln.split("#")[0].strip() for ln in block.group(1).splitlines() if ln.strip()]
    assert commands == ["make serve", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    for target in ("serve", "test"):
        assert re.search(rf"^{target}:", makefile, re.M), f"the Makefile has no '{target}' target"


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path: Path):
    broken = []
    for target in _links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
            continue  # http(s), mailto: not checked offline
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target} (no {dest.relative_to(ROOT) if ROOT in dest.parents else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading '#{anchor}' in {dest.relative_to(ROOT)})")
    assert not broken, f"{path.relative_to(ROOT)}: broken links: {broken}"


def _package_roots() -> list[Path]:
    """Top-level Python packages of the project (a folder with __init__.py at the root or under src/)."""
    candidates = [*ROOT.iterdir(), *((ROOT / "src").iterdir() if (ROOT / "src").is_dir() else [])]
    return sorted(p for p in candidates if p.is_dir() and (p / "__init__.py").is_file() and p.name not in SKIP_DIRS
                  and not p.name.startswith("."))


def _packages() -> list[Path]:
    return sorted(d for root in _package_roots() for d in [root, *root.rglob("*")]
                  if d.is_dir() and (d / "__init__.py").is_file() and "__pycache__" not in d.parts)


def _doc_path(path: Path) -> str:
    """A folder or file as the docs name it: relative to the root, without a leading src/."""
    rel = path.relative_to(ROOT).as_posix()
    return rel[len("src/"):] if rel.startswith("src/") else rel


def _mentions(text: str, name: str) -> bool:
    return re.search(r"(?<![\w/.])" + re.escape(name) + r"(?![\w])", text) is not None


def _sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) for every level-2 section of a markdown text."""
    parts = re.split(r"^## (.*)$", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))


def test_architecture_names_every_package():
    text = ARCHITECTURE.read_text()
    packages = _packages()
    assert any(_doc_path(p) == "glance_sgl" for p in packages), "the package walk found no glance_sgl"
    missing = []
    for pkg in packages:
        path = _doc_path(pkg)
        dotted = path.replace("/", ".")  # a nested package may be named by its import name instead
        if not (_mentions(text, path + "/") or ("." in dotted and f"`{dotted}`" in text)):
            missing.append(path + "/")
    assert not missing, f"docs/architecture.md does not name the packages {missing}"


def test_architecture_names_every_module_of_glance_sgl():
    """Each module by its path (glance_sgl/sglang/plugin.py), its dotted name, or its file name inside the
    section whose heading names its package folder (``## `glance_sgl/sglang/` ...``)."""
    text = ARCHITECTURE.read_text()
    sections = _sections(text)
    lib = next(p for p in _package_roots() if p.name == "glance_sgl")
    modules = sorted(p for p in lib.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")
                     and (p.parent / "__init__.py").is_file() and "__pycache__" not in p.parts)
    assert len(modules) > 10
    missing = []
    for mod in modules:
        path = _doc_path(mod)
        dotted = path[: -len(".py")].replace("/", ".")
        if _mentions(text, path) or _mentions(text, dotted):
            continue
        package = _doc_path(mod.parent) + "/"
        if any(_mentions(heading, package) and _mentions(body, mod.name) for heading, body in sections):
            continue
        missing.append(path)
    assert not missing, f"docs/architecture.md does not name the modules {missing} (list each in the section of " \
                        f"its package)"


def _render_module():
    spec = importlib.util.spec_from_file_location("render_benchmarks", ROOT / "scripts" / "render_benchmarks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_benchmark_tables_match_the_committed_json():
    render = _render_module()
    files = render.rendered_files(ROOT)
    assert "docs/benchmarks.md" in files and "README.md" in files
    for rel, expected in files.items():
        actual = (ROOT / rel).read_text()
        for name, (section_file, _, _) in render.SECTIONS.items():
            if section_file != rel:
                continue
            body = render.current_section(actual, name)
            assert body is not None, f"{rel}: the generated section '{name}' lost its markers"
            assert body.strip(), f"{rel}: the generated section '{name}' is empty"
            assert body == render.current_section(expected, name), (
                f"{rel}: the generated section '{name}' differs from what scripts/render_benchmarks.py renders from "
                f"docs/bench/ (numbers are not edited by hand: run `python scripts/render_benchmarks.py`)")
        assert actual == expected


def test_every_committed_bench_run_is_recorded():
    """Each run names its command and machine, and its JSON exists."""
    render = _render_module()
    runs = render.load_runs(ROOT)
    assert set(render.RUN_NAMES) <= set(runs)
    for name, run in runs.items():
        assert run["command"].split()[0].endswith(("glance", "python")), (name, run["command"])
        assert "--json" in run["command"] and run["machine"] and run["date"], (name, run)
