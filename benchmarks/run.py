"""tether against TRL, side by side on identical work, in one process; plus MFU.

    python benchmarks/run.py [--out results.json] [--runs 5] [--threads N] [--models tiny,small[,small-32k]]
                             [--workloads sft,dpo,grpo,grpo_beta0,generation] [--precisions fp32,bf16-mixed]
                             [--prefix-sharing true|false|auto|cascade] [--quick]

For every (precision, model, workload) the two libraries run alternately (tether first on even runs,
TRL first on odd ones) ``--runs`` times each; a figure is the median of the runs, with min and max.
``bf16-mixed`` rows run tether's ``train.precision: bf16-mixed`` against TRL's ``bf16=True`` (and
bfloat16 decoding on both sides for generation); each bf16 row also gives tether's speed over its own
float32 row. Around every row the script measures the CPU time other processes used (in cores, over
one second before and after, and over the whole row from the machine's busy time less this process's,
which also counts processes that start and end inside the row) and marks a row measured under load when
any of the three exceeds 0.25 cores.
What each side does is in ``workloads.py``: same weights, records, batch size, sequence lengths,
optimiser, learning rate, number of steps, float32 on CPU, thread count, no gradient
checkpointing. Each row also carries both loss (or reward) trajectories and whether they agree
within the stated tolerance, so the table shows the two did the same work.

Generation compares the rollout engine with ``model.generate`` (named in ``baseline``), batch
64, 32 new tokens at most, sampled: ``generation`` stops rows at EOS (tokens counted up to EOS on
both sides), ``generation_fixed`` ignores EOS so every row decodes 32 tokens (the bare decode loops).

MFU: achieved training FLOP/s of SFT on the ``small`` model (6 x parameters x tokens, plus
12 x layers x hidden x length^2 per sequence for attention, as in the PaLM paper's appendix)
against the FLOP/s of a large matmul of the row's precision (float32, or bfloat16 for bf16-mixed)
timed in the same process with the same threads.

``--prefix-sharing`` sets tether's prefix sharing in the DPO and GRPO rows (``data.prefix_sharing`` /
``prefix_sharing``; default ``true``, the library's default: on a CPU cascade attention for GRPO's groups, the
dense prefix-sharing mask for DPO's pairs); TRL has none.

Writes the rows as JSON (``--out``), the same table as markdown next to it (``.md``), and prints it.
``--quick`` runs every workload once at a trivial size, sampling the load for 0.1 s around each row instead
of 1 s: the smoke test that keeps this script working.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workloads as wl

from tether.models.linear import cpu_multiplies_bfloat16, cpuinfo_field, onednn_runs
from tether.models.tiny import build_tiny, build_tokenizer, save_tiny

WORKLOADS = ("sft", "dpo", "grpo", "grpo_beta0", "generation", "generation_fixed")

# Sizes per model: (full, quick). Batch is examples / pairs / prompts per step.
SPECS = {
    "tiny": {
        "sft": (wl.Spec(steps=30, batch=32, lr=1e-3), wl.Spec(steps=2, batch=4)),
        "dpo": (wl.Spec(steps=20, batch=16), wl.Spec(steps=2, batch=4)),
        "grpo": (wl.Spec(steps=5, batch=8), wl.Spec(steps=1, batch=2, new_tokens=8, group=4)),
        "grpo_beta0": (wl.Spec(steps=5, batch=8, beta=0.0), wl.Spec(steps=1, batch=2, new_tokens=8, group=4,
                                                                    beta=0.0)),
        "generation": (wl.Spec(steps=1, batch=64), wl.Spec(steps=1, batch=8, new_tokens=8)),
        "generation_fixed": (wl.Spec(steps=1, batch=64), wl.Spec(steps=1, batch=8, new_tokens=8)),
    },
    "small": {
        "sft": (wl.Spec(steps=8, batch=32), wl.Spec(steps=1, batch=4)),
        "dpo": (wl.Spec(steps=6, batch=16), wl.Spec(steps=1, batch=2)),
        "grpo": (wl.Spec(steps=2, batch=4), wl.Spec(steps=1, batch=1, new_tokens=4, group=2)),
        "grpo_beta0": (wl.Spec(steps=2, batch=4, beta=0.0), wl.Spec(steps=1, batch=1, new_tokens=4, group=2,
                                                                    beta=0.0)),
        "generation": (wl.Spec(steps=1, batch=64), wl.Spec(steps=1, batch=8, new_tokens=4)),
        "generation_fixed": (wl.Spec(steps=1, batch=64), wl.Spec(steps=1, batch=8, new_tokens=4)),
    },
}
# "small-32k": the small model with a 32,768-token vocabulary, as real models have (the built-ins have 109
# tokens, so their LM head is nearly free); the same work as "small".
SPECS["small-32k"] = SPECS["small"]
LARGE_VOCABULARY = 32768

# Per-step agreement of the two trajectories (SFT / DPO: the loss; GRPO: the mean reward). The data order
# and the samples differ between the libraries, so steps are compared as a mean over the run.
TOLERANCE = {"sft": ("relative", 0.05), "dpo": ("absolute", 0.02), "grpo": ("absolute", 0.03),
             "grpo_beta0": ("absolute", 0.03)}
METRICS = {"sft": ["tokens", "loss_tokens"], "dpo": ["pairs"], "grpo": ["completions"],
           "grpo_beta0": ["completions"], "generation": ["tokens"], "generation_fixed": ["tokens"]}


PRECISIONS = ("fp32", "bf16-mixed")
QUICK_LOAD_SECONDS = 0.1  # the load samples around a --quick row (a smoke test: its timings mean nothing)
LOADED_CORES = 0.25  # other processes' CPU use (cores) above which a row is marked as measured under load


def save_model(path: Path, name: str) -> Path:
    """A benchmark model saved in the Hugging Face layout: a built-in size, or ``SIZE-32k``, that size with
    a vocabulary of ``LARGE_VOCABULARY`` tokens (the character tokenizer padded with added tokens the data
    never contains, so both libraries see the same token ids and pay for the whole head)."""
    size, _, vocabulary = name.partition("-")
    if not vocabulary:
        return save_tiny(path, name, seed=0)
    tokenizer = build_tokenizer()
    tokenizer.add_tokens([f"<v{i}>" for i in range(LARGE_VOCABULARY - len(tokenizer))])
    model, tokenizer = build_tiny(size, seed=0, tokenizer=tokenizer)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def other_load(seconds: float = 1.0) -> float:
    """CPU cores used by every process but this one over ``seconds`` (psutil's per-process CPU times)."""
    import psutil

    me = os.getpid()

    def cpu_times() -> dict[int, float]:
        out = {}
        for proc in psutil.process_iter(["pid"]):
            try:
                times = proc.cpu_times()
                out[proc.pid] = times.user + times.system
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        out.pop(me, None)
        return out

    before = cpu_times()
    time.sleep(seconds)
    after = cpu_times()
    return sum(max(0.0, t - before.get(pid, t)) for pid, t in after.items()) / seconds


class LoadDuring:
    """Other processes' CPU use (cores) over a block: the machine's busy time (``psutil.cpu_times``: all but
    idle and iowait) less this process's own, over the block's wall time. Unlike :func:`other_load`'s
    per-process sums it also counts processes that start and end inside the block."""

    def __enter__(self) -> LoadDuring:
        import psutil

        self._psutil, self._me = psutil, psutil.Process()
        self._start = (time.monotonic(), self._busy(), self._own())
        self.cores = 0.0
        return self

    def _busy(self) -> float:
        times = self._psutil.cpu_times()
        return sum(times) - times.idle - getattr(times, "iowait", 0.0) - getattr(times, "guest", 0.0) \
            - getattr(times, "guest_nice", 0.0)  # guest time is already inside user time on Linux

    def _own(self) -> float:
        times = self._me.cpu_times()
        return times.user + times.system + times.children_user + times.children_system

    def __exit__(self, *exc: object) -> None:
        wall, busy, own = self._start
        elapsed = max(time.monotonic() - wall, 1e-9)
        self.cores = max(0.0, (self._busy() - busy) - (self._own() - own)) / elapsed


def matmul_peak(threads: int, size: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of the best of ``repeats`` (size x size) @ (size x size) matmuls in ``dtype``, on the faster of
    PyTorch's default kernel and oneDNN's (in float32 on AMD processors the faster one is oneDNN's, which
    tether's training forward uses there: ``tether.models.linear``)."""
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    kernels = [lambda: torch.mm(a, b)]
    if onednn_runs(dtype):
        kernels.append(lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], ""))
    best = float("inf")
    for kernel in kernels:
        kernel()
        for _ in range(repeats):
            start = time.perf_counter()
            kernel()
            best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def training_flops(model_dir: Path, tokens: float, sum_sq_lengths: float) -> float:
    """6 N T for the weights (input embedding excluded: a lookup) plus 12 L d sum(len^2) for attention."""
    cfg = json.loads((model_dir / "config.json").read_text())
    params = sum(t.numel() for t in _weights(model_dir).values())
    params -= cfg["vocab_size"] * cfg["hidden_size"]
    return 6 * params * tokens + 12 * cfg["num_hidden_layers"] * cfg["hidden_size"] * sum_sq_lengths


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def agreement(workload: str, tether: list[float], trl: list[float]) -> dict:
    kind, tol = TOLERANCE[workload]
    a, b = statistics.fmean(tether), statistics.fmean(trl)
    diff = abs(a - b) / abs(b) if kind == "relative" else abs(a - b)
    return {"tether_mean": a, "trl_mean": b, "tether_first": tether[0], "trl_first": trl[0],
            "difference": diff, "tolerance": f"{kind} {tol}", "ok": diff <= tol}


def run_once(workload: str, name: str, model_dir: Path, spec: wl.Spec, threads: int) -> wl.Measurement:
    """One run of ``workload`` by ``name`` ("tether", "trl" or "model.generate")."""
    with tempfile.TemporaryDirectory() as scratch:
        if workload.startswith("generation"):
            return wl.generation(model_dir, spec, "tether" if name == "tether" else "hf", threads,
                                 ignore_eos=workload == "generation_fixed", repeats=3)
        key = "grpo" if workload.startswith("grpo") else workload
        return wl.TRAINING[key][name](model_dir, spec, Path(scratch), threads)


def measure(workload: str, model: str, model_dir: Path, spec: wl.Spec, runs: int, threads: int,
            load_seconds: float = 1.0) -> list[dict]:
    """Alternate the libraries ``runs`` times; one row per metric of the workload, with the load around it
    (other processes' CPU use sampled over ``load_seconds`` before and after, and measured during)."""
    generation = workload.startswith("generation")
    names = ("tether", "model.generate") if generation else ("tether", "trl")
    results: dict[str, list[wl.Measurement]] = {n: [] for n in names}
    load_before = other_load(load_seconds)
    with LoadDuring() as during:
        for run in range(runs):
            for name in names if run % 2 == 0 else names[::-1]:
                gc.collect()
                results[name].append(run_once(workload, name, model_dir, spec, threads))
                torch.set_num_threads(threads)
    load_after = other_load(load_seconds)
    load = {"load_before": load_before, "load_during": during.cores, "load_after": load_after,
            "under_load": max(load_before, during.cores, load_after) > LOADED_CORES}
    rows = []
    for metric in METRICS[workload]:
        rates = {n: [m.units[metric] / m.seconds for m in results[n]] for n in names}
        ours, theirs = statistics.median(rates[names[0]]), statistics.median(rates[names[1]])
        paired = paired_ratios(rates[names[0]], rates[names[1]])
        row = {"workload": workload, "model": model, "precision": spec.precision, "metric": f"{metric}/s",
               "tether": ours, "trl": theirs, **load,
               "ratio": ours / theirs, "paired_ratios": paired, "runs": runs, "tether_min": min(rates[names[0]]),
               "tether_max": max(rates[names[0]]), "trl_min": min(rates[names[1]]),
               "trl_max": max(rates[names[1]]), "baseline": names[1]}
        if not generation:
            row["trajectory"] = agreement(workload, results["tether"][0].trajectory, results["trl"][0].trajectory)
        rows.append(row)
    if workload == "sft" and model == "small":
        rows[0]["_units"] = {n: [m.units for m in results[n]] for n in names}
        rows[0]["_seconds"] = {n: [m.seconds for m in results[n]] for n in names}
    return rows


def paired_ratios(ours: list[float], theirs: list[float]) -> list[float]:
    """Each run's ratio of the two rates (``ours[i] / theirs[i]``): run ``i`` of each library ran back to back,
    so a pair shares the machine's state of that moment, and the spread of the pairs over the runs is the
    spread of the row's ratio (the headline stays the ratio of the two medians)."""
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"paired ratios need one rate per run on each side, got {len(ours)} and {len(theirs)}")
    return [a / b for a, b in zip(ours, theirs, strict=True)]


