"""tether compare: a local model against one served over real HTTP, judged in both orders; the CLI."""

import json
import re
import socket

import pytest
from typer.testing import CliRunner

from tether.cli import app
from tether.comparison import pairwise_win_rate
from tether.models import build_tiny
from tether.rewards.judge import PairwiseJudge
from tether.rollout.engines import TextFunctionEngine
from tether.serve import BackgroundServer, create_app

JUDGE_OPTIONS = {"template": "compact-pairwise", "sampling": {"max_new_tokens": 6}}
PAIR = re.compile(r"A:(.*)\nB:(.*)\nBetter:", re.S)


def numeric_pick(judge_prompt: str) -> str:
    """A or B for the one answer made of digits only, a tie ([[C]]) otherwise: a verdict that follows the
    answers, not their positions."""
    a, b = (s.strip().isdigit() for s in PAIR.search(judge_prompt).groups())
    return "A" if a and not b else "B" if b and not a else "[[C]]"


def solver(prompts):
    """A served "model": right on even first operands, one too high on odd ones; as a judge, :func:`numeric_pick`
    (it prefers answers that look like its own)."""
    out = []
    for text in prompts:
        if "Better:" in text:
            out.append(numeric_pick(text))
            continue
        x, op, y = re.search(r"(\d+)([+\-*])(\d+)=", text).groups()
        value = {"+": int(x) + int(y), "-": int(x) - int(y), "*": int(x) * int(y)}[op]
        out.append(str(value + int(x) % 2))
    return out


@pytest.fixture(scope="module")
def served():
    _, tokenizer = build_tiny()
    app_ = create_app(engine=TextFunctionEngine(solver, tokenizer), tokenizer=tokenizer, model_name="solver")
    with BackgroundServer(app_) as server:
        yield server.base_url


def test_local_against_served_with_a_function_judge(served, tmp_path):
    asked = []

    def judge(prompts):
        asked.extend(prompts)
        return [numeric_pick(p) for p in prompts]

    out = tmp_path / "compare.json"
    figures = pairwise_win_rate("tether/tiny", served, PairwiseJudge(judge, template="compact-pairwise"), n=12,
                                max_new_tokens=6, out=out, progress=False)
    n = figures["n"]
    assert n == 12 and len(asked) == 2 * n  # every pair judged in both orders
    assert figures["a_wins"] + figures["b_wins"] + figures["ties"] == n
    assert figures["position_consistency"] == 1.0  # the judge reads answers, not positions
    assert figures["first_position_rate"] == 0.5
    assert 0 <= figures["win_rate_a_ci95_low"] <= figures["win_rate_a"] <= figures["win_rate_a_ci95_high"] <= 1
    pairs = figures["pairs"]
    assert all(p["answer_b"] == solver([p["prompt"]])[0] for p in pairs)  # B's answers came over HTTP
    assert figures["accuracy_b"] == sum(int(re.match(r"\d+", p["prompt"])[0]) % 2 == 0 for p in pairs) / n
    expected_b = sum(p["answer_b"].strip().isdigit() and not p["answer_a"].strip().isdigit() for p in pairs)
    assert figures["b_wins"] == expected_b > 0
    verifier = [1.0 if a and not b else 0.0 if b and not a else 0.5
                for a, b in ((p["correct_a"], p["correct_b"]) for p in pairs)]
    assert figures["verifier_win_rate_a"] == pytest.approx(sum(verifier) / n)
    assert "self_preference_bias" not in figures  # the judge is neither model
    written = json.loads(out.read_text())
    assert written["b_wins"] == figures["b_wins"] and len(written["pairs"]) == n


def test_a_served_model_judging_itself_shows_self_preference(served):
    figures = pairwise_win_rate("tether/tiny", served, "self:B", n=12, max_new_tokens=6, judge_options=JUDGE_OPTIONS,
                                progress=False)
    assert figures["judge_is"] == "B"
    judge_b = 1 - figures["win_rate_a"]
    verifier_b = 1 - figures["verifier_win_rate_a"]
    assert figures["self_preference_bias"] == pytest.approx(judge_b - verifier_b)
    # it prefers every numeric answer of its own, right or wrong; the verifier credits only the right ones
    assert figures["self_preference_bias"] > 0
    # the same as the judge given by its URL, the string model B was given as
    same = pairwise_win_rate("tether/tiny", served, served, n=12, max_new_tokens=6, judge_options=JUDGE_OPTIONS,
                             progress=False)
    assert same["judge_is"] == "B" and same["self_preference_bias"] == figures["self_preference_bias"]


def test_a_local_model_judging_itself():
    figures = pairwise_win_rate("tether/tiny", "tether/tiny", "self:A", n=4, max_new_tokens=4,
                                judge_options=JUDGE_OPTIONS, progress=False)
    assert figures["judge_is"] == "A" and figures["a_wins"] + figures["b_wins"] + figures["ties"] == 4
    assert figures["self_preference_bias"] == pytest.approx(figures["win_rate_a"] - figures["verifier_win_rate_a"])


def test_bad_judges_and_prompt_sets(served, tmp_path):
    with pytest.raises(ValueError, match="pairwise judge"):
        pairwise_win_rate("tether/tiny", served, "self:A", n=2, judge_options={"kind": "pointwise"}, progress=False)
    with pytest.raises(ValueError, match="self:A or self:B"):
        pairwise_win_rate("tether/tiny", served, "self:C", n=2, progress=False)
    with pytest.raises(ValueError, match="does not serve 'nope'"):
        pairwise_win_rate("tether/tiny", served + "#nope", "self:A", n=2, progress=False)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("2+2=\n3+4=\n")
    figures = pairwise_win_rate("tether/tiny", served, lambda ps: ["[[C]]"] * len(ps), prompts=prompts,
                                max_new_tokens=4, judge_options={"template": "compact-pairwise"}, progress=False)
    assert figures["n"] == 2 and figures["both_tie"] == 2 and "verifier_win_rate_a" not in figures  # no answers


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_compare(served, tmp_path):
    runner = CliRunner()
    out = tmp_path / "results.json"
    result = runner.invoke(app, ["compare", "tether/tiny", served, "--judge", "self:B", "--n", "6",
                                 "--max-new-tokens", "4", "--judge-option", "template=compact-pairwise",
                                 "--judge-option", "sampling.max_new_tokens=6", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "win rate of A (judge)" in result.output and "self-preference bias (judge = B)" in result.output
    written = json.loads(out.read_text())
    assert written["n"] == 6 and written["judge_is"] == "B" and "self_preference_bias" in written
    assert "RUN DIRECTORIES" in runner.invoke(app, ["compare", "--help"]).output

    def error(*args):
        result = runner.invoke(app, ["compare", *args, "--n", "2"])
        assert result.exit_code == 2, result.output
        assert result.output.startswith("error:") and len(result.output.strip().splitlines()) == 1, result.output
        return result.output

    assert "does not exist" in error("no/such/dir/model", served, "--judge", "self:B")
    assert "cannot reach" in error("tether/tiny", f"http://127.0.0.1:{closed_port()}/v1", "--judge", "self:A")
    assert "pairwise judge" in error("tether/tiny", served, "--judge", "self:B", "--judge-option", "kind=pointwise")
    assert "unknown key" in error("tether/tiny", served, "--judge", "self:B", "--judge-option", "tempate=x")
