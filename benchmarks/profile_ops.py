"""Where the time goes, tether against TRL (or ``model.generate``), under ``torch.profiler``.

    python benchmarks/profile_ops.py [--threads N] [--models tiny,small] [--workloads sft,dpo,...]
                                 [--precisions fp32,bf16-mixed] [--top 8] [--out benchmarks/profile_ops.json] [--quick]

The same workloads and sizes as ``run.py``, one run per side with the profiler (recording shapes) over
exactly the region ``run.py`` times (the ``train()`` call, or the decode repeats after the warm-up).
Per side: the seconds of the ``train()`` call (or of the decode loop), the time in matrix products
(``aten::mm`` / ``addmm`` / ``bmm`` / ``baddbmm``, oneDNN's ``mkldnn::_linear_pointwise``: self CPU time, and their FLOPs from their input
shapes), the time in fused attention (``scaled_dot_product_*``) and the rest (element-wise
kernels, the optimiser, Python), and the ``--top`` operators of each side by self CPU time. The profiler's own
overhead inflates every figure, so read shares and FLOPs here and speeds in ``run.py``.

The **ceiling** of a workload is the speed ratio tether would reach if it did nothing but its matrix
products, at the baseline's matmul rate: (the baseline's matmul FLOPs per unit of work / tether's) /
(the baseline's matmul share of its time); units as ``run.py`` reports them (tokens, pairs,
completions). It uses each side's own FLOP counts and the baseline's own time split, so it does not
depend on the two runs meeting the same load on a shared machine. Where the ceiling is below a
target, removing overhead cannot meet it at those FLOPs; where it is above, the time outside the
matrix products (element-wise kernels, attention, the optimiser, Python) is what stands between.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workloads as wl
from run import METRICS, SPECS, parse_selection, run_once

from tether.models.tiny import save_tiny

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise")
"""Matrix products as the profiler names them; ``mkldnn::_linear_pointwise`` is oneDNN's linear, which tether's
float32 layers use on AMD AVX-512 processors (``tether.models.linear``)."""
# float32 targets of the performance issue; bf16-mixed: 2x TRL in bf16 on the small model
BF16_TARGETS = {("small", "sft"): 2.0, ("small", "dpo"): 2.0, ("small", "grpo"): 2.0}
TARGETS = {("tiny", "sft"): 1.5, ("tiny", "dpo"): 1.5, ("tiny", "grpo"): 1.5, ("small", "sft"): 1.5,
           ("small", "dpo"): 1.5, ("small", "grpo"): 1.5, ("tiny", "generation"): 2.0,
           ("small", "generation"): 2.0}


def matmul_flops_of(op: str, shapes: list[list[int]]) -> float:
    """2 * M * K * N (times the batch) of one matrix product from its input shapes."""
    if op == "mkldnn::_linear_pointwise":  # x (M, K) times a weight (N, K): 2 M K N; a prepacked weight has no shape
        x, weight = shapes[0], shapes[1]
        return 2.0 * x[0] * x[1] * weight[0] if len(x) == 2 and len(weight) == 2 else 0.0
    a, b = (shapes[1], shapes[2]) if op in ("aten::addmm", "aten::baddbmm") else (shapes[0], shapes[1])
    batch = a[0] if len(a) == 3 else 1
    return 2.0 * batch * a[-2] * a[-1] * b[-1]


def top_operators(events, n: int) -> list[dict]:
    """The ``n`` operators with the most self CPU time (profiler events averaged by name), most first."""
    ranked = sorted(events, key=lambda e: -e.self_cpu_time_total)[:n]
    return [{"op": e.key, "calls": e.count, "self_s": e.self_cpu_time_total / 1e6} for e in ranked]


def profiled(workload: str, name: str, model_dir: Path, spec, threads: int, top: int = 0) -> dict:
    """One run of ``workload`` by ``name`` under the profiler: seconds, matmul time / FLOPs, attention time, and
    the ``top`` operators by self CPU time."""
    gc.collect()
    torch.set_num_threads(threads)
    # shapes, not with_flops: the profiler's FLOP formulas slow every element-wise op several-fold, which
    # would inflate the very "other" time this measures
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
    wl.timed_region = lambda: prof  # the profiler sees exactly the region run.py times
    try:
        measurement = run_once(workload, name, model_dir, spec, threads)
    finally:
        wl.timed_region = contextlib.nullcontext
    events = prof.key_averages()
    matmul_us = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS)
    matmul_flops = sum(e.count * matmul_flops_of(e.key, e.input_shapes)
                       for e in prof.key_averages(group_by_input_shape=True) if e.key in MATMUL_OPS)
    attention_us = sum(e.self_cpu_time_total for e in events if "scaled_dot_product" in e.key)
    seconds = measurement.seconds
    return {"seconds": seconds, "matmul_s": matmul_us / 1e6, "matmul_gflop": matmul_flops / 1e9,
            "attention_s": attention_us / 1e6,
            "other_s": max(seconds - (matmul_us + attention_us) / 1e6, 0.0),
            "units": measurement.units, "top_ops": top_operators(events, top)}


def ceiling(ours: dict, theirs: dict, unit: str) -> float:
    """(theirs' matmul FLOPs per unit / ours') / (theirs' matmul share of its time)."""
    per_unit = (theirs["matmul_gflop"] / theirs["units"][unit]) / max(ours["matmul_gflop"] / ours["units"][unit], 1e-12)
    return per_unit / max(theirs["matmul_s"] / theirs["seconds"], 1e-9)


def _operator_cell(ops: list[dict], i: int) -> str:
    return f"`{ops[i]['op']}` ({ops[i]['calls']}, {ops[i]['self_s']:.2f})" if i < len(ops) else ""


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"torch.profiler, {meta['threads']} thread(s), {meta['date']}; one run per side "
             "(profiler overhead included).", "",
             "| precision | workload | model | side | seconds | matmul s (share) | matmul GFLOP | matmul GFLOP/s "
             "| attention s | other s | ceiling (target) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for side in ("tether", r["baseline"]):
            p = r[side]
            ceiling = (f"**{r['ceiling']:.2f}x** ({r['target']:.1f}x)" if side == "tether" and r.get("target")
                       else f"**{r['ceiling']:.2f}x**" if side == "tether" else "")
            lines.append(f"| {r['precision']} | {r['workload']} | {r['model']} | {side} | {p['seconds']:.2f} | {p['matmul_s']:.2f} "
                         f"({p['matmul_s'] / p['seconds']:.0%}) | {p['matmul_gflop']:.1f} | "
                         f"{p['matmul_gflop'] / max(p['matmul_s'], 1e-9):.0f} | {p['attention_s']:.2f} | "
                         f"{p['other_s']:.2f} | {ceiling} |")
    for r in rows:
        sides = ("tether", r["baseline"])
        if not any(r[side].get("top_ops") for side in sides):
            continue
        lines += ["", f"Top operators by self CPU time, {r['precision']} {r['workload']} {r['model']} (calls, seconds):", "",
                  f"| tether | {r['baseline']} |", "|---|---|"]
        ours, theirs = (r[side].get("top_ops", []) for side in sides)
        for i in range(max(len(ours), len(theirs))):
            lines.append(f"| {_operator_cell(ours, i)} | {_operator_cell(theirs, i)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/profile_ops.json"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=8, help="operators listed per side, by self CPU time")
    args = parse_selection(parser, argv)
    if args.top < 0:
        parser.error("--top must be >= 0")
    models, workloads = args.models, args.workloads
    threads = torch.get_num_threads()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_dirs = {m: save_tiny(Path(tmp) / m, m, seed=0) for m in models}
            for precision, model, workload in [(p, m, w) for p in args.precisions for m in models for w in workloads]:
                spec = dataclasses.replace(SPECS[model][workload][1 if args.quick else 0], precision=precision)
                baseline = "model.generate" if workload.startswith("generation") else "trl"
                print(f"... {precision} {model} {workload}", file=sys.stderr, flush=True)
                row = {"workload": workload, "model": model, "precision": precision, "baseline": baseline,
                       "tether": profiled(workload, "tether", model_dirs[model], spec, args.threads, args.top),
                       baseline: profiled(workload, baseline, model_dirs[model], spec, args.threads, args.top)}
                row["ceiling"] = ceiling(row["tether"], row[baseline], METRICS[workload][0])
                targets = BF16_TARGETS if precision == "bf16-mixed" else TARGETS
                row["target"] = targets.get((model, workload.removesuffix("_fixed").removesuffix("_beta0")))
                rows.append(row)
    finally:
        torch.set_num_threads(threads)
    meta = {"date": time.strftime("%Y-%m-%d"), "threads": args.threads, "torch": torch.__version__,
            "quick": args.quick}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = markdown(rows, meta)
    args.out.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
