"""Generation engines behind one protocol: token-id prompts in, a :class:`Rollout` out."""

from tether.rollout.base import GenerationEngine, Rollout, SamplingParams
from tether.rollout.hf_engine import HFEngine, sample_tokens
from tether.rollout.openai_engine import EndpointError, OpenAIEngine, TextRollout

__all__ = ["EndpointError", "GenerationEngine", "HFEngine", "OpenAIEngine", "Rollout", "SamplingParams", "TextRollout",
           "sample_tokens"]
