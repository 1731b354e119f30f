import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tether.models import build_tiny, count_parameters, load_model, save_tiny


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_sizes_and_determinism():
    tiny, _ = build_tiny("tiny", seed=0)
    assert 0.5e6 < count_parameters(tiny) < 1.5e6
    assert torch.equal(flat(tiny), flat(build_tiny("tiny", seed=0)[0]))
    assert not torch.equal(flat(tiny), flat(build_tiny("tiny", seed=1)[0]))
    with pytest.raises(ValueError, match="valid sizes"):
        build_tiny("huge")


def test_small_size_is_20_to_30m():
    from tether.models.tiny import tiny_config

    config = tiny_config("small")
    h, layers, inter, v = config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size
    params = layers * (4 * h * h + 3 * h * inter + 2 * h) + 2 * v * h + h
    assert 20e6 < params < 30e6


def test_tokenizer_specials_and_chat_template():
    _, tok = build_tiny()
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id}) == 3
    ids = tok("<think>12</think>", add_special_tokens=False)["input_ids"]
    assert len(ids) == 4 and tok.decode(ids) == "<think>12</think>"
    text = tok.apply_chat_template([{"role": "user", "content": "1+1="}], add_generation_prompt=True, tokenize=False)
    assert text == "<s><|user|>1+1=</s><|assistant|>"


def test_saved_layout_reloads_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = save_tiny(tmp_path / "tiny", seed=3)
    assert (path / "model.safetensors").exists()
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert torch.equal(flat(model), flat(build_tiny(seed=3)[0]))
    assert tok("a+b")["input_ids"] == build_tiny()[1]("a+b")["input_ids"]
    loaded, _ = load_model(str(path), dtype="bfloat16")
    assert next(loaded.parameters()).dtype == torch.bfloat16


def test_lora_option_wraps_the_model():
    model, _ = load_model("tether/tiny", lora={"r": 4})
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 0 < trainable < count_parameters(model) // 10
    with pytest.raises(FileNotFoundError):
        load_model("./no/such/model")


def test_config_overrides_make_a_shallower_built_in_model(tmp_path):
    """128 hidden, 384 MLP: a decoder layer holds 4*128*128 (attention) + 3*128*384 (MLP)
    + 2*128 (norms) = 213,248 parameters, so dropping two of the four layers removes 426,496."""
    tiny, _ = load_model("tether/tiny")
    student, _ = load_model("tether/tiny", config_overrides={"num_hidden_layers": 2})
    assert student.config.num_hidden_layers == 2
    assert count_parameters(tiny) - count_parameters(student) == 2 * (4 * 128 * 128 + 3 * 128 * 384 + 2 * 128)
    with pytest.raises(ValueError, match="num_hidden_layerz"):
        load_model("tether/tiny", config_overrides={"num_hidden_layerz": 2})
    with pytest.raises(ValueError, match="built-in models only"):
        load_model(str(save_tiny(tmp_path / "t")), config_overrides={"num_hidden_layers": 2})
