"""Untrusted model output never reaches the host as markup, paths or commands: completions (and anything else
a run logs) are escaped in report.html, samples stay one JSON record each, names derived from run contents
are plain file names, and the sandbox's adversarial suite runs in the default test selection (CI)."""

import json
import re
from html.parser import HTMLParser
from pathlib import Path

from tether.report import safe_name, write_report
from tether.trainers.metrics import MetricsLogger

HOSTILE = [
    "<script>alert('xss')</script>",
    '"><img src=x onerror="alert(1)">',
    "</td></tr></table><iframe src=javascript:alert(1)></iframe>",
    "<!-- a comment that never ends",
    "<style>body{display:none}</style>",
    "&lt;script&gt; already escaped once",
    "line\u2028separator\u2029and\x00nul and \u202eright-to-left",
    "<svg/onload=alert(1)>",
    "$\\frac{unbalanced mathtext",
]
ALLOWED_TAGS = {"html", "head", "meta", "title", "style", "body", "h1", "h2", "h3", "p", "table", "tr", "th",
                "td", "figure", "img", "figcaption", "details", "summary", "pre", "span", "script", "noscript"}
CHART_DATA = re.compile(r'<script type="application/json" class="chart-data">(.*?)</script>', re.S)


class Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.text = ""

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text += data


def hostile_run(root: Path) -> Path:
    run = root / "run"
    (run / "grpo").mkdir(parents=True)
    rows = [{"stage": "grpo", "step": s, "loss": 1.0 / s, "reward/" + HOSTILE[1]: 0.5 * s, HOSTILE[8]: 0.1 * s}
            for s in (1, 2)]
    rows.append({"stage": HOSTILE[0], "step": 1, "loss": 1.0})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (run / "results.json").write_text(json.dumps({"grpo": {"accuracy": 0.5, HOSTILE[2]: HOSTILE[3]}}))
    (run / "config.yaml").write_text(json.dumps({"name": HOSTILE[4], "description": HOSTILE[5]}))
    logger = MetricsLogger(run, "grpo")
    logger.write_samples(1, [{"prompt": p, "completion": c, "reward": 0.0}
                             for p, c in zip(HOSTILE, reversed(HOSTILE), strict=True)])
    logger.write_samples(2, [{"prompt": "2+2=", "completion": text, "reward": 1.0} for text in HOSTILE])
    logger.close()
    return run


def test_report_escapes_completions_names_and_figures(tmp_path):
    run = hostile_run(tmp_path)
    page = write_report(run).read_text(encoding="utf-8")
    parser = Tags()
    parser.feed(page)
    tags = {tag for tag, _ in parser.tags}
    assert tags <= ALLOWED_TAGS, tags - ALLOWED_TAGS
    for tag, attrs in parser.tags:
        assert not any(name.startswith("on") for name in attrs), (tag, attrs)
        if tag == "img":
            assert attrs["src"].startswith("data:image/png;base64,"), attrs["src"][:60]
    assert page.count("<style>") == 2 and "<iframe" not in page.lower()  # ours and the charting library's
    # the only scripts: the charting library and its init (no attributes), and data blocks that are pure JSON
    # with no "<" in them, so no logged name can end a script element or start one
    scripts = [attrs for tag, attrs in parser.tags if tag == "script"]
    blocks = CHART_DATA.findall(page)
    assert blocks and len(scripts) == 2 + len(blocks)
    assert all(attrs in ({}, {"type": "application/json", "class": "chart-data"}) for attrs in scripts)
    assert page.lower().count("<script") == page.lower().count("</script>") == len(scripts)
    for block in blocks:
        assert "<" not in block and ">" not in block and json.loads(block)["panels"]
    names = {panel["name"] for block in blocks for panel in json.loads(block)["panels"]}
    assert "reward/" + HOSTILE[1] in names and HOSTILE[8] in names  # intact, only escaped
    # every hostile string is on the page as text, exactly as the model wrote it
    for text in HOSTILE[:6]:
        assert text in parser.text, text
    assert "&lt;script&gt;alert(&#x27;xss&#x27;)&lt;/script&gt;" in page


def test_samples_stay_one_json_record_each(tmp_path):
    logger = MetricsLogger(tmp_path, "grpo")
    logger.write_samples(3, [{"prompt": "p", "completion": text, "reward": 0.0} for text in [*HOSTILE, "a\nb\r\nc"]])
    logger.close()
    lines = (tmp_path / "grpo" / "samples.jsonl").read_text(encoding="utf-8").split("\n")
    records = [json.loads(line) for line in lines if line]
    assert [r["completion"] for r in records] == [*HOSTILE, "a\nb\r\nc"]


def test_names_from_run_contents_are_plain_file_names():
    for text in [*HOSTILE, "../../etc/passwd", "/abs/path", "..", ".", "", "a/b\\c", "con:"]:
        name = safe_name(text)
        assert name and "/" not in name and "\\" not in name and name not in (".", "..")
        assert not name.startswith(".") and Path(name).name == name


def test_the_sandbox_adversarial_suite_runs_by_default():
    """Issue 10's suite (fork bombs, memory, file system, network, environment, shells) must not be
    deselected by the default ``-m 'not slow'``: it is the CI check that model-written code stays contained."""
    suite = Path(__file__).parents[1] / "runtime" / "test_sandbox.py"
    text = suite.read_text()
    assert "mark.slow" not in text and "pytestmark" not in text
    for name in ("fork_bomb", "memory_limit", "writing_outside", "network", "environment", "shell"):
        assert f"def test_{name}" in text or f"_{name}" in text, name
