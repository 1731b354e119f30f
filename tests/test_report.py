"""Run reports: a fake run directory in, one self-contained ``report.html`` out, readable offline."""

import base64
import io
import json
import logging
import re
import shutil
import subprocess

import pytest
from typer.testing import CliRunner

from tether.cli import app
from tether.report import stage_metrics, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DATA_URI = re.compile(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"')


def _tiny_png() -> bytes:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2, 2), dpi=40)
    fig.subplots().plot([0, 1], [1, 0])
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def make_run(root):
    """A run as ``tether run`` leaves it: two stages of metrics (one PPO-like, with gold, proxy and KL),
    results, samples, a top-level plot; plus a NaN (written as null), a string and a torn last line."""
    run = root / "run"
    run.mkdir()
    rows = []
    for step in (10, 20, 30):
        rows.append({"stage": "sft", "step": step, "time": 1.0, "loss": 3.0 / step, "lr": 1e-3,
                     "eval/accuracy": 0.1 * step / 10, "grad_norm": None, "note": "text"})
    for step in (1, 2, 3, 4):
        rows.append({"stage": "ppo", "step": step, "time": 2.0, "policy/loss": -0.1 * step, "kl": 0.5 * step,
                     "reward/proxy": 1.0 + step, "reward/gold": [0.1, 0.3, 0.4, 0.2][step - 1],
                     "value/loss": 1.0 / step, "always_nan": None})
    lines = [json.dumps(r) for r in rows] + ['{"stage": "ppo", "step": 5, "lo']
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run / "results.json").write_text(json.dumps({
        "pretrain": {}, "sft": {"accuracy": 0.435, "format": 0.995},
        "ppo": {"accuracy": 0.575, "gold_reward": 0.3125, "n": 200}}))
    (run / "config.yaml").write_text("name: fake-recipe\ndescription: a fake run for the report tests\n")
    (run / "ppo").mkdir()
    samples = [{"step": s, "prompt": f"{s}+1=", "completion": f"<think>{s}+1</think>{s + 1}", "reward": 0.5 * s}
               for s in (1, 2, 4)]
    (run / "ppo" / "samples.jsonl").write_text("\n".join(json.dumps(s) for s in samples) + "\n")
    (run / "overoptimization.png").write_bytes(_tiny_png())
    return run


def embedded_pngs(html: str) -> list[bytes]:
    return [base64.b64decode(m) for m in DATA_URI.findall(html)]


def test_report_is_self_contained_with_plots_per_stage_and_figures(tmp_path):
    run = make_run(tmp_path)
    path = write_report(run)
    assert path == run / "report.html"
    html = path.read_text()

    images = embedded_pngs(html)
    # sft: key curves (eval/accuracy, loss; lr never moves); ppo: key curves (kl), policy, reward, value groups +
    # gold/proxy/KL; + overoptimization.png
    assert len(images) == 1 + 5 + 1
    assert all(png.startswith(PNG_MAGIC) for png in images)
    assert html.count("<img") == len(images)  # every image is a data URI
    assert not re.search(r"https?://", html, re.IGNORECASE)
    assert not re.search(r"<link|<script src|@import|url\(", html, re.IGNORECASE)
    assert html.count('class="chart-data"') == 5 and html.count("<noscript>") == 5  # interactive, PNG fallback

    plots = sorted(p.name for p in (run / "plots").glob("*.png"))
    assert plots == ["ppo-gold-proxy-kl.png", "ppo-key.png", "ppo-policy.png", "ppo-reward.png", "ppo-value.png",
                     "sft-key.png"]
    assert (run / "plots" / "sft-key.png").read_bytes() in images
    assert "1 series that never moved (not plotted)" in html and "lr = 0.001" in html
    answer = html[html.index("<h2>The answer</h2>"):html.index("<h2>The run</h2>")]
    assert "<th>sft</th><th>accuracy</th>" in answer and "43.5%" in answer and "57.5%" in answer
    assert html.index("<h2>The answer</h2>") < html.index("<h2>The run</h2>") < html.index('id="stage-sft"')
    assert "interrupted" not in html and "not finished" in html  # no stage.json, no checkpoint in this fake run

    assert "fake-recipe" in html
    table = html[html.index('<table class="results">'):]
    table = table[:table.index("</table>")]
    assert "<th>sft</th><th>ppo</th>" in table and "pretrain" not in table  # a stage with no figures
    assert ">0.435<" in table and ">0.575<" in table and ">0.3125<" in table and ">200<" in table
    assert "Skipped 1 unreadable line(s)" in html

    samples = html[html.index('<table class="samples">'):]
    assert "&lt;think&gt;1+1&lt;/think&gt;2" in samples and "&lt;think&gt;4+1&lt;/think&gt;5" in samples
    assert "2+1=" not in samples  # only the first and last sampled steps


