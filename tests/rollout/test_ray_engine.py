"""Rollout workers on Ray (a local instance with 2 CPUs): the same rollouts as in-process engines on the same
shards, and the trainer's weights pushed to the workers before each batch."""

from __future__ import annotations

import pytest
import torch

from tether.models import build_tiny
from tether.rollout import HFEngine, Rollout, SamplingParams
from tether.rollout.ray_engine import HFWorker, RayEngine


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'tether[ray]'")
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_ray_workers_decode_like_in_process_engines_with_the_pushed_weights(local_ray):
    model, tokenizer = build_tiny("tiny", seed=0)
    with torch.no_grad():  # the live policy differs from what the workers load: the push must matter
        model.lm_head.weight.mul_(1.5)
    prompts = [tokenizer(p)["input_ids"] for p in ["12+30=", "7+5=", "40+2=", "9+9=", "1+1="]]
    engine = RayEngine(HFWorker("tether/tiny", model={"seed": 0}), num_workers=2, source=model)
    try:
        for params in (SamplingParams(greedy=True, max_new_tokens=10),
                       SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=7)):
            got = engine.generate(prompts, params)
            local = HFEngine(model, tokenizer)
            seeded = params.seed is not None
            expected = Rollout.concat([
                local.generate(prompts[:3], params if not seeded else SamplingParams(**{**vars(params), "seed": 7})),
                local.generate(prompts[3:], params if not seeded else SamplingParams(**{**vars(params), "seed": 10}))])
            assert got.completion_ids == expected.completion_ids
            assert got.prompt_index == expected.prompt_index and got.texts == expected.texts
    finally:
        engine.close()
