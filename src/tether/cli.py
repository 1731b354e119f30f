"""The ``tether`` command. It only parses arguments into configs and calls the public API."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.logging import RichHandler
from rich.table import Table

from tether.commands import fail
from tether.commands.compare import compare_cmd
from tether.commands.seeds import run_seeds_command
from tether.config.base import ConfigError, apply_override, load_yaml, parse_overrides
from tether.console import console, print_results

DEFAULT_RECIPE = "r1-arithmetic"

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Post-training for language models: every loop, one small core.")

Overrides = Annotated[list[str] | None, typer.Argument(help="dotted.key=value overrides")]
OutDir = Annotated[Path | None, typer.Option("--out", help="run directory")]


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s",
                        handlers=[RichHandler(console=console, show_path=False)], force=True)
    for noisy in ("httpx", "transformers", "datasets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _disk_full(err: OSError, run_dir: Path | None) -> None:
    """A full disk outside a checkpoint write (metrics, samples, the exported model): one line, exit 2;
    anything else is re-raised."""
    from tether.trainers.checkpoint import disk_full_reason

    reason = disk_full_reason(err, Path(run_dir or "."))
    if reason is None:
        raise err
    fail(f"{reason}: {err}; free space, then run the same command with --resume")


def resume_command(argv: list[str], run_dir: Path) -> str:
    """The command line that continues an interrupted run: the same arguments with ``--out`` (a
    default run directory has a timestamp, so re-running without it would start over) and ``--resume``."""
    import shlex

    args = [a for a in argv if a != "--no-resume"]
    if not any(a == "--out" or a.startswith("--out=") for a in args):
        args += ["--out", str(run_dir)]
    if "--resume" not in args:
        args.append("--resume")
    return shlex.join(["tether", *args])


def _stopped(err: KeyboardInterrupt, run_dir: Path | None) -> None:
    """A run stopped by SIGINT / SIGTERM (after a checkpoint) or a second signal (at once): say how to resume."""
    import signal
    import sys

    from rich.markup import escape

    console.print(f"[bold yellow]interrupted:[/] {escape(str(err) or 'KeyboardInterrupt')}")
    if run_dir is not None:
        console.print(f"resume with: {resume_command(sys.argv[1:], run_dir)}", soft_wrap=True, markup=False,
                      highlight=False)
    raise typer.Exit(128 + int(getattr(signal, getattr(err, "signal_name", "SIGINT"), signal.SIGINT)))


def _training_errors() -> tuple[type[Exception], ...]:
    """Errors that end a run with a message and no traceback: bad data rows, missing files, models that do
    not load, bad checkpoints, an unwritable or full output directory, too many non-finite steps."""
    from tether.data.schemas import DataError
    from tether.models.loading import ModelLoadError
    from tether.trainers.checkpoint import CheckpointError
    from tether.trainers.loop import NonFiniteError

    return DataError, FileNotFoundError, ModelLoadError, CheckpointError, NonFiniteError


def _end_run(err: BaseException, run_dir: Path | None) -> None:
    """A run that cannot go on, in one line and an exit code: a bad config, data or checkpoint (2), a full
    disk (2, anything else from the OS re-raised), a stop signal (128 + its number, with how to resume)."""
    if isinstance(err, (ConfigError, *_training_errors())):
        fail(str(err))
    elif isinstance(err, KeyboardInterrupt):
        _stopped(err, run_dir)
    elif isinstance(err, OSError):
        _disk_full(err, run_dir)
    raise err


def _default_out(name: str) -> Path:
    return Path("runs") / f"{Path(name).stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def latest_unfinished_run(name: str, root: Path = Path("runs")) -> Path | None:
    """The newest ``root/NAME-<timestamp>`` run directory that holds a stage not marked finished (or no
    results yet); None when there is none."""
    from tether.trainers.checkpoint import read_done

    candidates = sorted(root.glob(f"{Path(name).stem}-[0-9]*-[0-9]*"), reverse=True) if root.is_dir() else []
    for run in candidates:
        stages = [d for d in run.iterdir() if d.is_dir() and (d / "stage_config.json").exists()]
        if not (run / "results.json").exists() or any(read_done(d) is None for d in stages):
            return run
    return None


@app.command("recipes")
def recipes_cmd() -> None:
    """List the built-in recipes."""
    from tether.stages.recipes import builtin_recipes, load_recipe

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
    resume: Annotated[bool | None, typer.Option(
        "--resume/--no-resume", help="resume interrupted stages from their checkpoints (the default); --resume "
                                     "without --out continues the newest unfinished run of the recipe in runs/")]
    = None,
    constitution: Annotated[str | None, typer.Option(
        "--constitution", help="constitution file (YAML or text) for the stages that sample principles")] = None,
    seeds: Annotated[str | None, typer.Option(
        "--seeds", help="run once per seed into DIR/seed-K/ and summarise: a count (5) or a list (0,3,7; one seed: 3,)")] = None,
    parallel: Annotated[int, typer.Option("--parallel", help="with --seeds: seeds run at once")] = 1,
    deterministic: Annotated[bool, typer.Option(
        "--deterministic", help="also pin MKL's code path (bitwise reproducible at any thread count, slower) "
                                "and torch's deterministic algorithms")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="check everything and print the plan; train nothing")]
    = False,
    stages: Annotated[str | None, typer.Option(
        "--stages", help="run only these stages (comma-separated) and the earlier ones they use (@stage)")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run a recipe (default: the R1-style default recipe) and print accuracy before and after."""
    if deterministic:  # before anything imports torch: MKL reads MKL_CBWR when it loads
        from tether.core.determinism import enable_determinism

        for warning in enable_determinism():
            console.print(f"[yellow]warning:[/] {warning}")
    from tether.stages.pipeline import run_recipe
    from tether.stages.recipes import apply_recipe_overrides, load_recipe, select_stages

    _setup_logging(verbose)
    overrides = list(overrides or [])
    if recipe is not None and "=" in recipe:
        overrides.insert(0, recipe)
        recipe = None
    recipe = recipe or DEFAULT_RECIPE
    run_dir = out
    try:
        data = apply_recipe_overrides(load_recipe(recipe), overrides)
        if constitution is not None:
            from tether.stages.cai import with_constitution

            try:
                data = with_constitution(data, constitution)
            except ValueError as err:
                raise ConfigError(str(err)) from None
        if stages is not None:
            data = select_stages(data, [name.strip() for name in stages.split(",") if name.strip()])
        if out is None and resume:
            out = latest_unfinished_run(data.get("name", recipe))
            if out is None:
                raise ConfigError(f"--resume without --out: no unfinished run of {data.get('name', recipe)!r} in "
                                  "runs/ (start one without --resume, or name it with --out)")
            console.print(f"resuming the newest unfinished run of {data.get('name', recipe)}: {out}")
        resume = resume is not False
        run_dir = out or _default_out(data.get("name", recipe))
        if dry_run:
            from tether.console import print_plan
            from tether.stages.pipeline import plan_recipe

            print_plan(data.get("name", recipe), run_dir, plan_recipe(data, run_dir))
            return
        start = time.perf_counter()
        if seeds is not None:
            run_seeds_command(data, run_dir, seeds, parallel=parallel, resume=resume, deterministic=deterministic)
            return
        console.print(f"[bold]tether run[/] {data.get('name', recipe)} -> {run_dir}")
        results = run_recipe(data, run_dir, resume=resume)
    except (ConfigError, OSError, KeyboardInterrupt, *_training_errors()) as err:
        _end_run(err, run_dir)
        return
    print_results(results)
    console.print(f"done in {time.perf_counter() - start:.0f}s; results in {run_dir / 'results.json'}")
    if (run_dir / "report.html").exists():
        console.print(f"report in {run_dir / 'report.html'}")