def mfu_rows(rows: list[dict], model_dirs: dict[str, Path], peak: float, precision: str) -> dict | None:
    sft = next((r for r in rows if r["workload"] == "sft" and r["model"] == "small" and "_units" in r
                and r["precision"] == precision), None)
    if sft is None:
        return None
    out = {"model": "small", "workload": "sft", "precision": precision, "matmul_peak_gflops": peak / 1e9}
    for name in ("tether", "trl"):
        achieved = [training_flops(model_dirs["small"], u["tokens"], u["sum_sq_lengths"]) / s
                    for u, s in zip(sft["_units"][name], sft["_seconds"][name], strict=True)]
        out[f"{name}_gflops"] = statistics.median(achieved) / 1e9
        out[f"{name}_mfu"] = statistics.median(achieved) / peak
    for key in ("_units", "_seconds"):
        sft.pop(key, None)
    return out


def own_fp32_ratios(rows: list[dict]) -> None:
    """Each bf16-mixed row's tether speed over tether's float32 row of the same model, workload and metric."""
    fp32 = {(r["model"], r["workload"], r["metric"]): r["tether"] for r in rows if r["precision"] == "fp32"}
    for r in rows:
        base = fp32.get((r["model"], r["workload"], r["metric"]))
        if r["precision"] != "fp32" and base:
            r["over_own_fp32"] = r["tether"] / base


