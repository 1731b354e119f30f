"""``tether run RECIPE --seeds N``: the recipe once per seed, in parallel processes, then the figures
across seeds (:func:`tether.stages.seeds.run_seeds`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tether.commands import fail
from tether.console import console, print_seed_results


def run_seeds_command(recipe: dict[str, Any], run_dir: Path, seeds: str, *, parallel: int, resume: bool,
                      deterministic: bool) -> None:
    """Run ``recipe`` over ``seeds`` (a count or a list) into ``run_dir/seed-K``, printing each seed's start and
    end, then the across-seed table; a failed seed ends the command with its log named, after the others."""
    from tether.stages.pipeline import validate_recipe, write_report_safely
    from tether.stages.seeds import parse_seeds, run_seeds, seed_dir

    chosen = parse_seeds(seeds)
    validate_recipe(recipe, run_dir)  # a typo fails here, not in every seed's process
    console.print(f"[bold]tether run[/] {recipe.get('name', '')} over seeds {', '.join(map(str, chosen))} "
                  f"({parallel} at a time) -> {run_dir}")
    start = time.perf_counter()

    def progress(kind: str, seed: int, info: dict[str, Any]) -> None:
        if kind == "start":
            console.print(f"seed {seed}: started, log in {seed_dir(run_dir, seed) / 'run.log'}")
        elif kind == "done":
            headline = "; ".join(f"{s} {f['accuracy']:.1%}" for s, f in info["results"].items() if "accuracy" in f)
            console.print(f"seed {seed}: done in {info['seconds']:.0f}s" + (f" ({headline})" if headline else ""))
        else:
            console.print(f"[bold red]seed {seed}: failed[/] (exit {info['returncode']}); see {info['log']}")

    try:
        aggregated = run_seeds(recipe, run_dir, chosen, parallel=parallel, resume=resume,
                               deterministic=deterministic, on_event=progress)
    except RuntimeError as err:
        fail(str(err))
        return
    print_seed_results(aggregated)
    write_report_safely(run_dir)
    console.print(f"done in {time.perf_counter() - start:.0f}s; per-seed runs in {run_dir}/seed-*/, "
                  f"summary in {run_dir / 'results.json'}")
