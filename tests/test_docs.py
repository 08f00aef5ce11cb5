"""The repo's own docs keep up with the code: every config key and metric family is documented,
links between the docs land on a heading, and nothing cites a document outside the repo."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin

from pydantic import BaseModel

from kilolined.core.config import Config, parse_config
from kilolined.ops.runtime import Runtime

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

# A dotted key in backticks, with <placeholders> for names the operator picks: `routes.<r>.path`.
_DOC_KEY = re.compile(r"`([a-z_]+(?:\.(?:<[a-z]+>|[a-z0-9_]+))+)`")
_LINK = re.compile(r"\]\(([^)\s]*)\)")


def _models(tp: Any) -> Iterator[tuple[type[BaseModel], str]]:
    """The config models inside an annotation, with the path segment a dict adds (``.*``)."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        yield tp, ""
        return
    origin, args = get_origin(tp), get_args(tp)
    if origin is dict:
        for model, suffix in _models(args[1]):
            yield model, ".*" + suffix
    elif origin is Annotated:
        yield from _models(args[0])
    else:  # unions, lists; Literal's arguments are values, not types, and yield nothing
        for a in args:
            yield from _models(a)


def schema_keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every key the config accepts, as ``routes.*.rate.per_minute``."""
    out: set[str] = set()
    for name, field in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        out.add(path)
        for sub, suffix in _models(field.annotation):
            out |= schema_keys(sub, path + suffix)
    return out


def documented_keys(text: str) -> set[str]:
    return {re.sub(r"<[a-z]+>", "*", m) for m in _DOC_KEY.findall(text)}


def test_schema_walk_sees_nested_and_per_name_keys() -> None:
    # The walk itself must reach into dicts of models and optional models, or the next test
    # would pass on a half-empty set.
    keys = schema_keys(Config)
    assert {"server.listen", "server.tls.cert", "routes.*.rate.per_minute", "nodes.*.health.fall",
            "keys.*.budget.tokens_per_day", "notify.telegram.bot_token", "jobs.webhook_backoff_sec"} <= keys


def test_every_config_key_is_in_config_md() -> None:
    text = (DOCS / "CONFIG.md").read_text()
    documented = documented_keys(text)
    headings = {h.strip() for h in re.findall(r"(?m)^## (.+)$", text)}
    missing = sorted(k for k in schema_keys(Config) if (k not in headings if "." not in k else k not in documented))
    assert not missing, f"docs/CONFIG.md does not document: {missing}"


def metric_families() -> set[str]:
    """Family names as a scrape shows them (``# TYPE`` lines), without prometheus-client's
    ``*_created`` companions."""
    cfg = parse_config(
        'nodes: {a: {url: "http://127.0.0.1:9"}}\nroutes: {r: {path: /r, nodes: [a]}}\n', env={}
    )
    text = Runtime(cfg, "0" * 64).metrics.render().decode()
    names = set(re.findall(r"(?m)^# TYPE (\S+) \S+$", text))
    return {n for n in names if not n.endswith("_created")}


def test_every_metric_family_is_in_metrics_md() -> None:
    families = metric_families()
    assert "kiloline_requests_total" in families and "kiloline_queue_depth" in families
    text = (DOCS / "METRICS.md").read_text()
    missing = sorted(n for n in families if f"`{n}`" not in text)
    assert not missing, f"docs/METRICS.md does not document: {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"(?m)^#{1,6} (.+)$", path.read_text())}


def test_links_between_docs_land_on_a_heading() -> None:
    bad = []
    for src in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for target in _LINK.findall(src.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (src.parent / file_part).resolve() if file_part else src
            if not dest.exists():
                continue  # a doc another change adds (docs/SECURITY.md, docs/ARCHITECTURE.md)
            if anchor and anchor not in _anchors(dest):
                bad.append(f"{src.relative_to(ROOT)} -> {target}")
    assert not bad, f"links to missing headings: {bad}"


OUTSIDE = ("../shared", "SPEC §", "PROTOCOLS §")


def test_nothing_cites_documents_outside_the_repo() -> None:
    files = [ROOT / "README.md", *DOCS.rglob("*.md"),
             *(p for p in (ROOT / "kilolined").rglob("*") if p.suffix in (".py", ".html", ".md", ".js"))]
    hits = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
            for p in files for n, line in enumerate(p.read_text().splitlines(), 1)
            if any(o in line for o in OUTSIDE)]
    assert not hits, "\n".join(hits)


# --- `kilolined check` as docs/CONFIG.md shows it --------------------------------------------------

EXAMPLE_ENV = {"KILOLINE_ADMIN_KEY": "kl_docs_admin_key_0000000000", "ALICE_KEY": "kl_docs_alice_key_0000000000",
               "BOB_KEY": "kl_docs_bob_key_00000000000000"}


def check_transcript() -> list[tuple[str, list[str]]]:
    """The ``$ kilolined check -c FILE`` sessions under "Checking a file": (FILE, printed lines)."""
    text = (DOCS / "CONFIG.md").read_text()
    section = text.split("### Checking a file", 1)[1]
    block = section.split("```", 2)[1]
    sessions: list[tuple[str, list[str]]] = []
    for line in block.strip().splitlines():
        m = re.fullmatch(r"\$ kilolined check -c (\S+)", line)
        if m:
            sessions.append((m.group(1), []))
        else:
            sessions[-1][1].append(line)
    return sessions


def run_check(path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **EXAMPLE_ENV}
    env.pop("KILOLINE_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "kilolined", "check", "-c", str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def test_config_md_shows_what_check_prints_for_a_valid_file(tmp_path: Path) -> None:
    shown_path, shown = check_transcript()[0]
    copy = tmp_path / "kiloline.yaml"
    copy.write_bytes((ROOT / "etc" / "kiloline.yaml").read_bytes())
    r = run_check(copy)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.replace(str(copy), shown_path).splitlines() == shown


def test_config_md_shows_what_check_prints_for_a_broken_file(tmp_path: Path) -> None:
    """The broken file of the transcript is the example with the two mistakes its lines name;
    check prints both, a schema error and a cross-reference, in one run."""
    shown_path, shown = check_transcript()[1]
    text = (ROOT / "etc" / "kiloline.yaml").read_text()
    for good, bad in (("    max_concurrency: 1 ", "    max_concurrency: 0 "),
                      ("nodes: [vast-8410-tts]", "nodes: [vast-841]")):
        assert text.count(good) == 1, good
        text = text.replace(good, bad)
    broken = tmp_path / "broken.yaml"
    broken.write_text(text)
    r = run_check(broken)
    assert r.returncode == 1
    assert r.stdout.replace(str(broken), shown_path).splitlines() == shown


def _prose_lines(path: Path) -> Iterator[tuple[int, str]]:
    """The lines of a markdown file outside fenced code blocks (transcripts quote ids and hashes
    of their own: prompt ids, config versions)."""
    fence = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
        elif not fence:
            yield n, line


_ISSUE = re.compile(r"\bissue\s*#?\d+", re.I)
# 7-12 hex digits standing alone, with a letter and a digit: how a commit is cited ("f9361e5").
# Not inside a JSON string ("prompt_id": "52a45372") or a longer token (a sha256, a uuid).
_COMMIT = re.compile(r"(?<![\w./#:\"-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}(?![\w\"-])")


def _doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def test_docs_cite_no_issue_or_commit() -> None:
    """The docs are read by someone with only the repo: no tracker issue, no commit hash."""
    found = [f"{p.relative_to(ROOT)}:{n}: {m.group()}" for p in _doc_files() for n, line in _prose_lines(p)
             for m in (*_ISSUE.finditer(line), *_COMMIT.finditer(line))]
    assert not found, "\n".join(found)


def _broken_tables(path: Path) -> Iterator[str]:
    """Tables a renderer shows as raw ``|`` text: no blank line before, or no separator row."""
    lines = list(_prose_lines(path))
    i = 0
    while i < len(lines):
        n, line = lines[i]
        if not line.lstrip().startswith("|"):
            i += 1
            continue
        start = i
        while i < len(lines) and lines[i][1].lstrip().startswith("|") and lines[i][0] == n + (i - start):
            i += 1
        before = lines[start - 1][1] if start and lines[start - 1][0] == n - 1 else ""
        sep = lines[start + 1][1] if start + 1 < len(lines) else ""
        if before.strip() or not re.fullmatch(r"\s*\|(\s*:?-{3,}:?\s*\|)+\s*", sep):
            yield f"{path.relative_to(ROOT)}:{n}: {line[:60]}"


def test_every_table_renders() -> None:
    broken = [b for p in _doc_files() for b in _broken_tables(p)]
    assert not broken, "\n".join(broken)
