"""Models: loading any causal LM, the built-in offline tiny models, LoRA."""

from tether.models.loading import apply_lora, load_model, load_tokenizer, save_model
from tether.models.tiny import build_tiny, build_tokenizer, count_parameters, save_tiny

__all__ = ["apply_lora", "build_tiny", "build_tokenizer", "count_parameters", "load_model",
           "load_tokenizer", "save_model", "save_tiny"]