def _pairs(row: dict) -> str:
    """The spread of a row's per-run ratios, " (1.41-1.55)", where it has more than one run."""
    pairs = row.get("paired_ratios", ())
    return f" ({min(pairs):.2f}-{max(pairs):.2f})" if len(pairs) > 1 else ""


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def markdown(rows: list[dict], mfus: list[dict], meta: dict) -> str:
    lines = [f"tether {meta['tether']} (commit {meta.get('commit')}, prefix sharing "
             f"{meta.get('prefix_sharing', 'true')}) vs TRL {meta['trl']} (torch {meta['torch']}), {meta['machine']}, "
             f"{meta['threads']} thread(s), {meta['date']}; median of {meta['runs']} alternating runs (min-max); "
             "ratio: of the two medians (in brackets the lowest and highest ratio of one run of each, run back to "
             "back). "
             f"load: other processes' CPU use (cores) before / during / after the row; rows over {LOADED_CORES} are marked "
             "UNDER LOAD." + (" bfloat16 products are emulated on this CPU (no bfloat16 matrix instructions): its "
                              "bf16 rows measure the emulation." if meta.get("bfloat16_emulated") else ""), "",
             "| precision | workload | model | metric | tether | TRL / baseline | ratio | over own fp32 | same work "
             "| load |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r.get("trajectory")
        same = "-" if t is None else (f"{'yes' if t['ok'] else 'NO'} ({t['tether_mean']:.3f} vs "
                                      f"{t['trl_mean']:.3f}, {t['tolerance']})")
        base = "" if r["baseline"] == "trl" else f" ({r['baseline']})"
        own = f"{r['over_own_fp32']:.2f}x" if "over_own_fp32" in r else "-"
        during = f" / {r['load_during']:.2f}" if "load_during" in r else ""
        load = f"{r['load_before']:.2f}{during} / {r['load_after']:.2f}" + (" UNDER LOAD" if r["under_load"] else "")
        lines.append(f"| {r['precision']} | {r['workload']} | {r['model']} | {r['metric']} | {_num(r['tether'])} "
                     f"({_num(r['tether_min'])}-{_num(r['tether_max'])}) | {_num(r['trl'])} "
                     f"({_num(r['trl_min'])}-{_num(r['trl_max'])}){base} | **{r['ratio']:.2f}x**{_pairs(r)} | {own} | {same} "
                     f"| {load} |")
    for mfu in mfus:
        kind = "float32" if mfu["precision"] == "fp32" else "bfloat16"
        lines += ["", f"MFU, SFT on the small model, {mfu['precision']}: tether {mfu['tether_mfu']:.1%} "
                      f"({mfu['tether_gflops']:.1f} GFLOP/s), TRL {mfu['trl_mfu']:.1%} "
                      f"({mfu['trl_gflops']:.1f} GFLOP/s), against a {kind} matmul peak of "
                      f"{mfu['matmul_peak_gflops']:.1f} GFLOP/s measured in the same run. At 100% of that peak "
                      f"tether would be {1 / mfu['trl_mfu']:.2f}x TRL: the ceiling of this row's ratio."]
    return "\n".join(lines) + "\n"


PREFIX_SHARING = {"true": True, "false": False, "auto": "auto", "cascade": "cascade", "mask": "mask"}


def cpu_model() -> str:
    """The processor's model name, family / model numbers and PyTorch's vector instruction level (figures from
    different CPUs are not comparable, and one model name, e.g. "AMD EPYC", covers generations with and
    without AVX-512), else its architecture."""
    name = cpuinfo_field("model name") or platform.processor() or f"{platform.machine()} CPU"
    family, model = cpuinfo_field("cpu family"), cpuinfo_field("model")
    generation = f"family {family} model {model}, " if family and model else ""
    return f"{name} ({generation}{torch.backends.cpu.get_cpu_capability()})"


def commit() -> str | None:
    """The checkout's short commit hash (``+`` when the tree has changes), or None outside git."""
    import subprocess

    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+" if dirty else "")


def parse_selection(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Add ``--models`` / ``--workloads`` / ``--quick`` to ``parser`` and parse; the two lists checked, and
    ``--out`` (the caller's) checked before any work: a JSON file path whose folder is made here."""
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--precisions", default="fp32", help="fp32, bf16-mixed or both, comma-separated")
    parser.add_argument("--quick", action="store_true", help="every workload at a trivial size (smoke test)")
    args = parser.parse_args(argv)
    args.precisions = [p for p in args.precisions.split(",") if p]
    for name in args.precisions:
        if name not in PRECISIONS:
            parser.error(f"unknown precision {name!r}; valid: {', '.join(PRECISIONS)}")
    args.models = [m for m in args.models.split(",") if m]
    args.workloads = [w for w in args.workloads.split(",") if w]
    for name in args.workloads:
        if name not in WORKLOADS:
            parser.error(f"unknown workload {name!r}; valid: {', '.join(WORKLOADS)}")
    for name in args.models:
        if name not in SPECS:
            parser.error(f"unknown model {name!r}; valid: {', '.join(SPECS)}")
    if args.out.is_dir() or args.out.suffix != ".json":
        parser.error(f"--out names the JSON file to write (the markdown goes beside it), not {str(args.out)!r}")
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        parser.error(f"--out: cannot create {args.out.parent}: {err.strerror}")
    return args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results.json"))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--prefix-sharing", choices=list(PREFIX_SHARING), default="true",
                        help="tether's prefix sharing in the DPO and GRPO rows")
    args = parse_selection(parser, argv)
    models, workloads = args.models, args.workloads
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    bfloat16_emulated = "bf16-mixed" in args.precisions and not cpu_multiplies_bfloat16()
    if bfloat16_emulated:
        print("warning: this CPU has no bfloat16 matrix instructions; bf16 rows measure emulated products",
              file=sys.stderr, flush=True)
    rows: list[dict] = []
    mfus: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dirs = {m: save_model(Path(tmp) / m, m) for m in models}
        for precision in args.precisions:
            for model in models:
                for workload in workloads:
                    spec = dataclasses.replace(SPECS[model][workload][1 if args.quick else 0], precision=precision,
                                               prefix_sharing=PREFIX_SHARING[args.prefix_sharing])
                    print(f"... {precision} {model} {workload}", file=sys.stderr, flush=True)
                    rows.extend(measure(workload, model, model_dirs[model], spec, args.runs, args.threads,
                                        load_seconds=QUICK_LOAD_SECONDS if args.quick else 1.0))
            if "small" in models and "sft" in workloads:
                dtype = torch.float32 if precision == "fp32" else torch.bfloat16
                mfu = mfu_rows(rows, model_dirs, matmul_peak(args.threads, dtype=dtype), precision)
                mfus += [mfu] if mfu else []
        own_fp32_ratios(rows)
    import trl

    import tether

    meta = {"date": time.strftime("%Y-%m-%d"), "machine": f"{cpu_model()}, {os.cpu_count()} cores",
            "threads": args.threads, "runs": args.runs, "precisions": args.precisions, "torch": torch.__version__, "trl": trl.__version__,
            "tether": tether.__version__, "commit": commit(), "prefix_sharing": args.prefix_sharing,
            "quick": args.quick, "bfloat16_emulated": bfloat16_emulated, "seconds": time.perf_counter() - started}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows, "mfu": mfus}, indent=1))
    table = markdown(rows, mfus, meta)
    args.out.with_suffix(".md").write_text(table)
    print(table)
    print(f"({meta['seconds']:.0f} s; {args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
