"""The PPO critic: a causal-LM backbone with a scalar head read at every token, V(s_t).

A value model is Hugging Face's ``AutoModelForTokenClassification`` with ``num_labels=1`` (for
Llama, ``LlamaForTokenClassification``: the decoder plus a linear ``score`` head on every hidden
state), so it saves and reloads with ``save_pretrained`` / ``from_pretrained`` (safetensors).
Its dropout is switched off: values are regression targets, not classifier logits.

Initialisation: from a reward model (``*ForSequenceClassification``) the backbone and the head's
weight carry over, as InstructGPT does ("we initialize the value function from the RM", Ouyang
et al. 2022, appendix C.4); the head's bias, which the reward model lacks, starts at 0. From a
causal LM the LM head is dropped and a new head is drawn from ``seed``.

``ActorCritic`` holds policy and critic as one module, so the shared training loop's single
optimiser (one parameter group each, with its own learning rate) and its checkpoints cover both.
``SharedLoraActorCritic`` is the memory option: one base model, a ``default`` (policy) LoRA
adapter and a ``value`` adapter with a linear value head; the reference is the base with every
adapter disabled.

Which hidden state scores which token: completion token j at sequence position p is chosen in
the state after token p - 1, so V(s_j) (like the log-prob of token j) is read at position p - 1.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForTokenClassification, PreTrainedModel
from transformers.utils import logging as hf_logging

from tether.config.rl import RLConfig
from tether.data import PackedSequences, pack_sequences
from tether.models.loading import no_progress_bars

log = logging.getLogger(__name__)

VALUE_DIR = "value"  # the critic's folder inside a checkpoint or a stage's final model
VALUE_ADAPTER = "value"
POLICY_ADAPTER = "default"
VALUE_HEAD_FILE = "value_head.safetensors"


def load_value_model(name_or_path: str, *, seed: int = 0, dtype: str = "float32", device: str = "cpu",
                     trust_remote_code: bool = False, tokenizer: Any = None) -> tuple[PreTrainedModel, Any]:
    """A value model (token-classification head, one output) and its tokenizer.

    ``name_or_path``: a reward model or a saved value model (head weights reused), a causal-LM
    checkpoint (new head from ``seed``), or ``tether/tiny`` / ``tether/small``.
    """
    from tether.models.loading import builtin_size, load_tokenizer, resolve_device, resolve_dtype
    from tether.models.tiny import build_tokenizer, tiny_config

    size = builtin_size(name_or_path)
    if size:
        tokenizer = tokenizer or build_tokenizer()
        config = tiny_config(size, vocab_size=len(tokenizer))
    else:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        tokenizer = tokenizer or load_tokenizer(name_or_path, trust_remote_code=trust_remote_code)
    config.num_labels, config.classifier_dropout = 1, 0.0
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "newly initialised head" / "unused LM head" are expected here
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if size:
                model = AutoModelForTokenClassification.from_config(config)
            else:
                with no_progress_bars():
                    model = AutoModelForTokenClassification.from_pretrained(
                        name_or_path, config=config, dtype=resolve_dtype(dtype), trust_remote_code=trust_remote_code)
    finally:
        hf_logging.set_verbosity(verbosity)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    return model.to(resolve_device(device)), tokenizer


def value_model_from(model: nn.Module, *, seed: int = 0) -> PreTrainedModel:
    """A value model initialised from a loaded causal LM or reward model (its base model under a
    LoRA adapter): the backbone copied, and a reward model's ``score`` weight as the head's."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    config = copy.deepcopy(model.config)
    config.num_labels, config.classifier_dropout = 1, 0.0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        critic = AutoModelForTokenClassification.from_config(config)
    param = next(model.parameters())
    critic.to(device=param.device, dtype=param.dtype)
    critic.base_model.load_state_dict(model.base_model.state_dict())
    score = getattr(model, "score", None)
    if isinstance(score, nn.Linear) and score.weight.shape == critic.score.weight.shape:
        with torch.no_grad():
            critic.score.weight.copy_(score.weight)
    return critic


def gather_completion(per_position: Tensor, packed: PackedSequences, prompt_lengths: Sequence[int],
                      lengths: Sequence[int]) -> Tensor:
    """Per-position outputs of packed rows, shape (R, L) -> per completion token, shape (N, C).

    Completion token j of sequence i reads position ``start_i + len(prompt_i) + j - 1``, the state
    it was chosen in; positions past a completion's length are 0.
    """
    lengths_t = torch.tensor(list(lengths))
    width = int(lengths_t.max()) if len(lengths_t) else 0
    first = packed.starts + torch.tensor(list(prompt_lengths))
    j = torch.arange(width)
    valid = j[None, :] < lengths_t[:, None]
    cols = (first[:, None] + j[None, :] - 1).clamp(0, per_position.shape[1] - 1)
    rows = packed.rows[:, None].expand_as(cols)
    return torch.where(valid.to(per_position.device), per_position[rows, cols], 0.0)