def _run_single_stage(stage_type: str, config: Path, overrides: list[str] | None, out: Path | None,
                      resume: bool, verbose: bool) -> None:
    from tether.stages.pipeline import run_recipe

    _setup_logging(verbose)
    run_dir = out
    try:
        data = load_yaml(config)
        data.setdefault("type", stage_type)
        if data["type"] != stage_type:
            raise ConfigError(f"{config}: type is {data['type']!r} but the command is {stage_type!r}")
        data.setdefault("name", stage_type)
        for key, value in parse_overrides(list(overrides or [])):  # as in a recipe, `dpo.loss=x` may name the stage
            apply_override(data, key if data["name"] in data else key.removeprefix(f"{data['name']}."), value)
        run_dir = out or _default_out(f"{stage_type}")
        results = run_recipe({"name": stage_type, "stages": [data]}, run_dir, resume=resume)
    except (ConfigError, OSError, KeyboardInterrupt, *_training_errors()) as err:
        _end_run(err, run_dir)
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
_stage_command("ppo", "PPO-RLHF with a critic (InstructGPT): GAE, per-token KL in the reward, clipped value "
               "loss; kl.controller=adaptive for a target KL.")
_stage_command("agent_sft", "SFT warm-up on tool-use demonstrations of an environment (tool messages masked).")
_stage_command("agent", "Multi-turn tool-use RL in a sandboxed tool environment (GRPO family, optional GiGPO).")
_stage_command("sl_cai", "SL-CAI: answer -> critique -> revise against a constitution (constitution=FILE), "
               "then SFT on the revisions.")
