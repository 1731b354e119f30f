"""Spreading one model over the ranks of a ``torchrun`` job: DDP or FSDP2, and their checkpoints.

``train.strategy`` picks how (`wrap_model` applies it once the process group exists; in a single
process nothing is wrapped):

- ``ddp``: ``torch.nn.parallel.DistributedDataParallel``; every rank holds the whole model and
  gradients are averaged in backward. Checkpoints are the Hugging Face layout written by rank 0.
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every decoder layer (the classes the model
  names in ``_no_split_modules``), on each other module holding parameters (embeddings, final
  norm, heads; tied ones together), then on the root; parameters, gradients and optimiser state
  are sharded ``DTensor``s (``Shard(0)``). The root is initialised at once (FSDP2's private
  ``_lazy_init``, as its first forward would), so trainers that call a reward model's backbone and
  head separately work too. Checkpoints are sharded: every rank writes its shards
  with ``torch.distributed.checkpoint`` (DCP), and loading reshards, so a run saved on 2 ranks
  resumes on 1 or 8. The final model is gathered to rank 0 and exported in the Hugging Face layout.

What is not sharded: frozen copies a trainer makes before training (the RL reference model, the
PPO reward model) stay whole on every rank, and generation runs inside :func:`full_parameters`,
which gathers the policy's weights once per rollout batch so that ranks may decode different
numbers of tokens without waiting on each other's all-gathers. LoRA models and PPO's actor-critic
are not sharded (use DDP); the model is materialised whole on each rank before it is sharded.

The loss side needs nothing here: losses are divided by counts summed over every rank (see
``Trainer.global_count``), and both DDP and FSDP2 average gradients over ranks, so W ranks x A
accumulation steps give the gradient of the same global mean as 1 rank x W*A steps.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tether.config.base import ConfigError
from tether.models.loading import no_progress_bars
from tether.trainers.distributed import DistInfo, barrier

DCP_DIR = "dcp"
STRATEGIES = ("ddp", "fsdp2")


class ModelDDP(DistributedDataParallel):
    """DDP whose unknown attributes are read from the wrapped model, so trainers keep calling
    ``self.model.config``, ``self.model.disable_adapter()`` or a composite model's parts."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DDP wrapper (an FSDP2 model is its own module)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def _fsdp():
    from torch.distributed.fsdp import FSDPModule, fully_shard

    return FSDPModule, fully_shard


def is_sharded(model: torch.nn.Module) -> bool:
    FSDPModule, _ = _fsdp()
    return isinstance(unwrap(model), FSDPModule)


