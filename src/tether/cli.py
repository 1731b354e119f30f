"""The ``tether`` command. It only parses arguments into configs and calls the public API."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from tether.config import ConfigError, apply_override, load_yaml, parse_overrides

DEFAULT_RECIPE = "r1-arithmetic"

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Post-training for language models: every loop, one small core.")
console = Console()

Overrides = Annotated[list[str] | None, typer.Argument(help="dotted.key=value overrides")]
OutDir = Annotated[Path | None, typer.Option("--out", help="run directory")]


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s",
                        handlers=[RichHandler(console=console, show_path=False)], force=True)
    for noisy in ("httpx", "transformers", "datasets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _fail(message: str) -> None:
    console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(2)


def _default_out(name: str) -> Path:
    return Path("runs") / f"{Path(name).stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def print_results(results: dict[str, dict]) -> None:
    table = Table(title="results")
    table.add_column("stage")
    table.add_column("figures")
    for stage, figures in results.items():
        table.add_row(stage, ", ".join(f"{k}={_fmt(v)}" for k, v in figures.items()) or "-")
    console.print(table)
    accuracies = [(s, f["accuracy"]) for s, f in results.items() if "accuracy" in f]
    befores = [(s, f["before/accuracy"]) for s, f in results.items() if "before/accuracy" in f]
    if befores:
        accuracies.insert(0, (f"before {befores[0][0]}", befores[0][1]))
    if accuracies:
        console.print("held-out accuracy: " + " -> ".join(f"{s} {a:.1%}" for s, a in accuracies))


@app.command("recipes")
def recipes_cmd() -> None:
    """List the built-in recipes."""
    from tether.pipeline import builtin_recipes, load_recipe

    table = Table(title="built-in recipes")
    table.add_column("name")
    table.add_column("description")
    for name in sorted(builtin_recipes()):
        table.add_row(name + (" (default)" if name == DEFAULT_RECIPE else ""),
                      str(load_recipe(name).get("description", "")))
    console.print(table)


@app.command("run")
def run_cmd(
    recipe: Annotated[str | None, typer.Argument(help="built-in recipe name or YAML file")] = None,
    overrides: Overrides = None,
    out: OutDir = None,
    resume: Annotated[bool, typer.Option(help="resume an interrupted stage from its checkpoint")] = True,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run a recipe (default: the R1-style default recipe) and print accuracy before and after."""
    from tether.pipeline import apply_recipe_overrides, load_recipe, run_recipe

    _setup_logging(verbose)
    overrides = list(overrides or [])
    if recipe is not None and "=" in recipe:
        overrides.insert(0, recipe)
        recipe = None
    recipe = recipe or DEFAULT_RECIPE
    try:
        data = apply_recipe_overrides(load_recipe(recipe), overrides)
        run_dir = out or _default_out(data.get("name", recipe))
        console.print(f"[bold]tether run[/] {data.get('name', recipe)} -> {run_dir}")
        start = time.perf_counter()
        results = run_recipe(data, run_dir, resume=resume)
    except ConfigError as err:
        _fail(str(err))
        return
    print_results(results)
    console.print(f"done in {time.perf_counter() - start:.0f}s; results in {run_dir / 'results.json'}")


def _run_single_stage(stage_type: str, config: Path, overrides: list[str] | None, out: Path | None,
                      resume: bool, verbose: bool) -> None:
    from tether.pipeline import run_recipe

    _setup_logging(verbose)
    try:
        data = load_yaml(config)
        data.setdefault("type", stage_type)
        if data["type"] != stage_type:
            raise ConfigError(f"{config}: type is {data['type']!r} but the command is {stage_type!r}")
        data.setdefault("name", stage_type)
        for key, value in parse_overrides(list(overrides or [])):
            apply_override(data, key, value)
        run_dir = out or _default_out(f"{stage_type}")
        results = run_recipe({"name": stage_type, "stages": [data]}, run_dir, resume=resume)
    except ConfigError as err:
        _fail(str(err))
        return
    print_results(results)
    console.print(f"model in {run_dir / data['name']}")


def _stage_command(stage_type: str, help_text: str) -> None:
    def command(
        config: Annotated[Path, typer.Option("--config", "-c", help="stage config YAML")],
        overrides: Overrides = None,
        out: OutDir = None,
        resume: Annotated[bool, typer.Option(help="resume from the last checkpoint")] = False,
        verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
    ) -> None:
        _run_single_stage(stage_type, config, overrides, out, resume, verbose)

    command.__doc__ = help_text
    app.command(stage_type)(command)


_stage_command("pretrain", "Pretrain (next-token on raw text) from a config file.")
_stage_command("sft", "Supervised fine-tuning (prompt masked) from a config file.")
_stage_command("rm", "Reward model (Bradley-Terry on pairs; process: true for a PRM) from a config file.")
_stage_command("dpo", "Offline preference optimisation (DPO, IPO, cDPO, hinge, RPO, SimPO, ORPO, SPPO, KTO) "
               "from a config file.")
_stage_command("grpo", "Critic-free RL (GRPO, Dr. GRPO, RLOO, REINFORCE, REINFORCE++, ReMax, DAPO); "
               "pick a preset with algorithm=NAME.")


@app.command("eval")
def eval_cmd(
    model: Annotated[str, typer.Option(help="checkpoint path, hub id or tether/tiny")],
    task: Annotated[str, typer.Option(help="task name")] = "arithmetic",
    n: Annotated[int, typer.Option(help="held-out problems")] = 200,
    samples: Annotated[int, typer.Option("--samples", "-k", help="k for pass@k (1 = greedy only)")] = 1,
    temperature: float = 1.0,
    max_new_tokens: int = 64,
    option: Annotated[list[str] | None, typer.Option("--option", help="task option key=value")] = None,
    chat: Annotated[bool, typer.Option(help="wrap prompts in the chat template")] = False,
    out: Annotated[Path | None, typer.Option("--out", help="write the figures as JSON")] = None,
) -> None:
    """Evaluate a model on a task's held-out split: greedy accuracy and pass@k."""
    from tether.stages import evaluate

    _setup_logging(False)
    options = dict(parse_overrides(list(option or [])))
    cfg = {"model": {"name_or_path": model},
           "eval": {"task": task, "options": options, "n": n, "samples": samples, "temperature": temperature,
                    "max_new_tokens": max_new_tokens, "chat": chat}}
    try:
        figures = evaluate(cfg)
    except (ConfigError, ValueError) as err:
        _fail(str(err))
        return
    print_results({"eval": figures})
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(figures, indent=2))


@app.command("generate")
def generate_cmd(
    model: Annotated[str, typer.Option(help="checkpoint path, hub id or tether/tiny")],
    prompts: Annotated[Path, typer.Option(help="jsonl with a 'prompt' field, or a text file (one per line)")],
    out: Annotated[Path, typer.Option(help="output jsonl")] = Path("generations.jsonl"),
    n: Annotated[int, typer.Option(help="samples per prompt")] = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = 128,
    greedy: bool = False,
    seed: int | None = None,
    chat: Annotated[bool, typer.Option(help="wrap prompts in the chat template")] = False,
    batch_size: int = 64,
) -> None:
    """Sample completions for a file of prompts; writes jsonl."""
    from tether.generation import generate_file

    _setup_logging(False)
    try:
        count = generate_file(model, prompts, out, n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                              max_new_tokens=max_new_tokens, greedy=greedy, seed=seed, chat=chat,
                              batch_size=batch_size)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        _fail(str(err))
        return
    console.print(f"wrote {count} completions to {out}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