_stage_command("ai_labels", "RLAIF labels: two samples per prompt judged in both orders against a sampled principle.")
_stage_command("spin", "SPIN: DPO iterations, SFT demonstrations against the model's own generations.")
app.command("compare")(compare_cmd)  # in tether.commands: this file is at its line limit


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
    best_of: Annotated[str | None, typer.Option(help="best-of-n accuracy for these n, e.g. 1,2,4,8,16")] = None,
    scorer: Annotated[list[str] | None, typer.Option(help="best-of-n scorer: verifier, rm, judge (repeatable)")]
    = None,
    reward_model: Annotated[str | None, typer.Option(help="reward model directory for --scorer rm")] = None,
    plot: Annotated[Path | None, typer.Option(help="best-of-n: save accuracy against n as a PNG")] = None,
    scorer_option: Annotated[list[str] | None, typer.Option(help="best-of-n judge option key=value")] = None,
    metrics: Annotated[str | None, typer.Option(help="extra metrics: distinct, length_by_outcome, reflection, "
                                                     "perplexity, likelihood_reward_agreement (with -k > 1)")]
    = None,
) -> None:
    """Evaluate a model on a task's held-out split: greedy accuracy, pass@k and maj@k, text and likelihood
    metrics, or best-of-n against n."""
    from tether.stages import evaluate

    _setup_logging(False)
    options = dict(parse_overrides(list(option or [])))
    cfg = {"model": {"name_or_path": model},
           "eval": {"task": task, "options": options, "n": n, "samples": samples, "temperature": temperature,
                    "max_new_tokens": max_new_tokens, "chat": chat,
                    "metrics": [m.strip() for m in (metrics or "").split(",") if m.strip()]}}
    try:
        if best_of:
            judge = dict(parse_overrides(list(scorer_option or [])))
            figures = _best_of_n_eval(model, cfg["eval"], best_of, scorer or ["verifier"], reward_model, judge, plot)
        else:
            figures = evaluate(cfg)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        fail(str(err))
        return
    print_results({"eval": figures})
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(figures, indent=2))


