"""The scalar-head reward model: HF layout, packed scores equal the padded HF forward."""

import torch
from transformers import AutoModelForSequenceClassification

from tether.data.tokenize import split_steps, step_sequence
from tether.models import save_tiny
from tether.models.reward_model import (
    build_tiny_reward_model,
    load_reward_model,
    reward_info,
    score_positions,
    set_reward_info,
)

torch.set_num_threads(1)


def test_tiny_reward_model_is_deterministic_and_scalar():
    a, tok = build_tiny_reward_model(seed=0)
    b, _ = build_tiny_reward_model(seed=0)
    c, _ = build_tiny_reward_model(seed=1)
    assert type(a).__name__ == "LlamaForSequenceClassification" and a.config.num_labels == 1
    assert torch.equal(a.score.weight, b.score.weight) and not torch.equal(a.score.weight, c.score.weight)
    assert len(tok) == a.get_input_embeddings().num_embeddings


def test_from_causal_lm_checkpoint_keeps_the_backbone(tmp_path):
    path = save_tiny(tmp_path / "lm", seed=3)
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(path)
    rm, tok = load_reward_model(str(path), seed=5)
    assert torch.equal(rm.model.embed_tokens.weight, lm.model.embed_tokens.weight)
    assert torch.equal(rm.model.layers[0].mlp.up_proj.weight, lm.model.layers[0].mlp.up_proj.weight)
    again, _ = load_reward_model(str(path), seed=5)
    assert torch.equal(rm.score.weight, again.score.weight)  # the new head is drawn from the seed
    assert rm.config.pad_token_id == tok.pad_token_id


def test_packed_scores_equal_the_padded_hf_forward():
    model, _ = build_tiny_reward_model(seed=0)
    model.config.pad_token_id = 0
    model.eval()
    seqs = [[1, 20, 21, 22, 23], [1, 30, 31], [1, 40, 41, 42]]
    with torch.no_grad():
        packed = score_positions(model, seqs, [[len(s) - 1] for s in seqs], row_tokens=64, pad_token_id=0)
        ids = torch.zeros(3, 5, dtype=torch.long)
        mask = torch.zeros(3, 5, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
        padded = model(input_ids=ids, attention_mask=mask).logits.squeeze(-1)  # reads the last non-pad token
        # several positions of one sequence, in order, equal the last-token score of each prefix
        steps = score_positions(model, [seqs[0]], [[1, 3, 4]], row_tokens=64, pad_token_id=0)
        one = [score_positions(model, [seqs[0][: k + 1]], [[k]], row_tokens=64, pad_token_id=0) for k in (1, 3, 4)]
        unpacked = score_positions(model, seqs, [[len(s) - 1] for s in seqs], row_tokens=64, pad_token_id=0,
                                   packing=False)
    assert torch.allclose(packed, padded, atol=1e-5)
    assert torch.allclose(unpacked, padded, atol=1e-5)
    assert torch.allclose(steps, torch.cat(one), atol=1e-5)


def test_reward_info_round_trips_through_save(tmp_path):
    model, tok = build_tiny_reward_model()
    assert reward_info(model) == {"process": False, "step_separator": "\n", "aggregation": "min"}
    set_reward_info(model, process=True, step_separator="|", aggregation="product")
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path)
    assert reward_info(reloaded) == {"process": True, "step_separator": "|", "aggregation": "product"}
    assert torch.equal(reloaded.score.weight, model.score.weight)


def test_step_layout():
    _, tok = build_tiny_reward_model()
    ids, positions = step_sequence("1+2=", ["<think>2+1=3 c0", "</think>3"], tok, "|")
    text = tok.decode(ids)
    assert text == "<s>1+2=<think>2+1=3 c0|</think>3</s>"  # a finished trace's last step is read at eos
    assert [tok.decode([ids[p]]) for p in positions] == ["|", "</s>"]
    ids, positions = step_sequence("1+2=", ["<think>2+1=3 c0"], tok, "|", finished=False)
    assert tok.decode(ids) == "<s>1+2=<think>2+1=3 c0|"  # an open trace goes on after its last step
    assert tok.decode([ids[positions[-1]]]) == "|"
    assert split_steps("<think>a|b|</think>c", "|") == ["<think>a", "b", "</think>c"]
    assert split_steps("  |", "|") == []
