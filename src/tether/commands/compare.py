"""``tether compare MODEL_A MODEL_B --judge JUDGE``: a judge's win rate between two models
(:func:`tether.comparison.pairwise_win_rate`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from tether.commands import fail
from tether.console import console


def _percent(figures: dict[str, Any], key: str) -> str:
    value = figures.get(key)
    if value is None:
        return "-"
    low, high = figures.get(f"{key}_ci95_low"), figures.get(f"{key}_ci95_high")
    return f"{value:.1%}" + (f" [{low:.1%}, {high:.1%}]" if low is not None else "")


def print_comparison(figures: dict[str, Any]) -> None:
    """The figures of a comparison as a table (rates as percentages with their 95% intervals)."""
    table = Table(title=f"A = {figures['model_a']}  vs  B = {figures['model_b']}  (judge: {figures['judge']})")
    table.add_column("figure")
    table.add_column("value")
    n = figures["n"]
    table.add_row("prompts", str(n))
    table.add_row("A wins / B wins / ties", f"{figures['a_wins']} / {figures['b_wins']} / {figures['ties']} "
                  f"(inconsistent {figures['inconsistent']}, both tie {figures['both_tie']}, "
                  f"unparseable {figures['unparseable']})")
    table.add_row("win rate of A (judge)", _percent(figures, "win_rate_a"))
    table.add_row("position consistency", _percent(figures, "position_consistency"))
    table.add_row("first-position rate", _percent(figures, "first_position_rate"))
    if "verifier_win_rate_a" in figures:
        table.add_row("accuracy A / B", f"{figures['accuracy_a']:.1%} / {figures['accuracy_b']:.1%}")
        table.add_row("win rate of A (verifier)", _percent(figures, "verifier_win_rate_a"))
        table.add_row("judge agrees with verifier", f"{_percent(figures, 'judge_verifier_agreement')} "
                      f"(on {figures['judge_verifier_decided']} pairs both decide)")
    if "self_preference_bias" in figures:
        table.add_row(f"self-preference bias (judge = {figures['judge_is']})", f"{figures['self_preference_bias']:+.1%}")
    console.print(table)


def compare_cmd(
    model_a: Annotated[str, typer.Argument(help="model A: a checkpoint, hub id or tether/tiny, or a served model: "
                                                "http://HOST:PORT/v1 (its one model) or http://HOST:PORT/v1#MODEL_ID")],
    model_b: Annotated[str, typer.Argument(help="model B, the same forms")],
    judge: Annotated[str, typer.Option(help="self:A or self:B (that model judges: self-preference is measured), a "
                                            "checkpoint, an endpoint URL[#MODEL_ID], or package.module:function")],
    task: Annotated[str, typer.Option(help="task: its held-out problems are the prompts, its checker the verifier")]
    = "arithmetic",
    option: Annotated[list[str] | None, typer.Option("--option", help="task option key=value")] = None,
    prompts: Annotated[Path | None, typer.Option(help="prompts file instead of the task's problems (jsonl / parquet "
                                                      "with 'prompt', and 'answer' for the verifier; or .txt)")] = None,
    n: Annotated[int, typer.Option(help="prompts compared")] = 100,
    seed: Annotated[int, typer.Option(help="which held-out problems; the sampling seed")] = 0,
    max_new_tokens: Annotated[int, typer.Option(help="tokens per answer at most")] = 64,
    temperature: Annotated[float, typer.Option(help="0: greedy answers")] = 0.0,
    prompt_template: Annotated[str, typer.Option(help="the models' prompt, e.g. '{prompt}<think>' (the judge sees "
                                                      "the bare problem)")] = "{prompt}",
    chat: Annotated[bool, typer.Option(help="wrap the models' prompts in the chat template")] = False,
    judge_option: Annotated[list[str] | None, typer.Option(help="judge option key=value (JudgeConfig fields), e.g. "
                                                                "template=compact-pairwise sampling.max_new_tokens=8")]
    = None,
    api_key_env: Annotated[str | None, typer.Option(help="endpoints: variable holding the API key")] = None,
    batch_size: Annotated[int, typer.Option(help="prompts per engine and judge call")] = 32,
    out: Annotated[Path | None, typer.Option(help="write the figures and every pair as JSON")] = None,
) -> None:
    """Compare two MODELS on the same prompts with a pairwise judge asked in both orders: A's win rate with
    its 95% interval, position consistency, first-position rate, the verifier's win rate and, when the judge
    is one of them, its self-preference bias. (To compare finished RUN DIRECTORIES, use tether report A B.)"""
    from tether.config.base import ConfigError, apply_override, parse_overrides
    from tether.data.schemas import DataError
    from tether.rollout.openai_engine import EndpointError

    try:
        from tether.comparison import pairwise_win_rate

        judge_options: dict[str, Any] = {}
        for key, value in parse_overrides(list(judge_option or [])):
            apply_override(judge_options, key, value)
        figures = pairwise_win_rate(model_a, model_b, judge, task=task,
                                    task_options=dict(parse_overrides(list(option or []))), prompts=prompts, n=n,
                                    seed=seed, prompt_template=prompt_template, max_new_tokens=max_new_tokens,
                                    temperature=temperature, chat=chat, judge_options=judge_options,
                                    api_key_env=api_key_env, batch_size=batch_size, out=out)
    except (ConfigError, DataError, ValueError, FileNotFoundError, EndpointError) as err:
        fail(str(err))
        return
    print_comparison(figures)
    if out is not None:
        console.print(f"figures and every pair in {out}")