def completion_values(model: nn.Module, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], *,
                      row_tokens: int, pad_token_id: int) -> Tensor:
    """V(s_t) for every completion token, shape (N, C), float32; prompt+completion packed padding-free.

    ``model``: a value model, or an actor-critic (its ``values`` method is used).
    """
    packed = pack_sequences([list(p) + list(c) for p, c in zip(prompts, completions, strict=True)],
                            row_tokens=row_tokens, pad_token_id=pad_token_id)
    device = next(model.parameters()).device
    inputs = {"input_ids": packed.input_ids.to(device), "position_ids": packed.position_ids.to(device)}
    values = model.values(**inputs) if hasattr(model, "values") else token_values(model, **inputs)
    return gather_completion(values, packed, [len(p) for p in prompts], [len(c) for c in completions])


def token_values(model: nn.Module, input_ids: Tensor, position_ids: Tensor,
                 attention_mask: Tensor | None = None) -> Tensor:
    """The value head at every position of a token-classification model: shape (R, L), float32."""
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False)
    return out.logits[..., 0].float()


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config")


def _load_into(model: nn.Module, folder: Path) -> None:
    """Weights saved by ``save_pretrained`` in ``folder`` into ``model`` (plain, or its peft adapter)."""
    if _is_peft(model):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(folder / "adapter_model.safetensors"))
        return
    state: dict[str, Tensor] = {}
    for file in sorted(folder.glob("model*.safetensors")):
        state.update(load_file(file))
    if not state:
        raise FileNotFoundError(f"no model weights in {folder}")
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if [k for k in missing if k not in tied] or unexpected:
        raise RuntimeError(f"{folder} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


class ActorCritic(nn.Module):
    """Policy (causal LM, plain or LoRA) and critic (value model) as one module.

    Calling it runs the policy, so log-prob code and samplers see a causal LM; ``values`` runs the
    critic. ``save_pretrained(path)`` writes the policy at ``path`` and the critic at ``path/value``.
    """

    def __init__(self, policy: nn.Module, critic: nn.Module) -> None:
        super().__init__()
        self.policy, self.critic = policy, critic

    @property
    def generator(self) -> nn.Module:
        """The causal LM to sample from."""
        return self.policy

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.policy(*args, **kwargs)

    def values(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """V at every position, shape (R, L)."""
        return token_values(self.critic, input_ids, position_ids, attention_mask)

    def disable_adapter(self) -> contextlib.AbstractContextManager:
        """The reference policy of a LoRA policy: its base model with the adapter off."""
        return self.policy.disable_adapter()

    def parts(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(policy parameters, critic parameters), for their own learning rates."""
        return list(self.policy.parameters()), list(self.critic.parameters())

    def save_pretrained(self, path: str | Path, **kwargs: Any) -> None:
        self.policy.save_pretrained(path, **kwargs)
        self.critic.save_pretrained(Path(path) / VALUE_DIR, **kwargs)

    def load_pretrained_weights(self, path: str | Path) -> None:
        """Restore what ``save_pretrained`` wrote (a checkpoint) into this module."""
        _load_into(self.policy, Path(path))
        _load_into(self.critic, Path(path) / VALUE_DIR)

    def merge_and_unload(self) -> ActorCritic:
        """For the final export (called on a copy): a LoRA policy merged into its base model."""
        policy = self.policy.merge_and_unload() if _is_peft(self.policy) else self.policy
        return ActorCritic(policy, self.critic)


@contextlib.contextmanager
def active_adapter(model: nn.Module, name: str) -> Iterator[None]:
    """Route every LoRA layer of ``model`` through adapter ``name`` for the block.

    Sets the layers' active adapter directly: peft's ``set_adapter`` would also flip
    ``requires_grad``, dropping the other adapter from the optimiser's view mid-step.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._active_adapter for m in layers]
    for m in layers:
        m._active_adapter = [name]
    try:
        yield
    finally:
        for m, previous in zip(layers, before, strict=True):
            m._active_adapter = previous


class SharedLoraActorCritic(nn.Module):
    """One base model for policy, critic and reference: LoRA adapters ``default`` (policy) and
    ``value`` plus a linear value head (initialised from ``seed``, bias 0); the reference is the
    base with adapters disabled. Saved as peft does (``path`` the policy adapter, ``path/value``
    the value adapter) with the head in ``path/value/value_head.safetensors``."""

    def __init__(self, peft_model: nn.Module, *, seed: int = 0) -> None:
        super().__init__()
        from peft import LoraConfig

        self.policy = peft_model
        config = copy.deepcopy(peft_model.peft_config[POLICY_ADAPTER])
        hidden = peft_model.get_base_model().config.get_text_config().hidden_size
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            peft_model.add_adapter(VALUE_ADAPTER, LoraConfig(**{k: getattr(config, k) for k in (
                "r", "lora_alpha", "lora_dropout", "target_modules")}, task_type=config.task_type))
            self.value_head = nn.Linear(hidden, 1)
            nn.init.normal_(self.value_head.weight, std=1.0 / hidden**0.5)
            nn.init.zeros_(self.value_head.bias)
        self.value_head.to(next(peft_model.parameters()).device)
        for name, p in peft_model.named_parameters():  # add_adapter leaves the new adapter frozen
            if "lora_" in name and f".{VALUE_ADAPTER}." in name:
                p.requires_grad_(True)

    generator = ActorCritic.generator
    forward = ActorCritic.forward

    @contextlib.contextmanager
    def disable_adapter(self) -> Iterator[None]:
        """The reference: the base model with every adapter off. peft re-enables only the active
        adapter's ``requires_grad`` on exit; the value adapter's is restored here."""
        trainable = [p for p in self.policy.parameters() if p.requires_grad]
        try:
            with self.policy.disable_adapter():
                yield
        finally:
            for p in trainable:
                p.requires_grad_(True)

    def values(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        base = self.policy.get_base_model()
        backbone = getattr(base, base.base_model_prefix)
        with active_adapter(self.policy, VALUE_ADAPTER):
            hidden = backbone(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                              use_cache=False).last_hidden_state
        return self.value_head(hidden)[..., 0].float()

    def parts(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        named = list(self.policy.named_parameters())
        value = [p for n, p in named if f".{VALUE_ADAPTER}." in n]
        return [p for n, p in named if f".{VALUE_ADAPTER}." not in n], value + list(self.value_head.parameters())

    def save_pretrained(self, path: str | Path, **kwargs: Any) -> None:
        self.policy.save_pretrained(path, **kwargs)  # every adapter; non-default ones in path/<name>
        save_file(dict(self.value_head.state_dict()), str(Path(path) / VALUE_DIR / VALUE_HEAD_FILE))

    def load_pretrained_weights(self, path: str | Path) -> None:
        from peft import set_peft_model_state_dict

        path = Path(path)
        for adapter, folder in ((POLICY_ADAPTER, path), (VALUE_ADAPTER, path / VALUE_DIR)):
            set_peft_model_state_dict(self.policy, load_file(folder / "adapter_model.safetensors"),
                                      adapter_name=adapter)
        self.value_head.load_state_dict(load_file(path / VALUE_DIR / VALUE_HEAD_FILE))

    def merge_and_unload(self) -> ActorCritic:
        """For the final export (called on a copy): the policy adapter merged into the base model; the
        critic kept as its adapter and head (``value/``)."""
        from peft import get_peft_model_state_dict

        critic = _LoraValueExport(self.policy.peft_config[VALUE_ADAPTER],
                                  get_peft_model_state_dict(self.policy, adapter_name=VALUE_ADAPTER), self.value_head)
        return ActorCritic(self.policy.merge_and_unload(adapter_names=[POLICY_ADAPTER]), critic)


class _LoraValueExport(nn.Module):
    """The critic of a shared-backbone actor-critic, as files: the value adapter and the head."""

    def __init__(self, adapter_config: Any, adapter_state: dict[str, Tensor], head: nn.Linear) -> None:
        super().__init__()
        self.adapter_config, self.adapter_state, self.head = adapter_config, adapter_state, head

    def save_pretrained(self, path: str | Path, **_: Any) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config = self.adapter_config.to_dict()
        (path / "adapter_config.json").write_text(json.dumps(
            {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}, indent=2, default=str))
        save_file({k: v.contiguous() for k, v in self.adapter_state.items()}, str(path / "adapter_model.safetensors"))
        save_file(dict(self.head.state_dict()), str(path / VALUE_HEAD_FILE))


def build_actor_critic(config: RLConfig, policy: torch.nn.Module, tokenizer: Any, critic: Any = None,
                       reward_functions: list | None = None) -> ActorCritic | SharedLoraActorCritic:
    """Policy + critic. The critic: ``critic`` (a loaded value / reward / causal LM, or a path), else
    ``config.critic.name_or_path``, else by ``config.critic.init`` the reward model (the path of the
    config's ``reward_model`` reward, or a ``RewardModelScorer`` among ``reward_functions``) or the policy."""
    cc = config.critic
    if cc.share_backbone:
        return SharedLoraActorCritic(policy, seed=cc.seed)
    device, seed = config.model.device, cc.seed
    source = critic if critic is not None else cc.name_or_path
    if source is None and cc.init == "reward_model":
        source = config.reward_model_path()
        scorers = [f for f in reward_functions or [] if hasattr(f, "model") and hasattr(f, "score")]
        if source is None and scorers:
            source = scorers[0].model
        if source is None:
            raise ValueError("critic.init is 'reward_model' but no reward model is named: add a reward_model "
                             "reward with a path, set critic.name_or_path, or critic.init: policy")
    if source is None:
        source = policy
    if isinstance(source, str | Path):
        value_model, _ = load_value_model(str(source), seed=seed, dtype=config.model.dtype, device=device,
                                          tokenizer=tokenizer)
    else:
        value_model = value_model_from(source, seed=seed)
    return ActorCritic(policy, value_model)