def layer_classes(model: torch.nn.Module) -> set[str]:
    """Class names of the transformer blocks: every ``_no_split_modules`` declared in the model tree."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def wrap_model(model: torch.nn.Module, strategy: str) -> torch.nn.Module:
    """DDP-wrap or FSDP2-shard ``model`` for the current process group; unchanged in one process."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown train.strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
    if not _distributed():
        return model
    device = next(model.parameters()).device
    if strategy == "ddp":
        # no buffer sync in forward: generation calls the model a different number of times per rank, and
        # a buffer broadcast in each forward would make those calls collective
        params = inspect.signature(DistributedDataParallel.__init__).parameters
        no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
        return ModelDDP(model, device_ids=[device.index] if device.type == "cuda" else None, **no_sync)
    from transformers import PreTrainedModel

    if hasattr(model, "peft_config"):
        raise ConfigError("train.strategy fsdp2 does not support LoRA models; use strategy ddp")
    if not isinstance(model, PreTrainedModel):  # its final export needs save_pretrained with a gathered state
        raise ConfigError(f"train.strategy fsdp2 shards Hugging Face models, not a {type(model).__name__} "
                         "(PPO's actor-critic); use strategy ddp")
    from torch.distributed.device_mesh import init_device_mesh

    _, fully_shard = _fsdp()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    blocks = layer_classes(model)
    layers = [m for m in model.modules() if type(m).__name__ in blocks]
    if not layers:
        raise ValueError(f"fsdp2: found no transformer blocks in {type(model).__name__} (no _no_split_modules)")
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    for group in _other_units(model, layers):
        fully_shard(group, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # Make the whole model the root now: then a trainer may call a part directly (a reward model's backbone,
    # then its head) and that part runs as the iteration's root, as FSDP2 allows for inner modules.
    model._get_fsdp_state()._lazy_init()
    return model


def _other_units(model: torch.nn.Module, layers: list[torch.nn.Module]) -> list[Any]:
    """The modules outside the transformer blocks that hold parameters (embeddings, final norm, heads),
    one FSDP2 unit each; modules sharing a parameter (tied embeddings) form one unit. The root's own
    parameters, if any, stay with the root."""
    inside = {id(m) for layer in layers for m in layer.modules()}
    groups: list[tuple[set[int], list[torch.nn.Module]]] = []
    for module in model.modules():
        ids = {id(p) for p in module.parameters(recurse=False)}
        if module is model or id(module) in inside or not ids:
            continue
        members = [module]
        for group in [g for g in groups if g[0] & ids]:
            groups.remove(group)
            ids |= group[0]
            members = group[1] + members
        groups.append((ids, members))
    return [members[0] if len(members) == 1 else members for _, members in groups]


@contextlib.contextmanager
def full_parameters(model: torch.nn.Module) -> Iterator[None]:
    """Gather an FSDP2 model's full weights on every rank for the duration (generation, evaluation).

    Every rank must enter together (the gather is collective); inside, forward passes communicate
    nothing, so ranks may run different numbers of them. A no-op for DDP or a single process.
    """
    FSDPModule, _ = _fsdp()
    model = unwrap(model)
    if not isinstance(model, FSDPModule) or getattr(model, "_tether_gathered", False):  # re-entrant
        yield
        return
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    layers = [m for m in modules if m is not model]
    for m in modules:
        m.unshard()
    for m in layers:  # the root never reshards after forward; blocks would, one all-gather per call
        m.set_reshard_after_forward(False, recurse=False)
    model._tether_gathered = True
    try:
        yield
    finally:
        model._tether_gathered = False
        for m in layers:
            m.set_reshard_after_forward(True, recurse=False)
        for m in modules:
            m.reshard()


def gathered(model: torch.nn.Module, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run inside :func:`full_parameters` of ``model``."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with full_parameters(model):
            return fn(*args, **kwargs)

    return run


def average_unsynced_gradients(model: torch.nn.Module) -> None:
    """Average over the ranks the gradients a DDP model holds after a backward its wrapper did not see.

    DDP averages gradients in backward only after its own ``forward`` has run (that arms its reducer). A loss
    computed through a part of the wrapped module alone, such as PPO's critic warm-up calling the critic's
    ``values``, leaves each rank with its own gradients; this averages them (one all-reduce of every gradient
    that is set, as DDP's mean) and leaves parameters without a gradient at None, so AdamW still skips them.
    Every rank must call it, after the same backward passes (the set of gradients is then the same on each).
    A no-op in one process and for a model not wrapped in DDP."""
    if not isinstance(model, DistributedDataParallel) or not _distributed():
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat.div_(dist.get_world_size())
    for grad, averaged in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(averaged)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The whole model's weights on CPU on rank 0 (None elsewhere); collective under FSDP2."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not is_sharded(model):
        return None
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state if DistInfo.current().is_main else None


# ---- sharded checkpoints (DCP) ------------------------------------------------------------------------


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it "assumes a single process" even when told so (``no_dist``); that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def is_sharded_checkpoint(path: Path) -> bool:
    return (Path(path) / DCP_DIR).is_dir()


def save_sharded(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank writes its shards of the model and optimiser state into ``path/dcp`` (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(unwrap(model), optimizer)
    with _quiet_single_process():
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(Path(path) / DCP_DIR),
                 no_dist=not _distributed())


def load_sharded(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Load ``path/dcp`` into ``model`` (and ``optimizer``), resharded to this job's layout: sharded
    under FSDP2, whole in a single process or under DDP, whatever the number of ranks that wrote it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from tether.trainers.checkpoint import CheckpointError

    model = unwrap(model)
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        state = {"model": get_model_state_dict(model)}
    else:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
    try:
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=str(Path(path) / DCP_DIR), no_dist=not _distributed())
    except Exception as err:  # DCP wraps read errors from each rank
        raise CheckpointError(f"checkpoint {path}: cannot load the sharded state: {err}") from err
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def save_sharded_checkpoint(stage_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                            tokenizer: Any, trainer_state: dict[str, Any], *, keep: int) -> Path | None:
    """A ``step-N`` checkpoint in sharded form: every rank writes its DCP shards into a staging folder,
    then rank 0 moves them into the checkpoint's ``.tmp`` directory next to the trainer state, the
    tokenizer and the model config, and publishes it with ``checkpoint.save_checkpoint``'s rename.
    Collective; returns the path on rank 0, None elsewhere."""
    from tether.trainers import checkpoint as ckpt

    info = DistInfo.current()
    staging = ckpt.checkpoint_dir(stage_dir) / f"dcp-staging-{step:06d}"
    if info.is_main:
        staging.parent.mkdir(parents=True, exist_ok=True)
        for stale in staging.parent.glob("dcp-staging-*"):
            shutil.rmtree(stale, ignore_errors=True)
    barrier()
    save_sharded(staging, model, optimizer)
    barrier()
    path = None
    if info.is_main:
        def write_model(tmp: Path) -> None:
            (staging / DCP_DIR).rename(tmp / DCP_DIR)
            unwrap(model).config.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)

        try:
            path = ckpt.save_checkpoint(stage_dir, step, model, tokenizer, trainer_state, keep=keep,
                                        write_model=write_model)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    barrier()
    return path


def export_checkpoint(checkpoint: str | Path, out: str | Path) -> Path:
    """Write a sharded checkpoint's model in the Hugging Face layout (one process, no GPU needed)."""
    import transformers

    from tether.trainers import checkpoint as ckpt

    checkpoint, out = Path(checkpoint), Path(out)
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    architecture = (config.architectures or ["AutoModelForCausalLM"])[0]
    model_class = getattr(transformers, architecture)
    model = model_class(config) if architecture != "AutoModelForCausalLM" else model_class.from_config(config)
    load_sharded(checkpoint, model, None)
    with no_progress_bars():
        model.save_pretrained(out, safe_serialization=True)
    skip = {ckpt.STATE_FILE, ckpt.MANIFEST_FILE, "config.json"}
    for file in checkpoint.iterdir():  # the tokenizer and generation config, as saved
        if file.is_file() and file.name not in skip and not (out / file.name).exists():
            shutil.copy2(file, out / file.name)
    return out


# ---- RL: advantages over the whole job's batch --------------------------------------------------------


def global_advantages(name: str, inputs: Any, **hparams: Any) -> Any:
    """``compute_advantages`` over every rank's rollouts: the inputs are gathered (completions padded to
    the longest on any rank), the estimator runs on the whole batch on every rank, and this rank's
    rows come back. Group statistics are unaffected (a rank holds whole groups); batch statistics
    (REINFORCE's baseline, REINFORCE++'s whitening) and the logged figures are those of the global
    batch, as in one process. ``compute_advantages`` itself in a single process."""
    from tether.core.advantages import AdvantageInputs, AdvantageOutputs, compute_advantages
    from tether.trainers.distributed import all_gather_objects, all_gather_rows

    if DistInfo.current().world_size == 1:
        return compute_advantages(name, inputs, **hparams)
    rows, width = inputs.mask.shape
    counts = all_gather_objects(rows)
    start = sum(counts[:DistInfo.current().rank])

    def gather(tensor: torch.Tensor | None, pad: float = 0.0) -> torch.Tensor | None:
        if tensor is None:
            return None
        parts = all_gather_rows(tensor.float())
        if tensor.dim() == 2:
            longest = max(p.shape[1] for p in parts)
            parts = [torch.nn.functional.pad(p, (0, longest - p.shape[1]), value=pad) for p in parts]
        return torch.cat(parts).to(tensor.dtype)

    whole = AdvantageInputs(rewards=gather(inputs.rewards), mask=gather(inputs.mask), group_size=inputs.group_size,
                            token_rewards=gather(inputs.token_rewards), baseline_rewards=gather(inputs.baseline_rewards),
                            values=gather(inputs.values), running_baseline=inputs.running_baseline,
                            step_rewards=gather(inputs.step_rewards), step_ends=gather(inputs.step_ends, pad=-1))
    out = compute_advantages(name, whole, **hparams)
    mine = slice(start, start + rows)
    return AdvantageOutputs(advantages=out.advantages[mine, :width],
                            returns=None if out.returns is None else out.returns[mine, :width],
                            metrics=out.metrics, state=out.state)
