"""Tokens/s of HFEngine against ``model.generate`` on the tiny model (CPU by default).

Both sample (``do_sample=True``, temperature 1, no top-k / top-p) from the same left-padded batch,
and the tokens actually generated are counted on both sides (up to and including EOS). Scenarios:

* ``full``: EOS ignored on both sides (``min_new_tokens`` for ``model.generate``), every row runs
  ``--new-tokens`` steps: the like-for-like comparison of the decode loops.
* ``ragged``: a bias on the EOS logit makes rows stop at different steps (early stop, compaction).
* ``grouped``: ``batch / group`` prompts x ``group`` samples each (``num_return_sequences``), EOS
  ignored: HFEngine prefills each distinct prompt once.
* ``queued``: ``--queue`` x ``batch`` prompts, ragged EOS, at most ``batch`` decoded together: HFEngine
  in chunks, HFEngine with continuous batching (a finished row takes the next waiting prompt), and
  ``model.generate`` chunk by chunk.

Runs alternate between the two so background load hits both alike; best and median are printed.
``--device cuda --dtype bfloat16`` runs the same on a GPU in bfloat16 (the timer synchronises the device).

    python benchmarks/generation_speed.py [--model tiny|small] [--batch 64] [--new-tokens 32] [--threads 1]
        [--repeats 7] [--queue 4] [--scenario full|ragged|grouped|queued|all] [--device cpu] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from tether.models.tiny import build_tiny
from tether.rollout import HFEngine, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import synchronize

SCENARIOS = ("full", "ragged", "grouped", "queued")


def make_prompts(tokenizer, batch: int, seed: int = 0) -> list[list[int]]:
    rng = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(batch):
        a, b = torch.randint(0, 1000, (2,), generator=rng).tolist()
        msg = [{"role": "user", "content": f"What is {a} + {b}?" + " please" * (i % 4)}]
        text = tokenizer.apply_chat_template(msg, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def engine_runner(engine: HFEngine, prompts, new_tokens: int, n: int = 1):
    params = SamplingParams(n=n, max_new_tokens=new_tokens, seed=0)

    def go() -> int:
        rollout = engine.generate(prompts, params)
        return sum(len(c) for c in rollout.completion_ids)

    return go


def hf_generate_runner(model, tokenizer, prompts, new_tokens: int, ignore_eos: bool, n: int = 1,
                       chunk: int | None = None):
    chunk = chunk or len(prompts)
    encoded = [tokenizer.pad([{"input_ids": p} for p in prompts[i : i + chunk]], padding_side="left",
                             return_tensors="pt") for i in range(0, len(prompts), chunk)]
    kwargs = dict(
        do_sample=True, max_new_tokens=new_tokens, top_k=0, top_p=1.0, temperature=1.0, num_return_sequences=n
    )
    if ignore_eos:
        kwargs["min_new_tokens"] = new_tokens

    def go() -> int:
        total = 0
        for enc in encoded:
            with torch.inference_mode():
                out = model.generate(**enc.to(model.device), **kwargs)
            completion = out[:, enc["input_ids"].shape[1]:]
            # count up to and including the first EOS of each row, as HFEngine does
            is_eos = completion == tokenizer.eos_token_id
            first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, completion.shape[1])
            total += int(first.sum())
        return total

    return go


def time_interleaved(runners: dict, repeats: int, device: str = "cpu") -> dict[str, tuple[float, float, int]]:
    """Alternate the runners so background load hits both alike; (best s, median s, tokens) each."""
    for go in runners.values():
        go()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in runners}
    tokens: dict[str, int] = {}
    for _ in range(repeats):
        for name, go in runners.items():
            synchronize(device)
            start = time.perf_counter()
            tokens[name] = go()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: (min(t), statistics.median(t), tokens[name]) for name, t in times.items()}


def add_eos_bias(model, eos_id: int, bias: float) -> None:
    old = model.lm_head
    new = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        new.weight.copy_(old.weight)
        new.bias.zero_()
        new.bias[eos_id] = bias
    model.lm_head = new


def run(scenario: str, args) -> None:
    model, tokenizer = build_tiny(args.model, seed=0)
    model.eval()
    if scenario in ("ragged", "queued"):
        add_eos_bias(model, tokenizer.eos_token_id, args.eos_bias)
    model.to(device=args.device, dtype=getattr(torch, args.dtype))
    n = args.group if scenario == "grouped" else 1
    queued = scenario == "queued"
    prompts = make_prompts(tokenizer, args.batch * (args.queue if queued else 1) // n)
    chunk = args.batch if queued else None
    engine = HFEngine(model, tokenizer, batch_size=chunk)
    ignore_eos = scenario not in ("ragged", "queued")
    if ignore_eos:
        engine.eos_ids = []  # ignore EOS, like min_new_tokens on the generate side
    runners = {"HFEngine": engine_runner(engine, prompts, args.new_tokens, n)}
    if queued:
        continuous = HFEngine(model, tokenizer, batch_size=chunk, continuous=True)
        runners["HFEngine continuous"] = engine_runner(continuous, prompts, args.new_tokens, n)
    runners["model.generate"] = hf_generate_runner(model, tokenizer, prompts, args.new_tokens, ignore_eos, n,
                                                   chunk)
    results = time_interleaved(runners, args.repeats, args.device)
    print(
        f"[{scenario}] {args.model} model, batch {args.batch} ({len(prompts)} prompts x {n}),"
        f" {args.new_tokens} new tokens, {args.device} {args.dtype}, {args.threads} thread(s)"
    )
    rate = {}
    for name, (best, median, tokens) in results.items():
        rate[name] = tokens / best
        print(
            f"  {name:15s}: {tokens:5d} tokens, best {best * 1e3:7.1f} ms, median {median * 1e3:7.1f} ms"
            f" = {rate[name]:8.0f} tok/s (best)"
        )
    baseline = results["model.generate"][2] / results["model.generate"][1]
    for name in results:
        if name != "model.generate":
            median_ratio = (results[name][2] / results[name][1]) / baseline
            print(f"  ratio {name} / model.generate tok/s: {rate[name] / rate['model.generate']:.2f}x best,"
                  f" {median_ratio:.2f}x median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--eos-bias", type=float, default=1.5, help="EOS logit bias in the ragged scenario")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt in the grouped scenario")
    parser.add_argument("--queue", type=int, default=4, help="prompts per batch slot in the queued scenario")
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for scenario in SCENARIOS if args.scenario == "all" else [args.scenario]:
        run(scenario, args)


if __name__ == "__main__":
    main()
