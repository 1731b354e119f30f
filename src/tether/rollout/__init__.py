"""Generation engines behind one protocol: token-id prompts in, a :class:`Rollout` out."""

from tether.rollout.base import GenerationEngine, Rollout, SamplingParams
from tether.rollout.hf_engine import HFEngine, sample_tokens

__all__ = ["GenerationEngine", "HFEngine", "Rollout", "SamplingParams", "sample_tokens"]
