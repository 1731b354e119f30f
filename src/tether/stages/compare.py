"""The ``compare`` stage: several earlier stages' metrics over steps in one figure (RUN_DIR/<file>), and each
stage's last value of each metric as the results (``<stage>/<metric>``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tether.config.base import ConfigError
from tether.config.compare import CompareConfig
from tether.report import comparison_png, read_jsonl, stage_metrics
from tether.trainers.checkpoint import mark_done


def run_compare(cfg: CompareConfig, run_dir: Path, resume: bool) -> dict[str, Any]:
    """Write the comparison figure; the last logged value of each metric per stage are the results."""
    name = cfg.name or "compare"
    metrics = stage_metrics(read_jsonl(run_dir / "metrics.jsonl")[0])
    missing = [s for s in cfg.stages if s not in metrics]
    if missing:
        raise ConfigError(f"compare stage {name!r}: no metrics logged by stage(s) {missing} in this run "
                         f"(logged: {sorted(metrics) or 'none'})")
    png = comparison_png([run_dir], cfg.stages, cfg.metrics, cfg.title or name)
    if png is None:
        raise ConfigError(f"compare stage {name!r}: none of the stages logged any of {cfg.metrics}")
    (run_dir / cfg.file).write_bytes(png)
    results = {f"{stage}/{key}": series[max(series)] for stage in cfg.stages
               for key, series in metrics[stage].items() if key in cfg.metrics and series}
    stage_dir = run_dir / name
    stage_dir.mkdir(parents=True, exist_ok=True)
    mark_done(stage_dir, {"stage": name, "type": "compare", "stages": cfg.stages, "metrics": cfg.metrics,
                          "file": cfg.file, "title": cfg.title, "results": results})
    return results