def _scorer_config(kind: str, reward_model: str | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The ScorerConfig a ``--scorer`` option names: the verifier (``accuracy`` with ``kwargs``), a reward model,
    or a pointwise judge (``kwargs``: its JudgeConfig fields)."""
    if kind not in ("verifier", "rm", "judge"):
        raise ConfigError(f"unknown scorer {kind!r}; valid: verifier, rm, judge")
    if kind == "rm" and not reward_model:
        raise ConfigError("--scorer rm needs --reward-model PATH")
    if kind == "verifier":
        return {"kind": "rewards", "rewards": [{"name": "accuracy", "kwargs": kwargs}]}
    if kind == "rm":
        return {"kind": "reward_model", "path": reward_model}
    return {"kind": "judge", "judge": {**kwargs, "kind": "pointwise"}}


def _best_of_n_eval(model: str, eval_cfg: dict[str, Any], best_of: str, scorers: list[str],
                    reward_model: str | None, judge: dict[str, Any], plot: Path | None) -> dict[str, float]:
    from tether.best_of_n import curves, run_best_of_n
    from tether.config.common import EvalConfig

    try:
        ns = [int(x) for x in best_of.split(",")]
    except ValueError:
        raise ConfigError(f"--best-of takes comma-separated sample counts like 1,2,4,8, got {best_of!r}") from None
    verifier_kwargs = {"task": eval_cfg["task"], "task_options": eval_cfg["options"]}
    specs = {kind: _scorer_config(kind, reward_model, verifier_kwargs if kind == "verifier" else judge)
             for kind in scorers}
    figures = run_best_of_n(model, EvalConfig(**{**eval_cfg, "samples": 1}), ns, specs, plot=plot)
    table = Table(title="best-of-n held-out accuracy")
    table.add_column("n")
    by_scorer = curves(figures)
    for label in by_scorer:
        table.add_column(label)
    for k in sorted(set(ns)):
        table.add_row(str(k), *(f"{by_scorer[label][k]:.1%}" for label in by_scorer))
    console.print(table)
    return figures


@app.command("generate")
def generate_cmd(
    model: Annotated[str, typer.Option(help="checkpoint path or hub id (local engine); model id (openai engine)")],
    prompts: Annotated[Path, typer.Option(help="jsonl / parquet with a 'prompt' field (other columns are kept), "
                                               "or a text file (one per line)")],
    out: Annotated[Path, typer.Option(help="output .jsonl or .parquet")] = Path("generations.jsonl"),
    n: Annotated[int, typer.Option(help="samples per prompt")] = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = 128,
    greedy: bool = False, seed: int | None = None,
    chat: Annotated[bool, typer.Option(help="wrap prompts in the chat template")] = False,
    prompt_template: Annotated[str, typer.Option(help="e.g. '{prompt}<think>'")] = "{prompt}",
    batch_size: Annotated[int, typer.Option(help="samples per engine call and per flush to disk")] = 64,
    overwrite: Annotated[bool, typer.Option(help="start over instead of resuming an existing --out")] = False,
    engine: Annotated[str, typer.Option(help="local (in-process) or openai (an OpenAI-compatible endpoint)")]
    = "local",
    base_url: Annotated[str | None, typer.Option(help="openai engine: e.g. http://127.0.0.1:8000/v1")] = None,
    api_key_env: Annotated[str | None, typer.Option(help="openai engine: variable holding the API key")] = None,
    tokenizer: Annotated[str | None, typer.Option(help="openai engine: local tokenizer (default: --model)")] = None,
    best_of: Annotated[int | None, typer.Option(help="sample N per prompt, keep the top-scored one")] = None,
    scorer: Annotated[str, typer.Option(help="best-of scorer: verifier, rm or judge")] = "verifier",
    reward_model: Annotated[str | None, typer.Option(help="reward model directory for --scorer rm")] = None,
    scorer_option: Annotated[list[str] | None, typer.Option(help="verifier / judge option key=value, e.g. "
                                                                 "task=arithmetic")] = None,
) -> None:
    """Sample completions for a file of prompts (resumable: re-run the same command to continue)."""
    from tether.best_of_n import generate_best_of_n
    from tether.generation import generate_file

    _setup_logging(False)
    options = dict(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                   greedy=greedy, seed=seed, chat=chat, batch_size=batch_size, prompt_template=prompt_template,
                   resume=not overwrite, engine=engine, tokenizer=tokenizer, base_url=base_url,
                   api_key_env=api_key_env)
    try:
        if best_of:
            spec = _scorer_config(scorer, reward_model, dict(parse_overrides(list(scorer_option or []))))
            stats = generate_best_of_n(model, prompts, out, best_of, spec, **options)
        else:
            stats = generate_file(model, prompts, out, n=n, **options)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        fail(str(err))
        return
    resumed = f" ({stats['resumed']} found on disk, {stats['generated']} new)" if stats["resumed"] else ""
    if best_of:
        console.print(f"best of {best_of} for {stats['selected']} prompts (mean score "
                      f"{stats['mean_best_score']:.3f}) in {out}; all samples in {out.stem}.samples.jsonl{resumed}")
    else:
        console.print(f"wrote {stats['records']} completions to {out}{resumed}")


@app.command("report")
def report_cmd(
    run_dirs: Annotated[list[Path], typer.Argument(help="run directory (tether run --out DIR); several: compare them")],
    out: Annotated[Path | None, typer.Option(help="comparison page (several runs); default compare.html here")]
    = None,
) -> None:
    """Write RUN_DIR/report.html (the answer, run facts, configuration, curves, samples); with several run
    directories, one page comparing them on the same axes."""
    from tether.report import write_comparison_report, write_report

    _setup_logging(False)
    try:
        if len(run_dirs) == 1 and out is None:
            path = write_report(run_dirs[0])
        else:
            path = write_comparison_report(run_dirs, out or Path("compare.html"))
    except FileNotFoundError as err:
        fail(str(err))
        return
    console.print(f"report in {path}")


@app.command("serve")
def serve_cmd(
    model: Annotated[str, typer.Argument(help="checkpoint path, hub id or tether/tiny")],
    port: Annotated[int, typer.Option(help="TCP port (0 = a free one, printed on start)")] = 8000,
    host: Annotated[str, typer.Option(help="address to bind; keep the loopback default unless you need more")]
    = "127.0.0.1",
    api_key_env: Annotated[str | None, typer.Option(help="environment variable holding the API key "
                                                         "(clients send 'Authorization: Bearer KEY')")] = None,
    model_name: Annotated[str | None, typer.Option(help="model id in the API (default: the folder name)")] = None,
    device: str = "cpu",
    dtype: str = "float32",
    threads: Annotated[int | None, typer.Option(help="torch CPU threads")] = None,
    insecure_no_api_key: Annotated[bool, typer.Option(help="allow a non-loopback --host without an API key")]
    = False,
    max_request_bytes: Annotated[int, typer.Option(help="larger request bodies get HTTP 413")] = 1 << 20,
    max_n: Annotated[int, typer.Option(help="largest n accepted")] = 64,
    max_tokens_limit: Annotated[int, typer.Option(help="largest max_tokens accepted")] = 4096,
    max_sequences: Annotated[int, typer.Option(help="largest prompts x n in one request")] = 256,
    max_request_tokens: Annotated[int, typer.Option(help="largest prompts x n x max_tokens in one request")]
    = 32768,
    chunk_sequences: Annotated[int, typer.Option(help="sequences generated per turn (requests take turns)")] = 32,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models)."""
    from tether.serve import ServeBudget, serve

    _setup_logging(False)
    try:
        budget = ServeBudget(max_n=max_n, max_tokens_limit=max_tokens_limit, max_sequences=max_sequences,
                             max_request_tokens=max_request_tokens, chunk_sequences=chunk_sequences)
        serve(model, host=host, port=port, model_name=model_name, api_key_env=api_key_env,
              insecure_no_api_key=insecure_no_api_key, device=device, dtype=dtype, threads=threads,
              max_request_bytes=max_request_bytes, budget=budget)
    except (ConfigError, ValueError, FileNotFoundError, OSError) as err:
        fail(str(err))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
