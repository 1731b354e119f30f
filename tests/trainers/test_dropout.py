"""``train.dropout``: off by default where the loss compares the policy's log-probs with an eval-mode pass of the
same weights (a reference, the old policy), kept in SFT; ``keep`` / ``off`` force it."""

import pytest
import torch

from tether.models import build_tiny
from tether.models.loading import disable_dropout
from tether.tasks import get_task, sft_records
from tether.tasks.preferences import preference_records
from tether.trainers.preference import DPOConfig, PreferenceTrainer
from tether.trainers.sft import SFTConfig, SFTTrainer

TASK = get_task("arithmetic", digits=2)


def rates(model: torch.nn.Module) -> list[float]:
    return ([m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
            + [m.attention_dropout for m in model.modules() if isinstance(getattr(m, "attention_dropout", None), float)])


class WithDropout(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model, self.dropout = model, torch.nn.Dropout(0.2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.model(ids).logits)


def test_disable_dropout_zeroes_every_rate_so_a_training_forward_equals_eval_mode():
    wrapped = WithDropout(build_tiny("tiny", seed=0, attention_dropout=0.5)[0])
    ids = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    wrapped.train()
    torch.manual_seed(0)
    assert not torch.equal(wrapped(ids), wrapped.eval()(ids))  # dropout was live in training mode
    assert disable_dropout(wrapped) == 4 + 1  # four attention modules and the Dropout module
    assert set(rates(wrapped)) == {0.0} and disable_dropout(wrapped) == 0
    assert torch.equal(wrapped.train()(ids), wrapped.eval()(ids))


def dpo(tmp_path, dropout: str):
    pairs = preference_records(TASK, 16, kind="style")
    cfg = DPOConfig(name="dpo", data={"task": {"n": 16}}, report_to=[],
                    train={"max_steps": 1, "batch_size": 8, "progress": False, "dropout": dropout})
    model, tokenizer = build_tiny("tiny", seed=0, attention_dropout=0.5)
    return PreferenceTrainer(cfg, model, tokenizer, tmp_path / dropout, records=pairs, eval_records=pairs)


def test_dpo_turns_dropout_off_by_default_so_its_first_step_scores_zero(tmp_path):
    trainer = dpo(tmp_path, "auto")
    assert set(rates(trainer.model)) == {0.0}
    trainer.prepare_reference(use_cache=False)
    metrics = trainer.training_step()
    assert metrics["rewards/chosen"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["rewards/rejected"] == pytest.approx(0.0, abs=1e-6)

    kept = dpo(tmp_path, "keep")  # with dropout the policy's training forward is not its reference pass
    assert set(rates(kept.model)) == {0.5}
    kept.prepare_reference(use_cache=False)
    metrics = kept.training_step()
    assert abs(metrics["rewards/chosen"]) + abs(metrics["rewards/rejected"]) > 1e-3


@pytest.mark.parametrize(("dropout", "expected"), [("auto", {0.5}), ("off", {0.0})])
def test_sft_keeps_dropout_unless_told_otherwise(tmp_path, dropout, expected):
    cfg = SFTConfig(name="sft", data={"task": {"name": "arithmetic", "n": 8}}, report_to=[],
                    train={"max_steps": 1, "batch_size": 4, "progress": False, "dropout": dropout})
    model, tokenizer = build_tiny("tiny", seed=0, attention_dropout=0.5)
    SFTTrainer(cfg, model, tokenizer, tmp_path / dropout, records=sft_records(TASK, 8, seed=0))
    assert set(rates(model)) == expected