def test_metrics_skip_nan_and_non_numbers_and_keep_the_last_value_of_a_step():
    rows = [{"stage": "a", "step": 1, "time": 5.0, "loss": 2.0, "bad": None, "s": "x", "flag": True},
            {"stage": "a", "step": 2, "loss": float("nan"), "lr": 0.1},
            {"stage": "a", "step": 2, "loss": 1.5},  # resumed: step 2 logged again
            {"stage": "b", "loss": 9.0}]  # no step
    assert stage_metrics(rows) == {"a": {"loss": {1.0: 2.0, 2.0: 1.5}, "lr": {2.0: 0.1}}}


@pytest.mark.parametrize("content", [None, "", "\n\n"])
def test_missing_or_empty_metrics_still_write_a_report(tmp_path, content):
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    html = write_report(tmp_path).read_text()
    assert "No metrics: metrics.jsonl is " + ("missing" if content is None else "empty") in html
    assert "No evaluation figures" in html and "<img" not in html


def test_cli_report_and_missing_directory(tmp_path):
    run = make_run(tmp_path)
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert (run / "report.html").exists() and "report in" in result.output

    missing = CliRunner().invoke(app, ["report", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "no run directory" in missing.output


def test_run_recipe_writes_the_report_and_survives_a_report_failure(tmp_path, monkeypatch, caplog):
    from tether.config import StageConfig
    from tether.stages import pipeline
    from tether.stages.pipeline import run_recipe
    from tether.stages.registry import STAGE_TYPES, StageType
    from tether.trainers.metrics import MetricsLogger

    def fake_stage(cfg, run_dir, resume):
        logger = MetricsLogger(run_dir, cfg.name)
        for step in (1, 2):
            logger.log(step, {"loss": 1.0 / step})
        logger.close()
        return {"accuracy": 0.5}

    monkeypatch.setitem(STAGE_TYPES._entries, "fake", StageType(StageConfig, fake_stage))
    recipe = {"name": "fake", "stages": [{"name": "one", "type": "fake"}]}
    assert run_recipe(recipe, tmp_path / "ok") == {"one": {"accuracy": 0.5}}
    assert len(embedded_pngs((tmp_path / "ok" / "report.html").read_text())) == 1

    def broken(run_dir):
        raise RuntimeError("no plots today")

    monkeypatch.setattr(pipeline, "write_report", broken)
    with caplog.at_level(logging.WARNING, logger="tether.stages.pipeline"):
        assert run_recipe(recipe, tmp_path / "bad") == {"one": {"accuracy": 0.5}}
    assert "no plots today" in caplog.text
    assert json.loads((tmp_path / "bad" / "results.json").read_text()) == {"one": {"accuracy": 0.5}}


# ---- rendered in a real browser, with the network cut ----------------------------------------------
PROBE = """<script>window.addEventListener("load", function () {
  var images = Array.from(document.images);
  var loaded = images.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  var fetched = performance.getEntriesByType("resource")
      .filter(function (e) { return !e.name.startsWith("data:"); }).length;
  var charts = document.querySelectorAll(".charts .uplot canvas").length;
  var out = document.createElement("pre");
  out.id = "probe";
  out.textContent = "images=" + images.length + " loaded=" + loaded + " fetched=" + fetched + " charts=" + charts;
  document.body.appendChild(out);
});</script>"""
CHROMIUM_NAMES = ("chromium", "chromium-browser", "chromium-headless-shell", "headless_shell", "google-chrome")


def chromium() -> str | None:
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


def render(browser: str, page, profile) -> dict[str, int]:
    """Load ``page`` headless (every host unresolvable) and read what the probe saw once it loaded."""
    page.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    command = [browser, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
               f"--user-data-dir={profile}", "--host-resolver-rules=MAP * ~NOTFOUND",
               "--virtual-time-budget=10000", "--dump-dom", page.as_uri()]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    match = re.search(r'<pre id="probe">images=(\d+) loaded=(\d+) fetched=(\d+) charts=(\d+)', done.stdout)
    assert match, f"no probe output (exit {done.returncode}): {done.stderr[-2000:]}"
    return dict(zip(("images", "loaded", "fetched", "charts"), map(int, match.groups()), strict=True))


def test_report_renders_offline_in_headless_chromium(tmp_path):
    browser = chromium()
    if browser is None:
        pytest.skip("no Chromium binary on PATH (apt-get install chromium) to render the report headless")
    run = make_run(tmp_path)
    page = tmp_path / "rendered.html"
    shutil.copy(write_report(run), page)
    # JavaScript on: the 7 chart panels are drawn (uPlot canvases), the PNG fallbacks stay in <noscript>;
    # the images are the gold/proxy-vs-KL figure and the run's own overoptimization.png
    assert render(browser, page, tmp_path / "profile") == {"images": 2, "loaded": 2, "fetched": 0, "charts": 7}

    # The probe can fail: a broken image and an external one are seen as such.
    bad = tmp_path / "bad.html"
    bad.write_text('<html><body><img src="data:image/png;base64,AAAA">'
                   '<img src="http://example.invalid/x.png"></body></html>')
    assert render(browser, bad, tmp_path / "profile") == {"images": 2, "loaded": 0, "fetched": 1, "charts": 0}


def test_report_compares_runs_on_the_same_axes(tmp_path):
    first = make_run(tmp_path)
    second = tmp_path / "other"
    second.mkdir()
    rows = [{"stage": "sft", "step": s, "loss": 2.0 / s, "eval/accuracy": 0.2 * s / 10} for s in (10, 20, 30)]
    (second / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (second / "results.json").write_text(json.dumps({"sft": {"accuracy": 0.6, "accuracy_ci95_low": 0.5,
                                                             "accuracy_ci95_high": 0.7, "n": 100.0}}))
    result = CliRunner().invoke(app, ["report", str(first), str(second), "--out", str(tmp_path / "cmp.html")])
    assert result.exit_code == 0, result.output
    html = (tmp_path / "cmp.html").read_text()
    assert "comparison of run, other" in html and "<h3>run</h3>" in html and "<h3>other</h3>" in html
    assert "60.0% [50.0%, 70.0%]" in html
    assert 'id="stage-sft"' in html and 'id="stage-ppo"' not in html  # only the stages both runs have
    assert sorted(p.name for p in (tmp_path / "cmp-plots").glob("*.png")) == ["sft-key.png"]
    missing = CliRunner().invoke(app, ["report", str(first), str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "no run directory" in missing.output


def test_run_facts_record_the_command_versions_and_stage_times(tmp_path):
    from tether.stages.run_facts import recorded_invocation

    with recorded_invocation(tmp_path) as add_seconds:
        add_seconds("sft", 1.5)
        add_seconds("sft", 2.0)
    with pytest.raises(KeyboardInterrupt), recorded_invocation(tmp_path):
        raise KeyboardInterrupt
    facts = json.loads((tmp_path / "run.json").read_text())
    assert [i["status"] for i in facts["invocations"]] == ["finished", "interrupted"]
    assert facts["stage_seconds"] == {"sft": 3.5} and "torch" in facts["invocations"][0]["versions"]
    assert facts["invocations"][0]["command"].startswith("tether")
    html = write_report(tmp_path).read_text()
    assert "<th>sft</th><td></td><td class=\"num\">4s</td>" in html and "interrupted" in html and "torch " in html


def test_a_tiny_grpo_run_reports_the_reward_histogram_of_its_first_and_last_steps(tmp_path):
    from tether.config.rl import GRPOConfig
    from tether.models import build_tiny
    from tether.trainers.rl import RLTrainer

    def digits(prompts, completions, **columns):
        return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]

    cfg = GRPOConfig(name="grpo", data={"task": {"name": "arithmetic", "n": 16}},
                     rollout={"group_size": 4, "max_new_tokens": 6},
                     train={"max_steps": 3, "batch_size": 4, "log_every": 1, "progress": False},
                     optim={"lr": 1e-2, "schedule": "constant"}, report_to=[])
    model, tokenizer = build_tiny("tiny", seed=0)
    RLTrainer(cfg, model, tokenizer, tmp_path, reward_functions=[digits]).train()
    stored = json.loads((tmp_path / "grpo" / "rewards.json").read_text())
    assert stored["first"]["step"] < stored["last"]["step"]
    assert len(stored["first"]["rewards"]) == len(stored["last"]["rewards"]) == 16  # 4 prompts x 4 completions
    html = write_report(tmp_path).read_text()
    png = (tmp_path / "plots" / "grpo-reward-histogram.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and png in embedded_pngs(html)
    assert "grpo: rewards of the first and last training steps" in html


def test_many_lines_get_distinct_colours_and_one_legend_beside_the_panels(monkeypatch):
    import tether.report.plots as plots

    figures = []
    monkeypatch.setattr(plots, "_png", lambda fig: figures.append(fig) or b"")
    panels = {metric: {f"stage{i}": {0: 0.1 * i, 100: 0.05 * i} for i in range(13)} for metric in ("a", "b")}
    plots.small_multiples("13 stages", panels)
    fig = figures[0]
    assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in fig.axes)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [f"stage{i}" for i in range(13)]
    for ax in fig.axes[:2]:  # one colour per stage, the same in every panel
        assert len({line.get_color() for line in ax.get_lines()}) == 13
    assert [line.get_color() for line in fig.axes[0].get_lines()] == [line.get_color() for line in fig.axes[1].get_lines()]
    plots.small_multiples("3 stages", {"a": {f"s{i}": {0: 1.0, 1: 2.0} for i in range(3)}})
    assert not figures[1].legends and figures[1].axes[0].get_legend() is not None
