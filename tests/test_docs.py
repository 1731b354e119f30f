"""The documentation site: it builds under ``mkdocs build --strict``, fetches nothing from another host, and the
README is a short front page whose links into ``docs/`` resolve."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
HAS_MKDOCS = all(importlib.util.find_spec(m) for m in ("mkdocs", "material", "mkdocstrings", "mkdocs_gen_files"))


def _gen_ref():
    spec = importlib.util.spec_from_file_location("gen_ref_for_tests", ROOT / "docs" / "gen_ref.py")
    module = importlib.util.module_from_spec(spec)
    sys.argv, argv = ["gen_ref.py"], sys.argv  # not a build and not __main__: only the functions are defined
    try:
        source = (ROOT / "docs" / "gen_ref.py").read_text().split("\nif __name__ == ")[0]
        exec(compile(source, str(ROOT / "docs" / "gen_ref.py"), "exec"), module.__dict__)
    finally:
        sys.argv = argv
    return module


def test_the_readme_is_a_short_front_page_and_its_links_into_docs_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert any(link.startswith("docs/loops/") for link in local)
    for link in local:
        path, _, anchor = link.partition("#")
        target = (ROOT / path) if path else README
        assert target.exists(), f"README links to {link}, which does not exist"
        if anchor and target.suffix == ".md":
            headings = [_slug(h) for h in re.findall(r"^#+ (.+)$", target.read_text(), re.M)]
            assert anchor in headings, f"README links to {link}: no heading with that anchor"


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's toc gives a heading (its default slugify)."""
    text = re.sub(r"[`*\[\]]|\(.*?\)", lambda m: "" if m.group(0) in "`*[]" else m.group(0), heading)
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_every_section_of_the_old_readme_has_a_home():
    """The sections the README had before the site (2026-12) are pages or sections of the site (by their
    heading there: "Reproducible runs and figures over seeds" became "Seeds and intervals" and "Determinism",
    "Python API" "From Python", "Reinforcement learning with verifiable rewards" "The GRPO family", "Figures"
    "Earlier figures")."""
    pages = {p.relative_to(ROOT / "docs").as_posix(): p.read_text() for p in (ROOT / "docs").rglob("*.md")}
    homes = {
        "Set-up": "getting-started.md", "What it trains": "results.md",
        "Command line": "concepts/recipes.md", "The run directory": "concepts/run-directory.md",
        "Seeds and intervals": "concepts/seeds.md", "Determinism": "concepts/determinism.md",
        "From Python": "getting-started.md",
        "GRPO family": "loops/grpo.md", "Process supervision": "loops/grpo.md",
        "mismatch and its correction": "loops/grpo.md", "Asynchronous RL with bounded staleness": "loops/grpo.md",
        "Entropy controls and several rewards": "loops/grpo.md", "The full R1 pipeline": "loops/r1.md",
        "Reward models": "loops/reward-models.md", "Preference optimisation": "loops/preference.md",
        "Serving": "serving.md", "Comparing two models with a judge": "loops/online-dpo.md",
        "Online and iterative DPO": "loops/online-dpo.md", "Distillation": "loops/distillation.md",
        "Bulk generation": "loops/distillation.md", "Filtering": "loops/distillation.md",
        "R1-distill": "loops/distillation.md", "On-policy distillation": "loops/distillation.md",
        "Self-distillation: STaR, ReST, RAFT": "loops/distillation.md", "Best-of-n": "loops/distillation.md",
        "PPO-RLHF (InstructGPT)": "loops/ppo.md", "Constitutional AI, RLAIF and SPIN": "loops/cai.md",
        "Agentic tool-use RL and the sandbox": "loops/agents.md", "The sandbox": "loops/agents.md",
        "Reports": "reports.md", "Scaling out": "scaling.md", "Reliability": "reliability.md",
        "Performance against TRL": "performance.md", "Models": "concepts/models.md", "Data": "concepts/data.md",
        "The training loop": "concepts/training-loop.md", "Tasks": "concepts/tasks.md",
        "How the code is laid out": "concepts/layout.md", "Earlier figures": "results.md",
    }
    for section, page in homes.items():
        assert re.search(rf"^#+ .*{re.escape(section)}", pages[page], re.M | re.I), f"{section!r} not a heading of {page}"


def test_every_registry_entry_has_a_one_line_description():
    gen_ref = _gen_ref()
    assert gen_ref.undescribed_registry_entries() == []
    text = gen_ref.registries_page()
    for name in ("POLICY_LOSSES", "ADVANTAGE_ESTIMATORS", "KL_ESTIMATORS", "REWARD_FUNCTIONS", "TASKS",
                 "PREFERENCE_LOSSES", "ROLLOUT_CORRECTIONS", "DISTILLATION_DIVERGENCES", "STAGE_TYPES"):
        assert f"\n## {name}\n" in text
    assert "| `grpo` | GRPO outcome advantage" in text
    cli = gen_ref.cli_page()
    assert "## `tether run`" in cli and "`--seeds`" in cli and "## `tether grpo`" in cli


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.external: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        url = values.get("src") if tag in ("script", "img", "iframe") else values.get("href") if tag == "link" else None
        if url and re.match(r"(https?:)?//", url):
            self.external.append(f"<{tag}> {url}")


@pytest.mark.skipif(not HAS_MKDOCS, reason="the docs extra is not installed (pip install -e '.[docs]')")
def test_the_site_builds_strict_and_loads_nothing_from_another_host(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}
    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    pages = sorted(site.rglob("*.html"))
    assert len(pages) >= 30
    for page in pages:
        parser = _Links()
        parser.feed(page.read_text())
        assert parser.external == [], f"{page.relative_to(site)} loads {parser.external}"
    grpo = (site / "loops" / "grpo" / "index.html").read_text()
    assert 'class="arithmatex"' in grpo and "katex.min.js" in grpo
    for generated in ("configuration", "cli", "registries", "recipes", "api"):
        assert (site / "reference" / generated / "index.html").exists()
    assert "train_grpo" in (site / "reference" / "api" / "index.html").read_text()
    assert not (ROOT / "docs" / "reference").exists(), "the reference pages are generated, never committed"
