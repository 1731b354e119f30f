"""Float32 linear layers on oneDNN (``tether.models.linear``): the same products and gradients as ``F.linear``,
switched only where they qualify and only inside the block, and run by the trainers' training forward, their
frozen passes and the engine's prefill."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tether.models.linear as linear
from tether.models import build_tiny
from tether.models.linear import OneDnnLinear, onednn_float32_pays, onednn_linear, onednn_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")


@pytest.fixture
def onednn_pays(monkeypatch):
    """Pretend this processor is one where oneDNN beats MKL (the tests run on Intel machines too)."""
    monkeypatch.setattr(linear, "_onednn_beats_mkl", lambda: True)


def wide_model(seed=0):
    """A one-layer model 512 wide, so every projection qualifies."""
    return build_tiny("tiny", seed=seed, hidden_size=512, intermediate_size=640, num_hidden_layers=1,
                      num_attention_heads=4)


def counting(monkeypatch):
    calls = []
    product = linear._onednn_product
    monkeypatch.setattr(linear, "_onednn_product", lambda *a: calls.append(a[0].shape) or product(*a))
    return calls


@pytest.mark.parametrize("bias", [True, False])
def test_the_product_and_its_gradients_equal_f_linear_to_float32_rounding(bias):
    torch.manual_seed(0)
    x = torch.randn(3, 7, 512, requires_grad=True)
    weight = torch.randn(300, 512, requires_grad=True)
    b = torch.randn(300, requires_grad=True) if bias else None
    out, expected = OneDnnLinear.apply(x, weight, b), F.linear(x, weight, b)
    assert out.shape == (3, 7, 300)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    grad = torch.randn_like(out)
    inputs = (x, weight, b) if bias else (x, weight)
    for mine, reference in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(expected, inputs, grad),
                               strict=True):
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-4)


def test_a_frozen_weight_gets_no_gradient_and_a_hand_computed_product_matches():
    x = torch.full((2, 512), 0.5, requires_grad=True)
    weight = torch.ones(4, 512)  # frozen, as a LoRA base layer's
    out = OneDnnLinear.apply(x, weight, torch.arange(4.0))
    assert out.tolist() == [[256.0, 257.0, 258.0, 259.0]] * 2
    out.sum().backward()
    assert weight.grad is None and torch.equal(x.grad, torch.full((2, 512), 4.0))


def test_only_wide_float32_cpu_weights_qualify_and_only_on_processors_where_onednn_wins(monkeypatch):
    monkeypatch.setattr(linear, "_onednn_beats_mkl", lambda: True)
    assert onednn_float32_pays(torch.zeros(8, 512))
    assert not onednn_float32_pays(torch.zeros(8, 128))  # the tiny model's width: unchanged
    assert not onednn_float32_pays(torch.zeros(8, 512, dtype=torch.bfloat16))
    monkeypatch.setattr(linear, "_onednn_beats_mkl", lambda: False)  # an Intel processor: MKL stays
    assert not onednn_float32_pays(torch.zeros(8, 512))
    assert linear.cpu_vendor() == linear.cpu_vendor()  # read once; "" where /proc/cpuinfo is absent


def test_onednn_linear_falls_back_to_f_linear_under_autocast_and_for_other_dtypes(onednn_pays, monkeypatch):
    calls = counting(monkeypatch)
    weight = torch.randn(16, 512)
    onednn_linear(torch.randn(2, 512), weight)
    assert len(calls) == 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert onednn_linear(torch.randn(2, 512), weight).dtype == torch.bfloat16
    onednn_linear(torch.randn(2, 512, dtype=torch.float64), weight.double())
    assert len(calls) == 1


def test_onednn_linears_switches_plain_linears_inside_the_block_and_restores_them(onednn_pays, monkeypatch):
    model, _ = wide_model()
    model.eval()
    ids = torch.tensor([[1, 5, 9, 13, 20]])
    expected = model(ids).logits
    hooked = model.model.layers[0].mlp.down_proj
    hooked.forward = hooked.forward  # an instance forward someone else installed (accelerate's hooks)
    plain = [m for m in model.modules() if type(m) is nn.Linear]
    calls = counting(monkeypatch)
    with onednn_linears(model) as switched:
        assert switched == len(plain) - 1
        logits = model(ids).logits
    assert len(calls) == switched
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert all("forward" not in m.__dict__ for m in plain if m is not hooked) and "forward" in hooked.__dict__
    with pytest.raises(RuntimeError), onednn_linears(model):
        raise RuntimeError("inside")
    assert all("forward" not in m.__dict__ for m in plain if m is not hooked)


def test_the_tiny_model_and_an_intel_processor_switch_nothing(monkeypatch):
    model, _ = build_tiny("tiny", seed=0)
    monkeypatch.setattr(linear, "_onednn_beats_mkl", lambda: True)
    with onednn_linears(model) as switched:
        assert switched == 0
    monkeypatch.setattr(linear, "_onednn_beats_mkl", lambda: False)
    with onednn_linears(wide_model()[0]) as switched:
        assert switched == 0


def test_training_forward_and_frozen_passes_run_onednn_so_dpo_starts_at_zero(onednn_pays, monkeypatch, tmp_path):
    """The reference pass runs the training forward's kernel: at the first step (policy = reference) DPO's
    implicit rewards are 0 and the loss log 2, as with PyTorch's own kernel."""
    from tether.tasks import get_task
    from tether.tasks.preferences import preference_records
    from tether.trainers.preference import DPOConfig, PreferenceTrainer

    pairs = preference_records(get_task("arithmetic", digits=2), 8, kind="style")
    cfg = DPOConfig(name="dpo", data={"task": {"n": 8}}, report_to=[],
                    train={"max_steps": 1, "batch_size": 8, "progress": False, "precision": "fp32"})
    model, tokenizer = wide_model()
    trainer = PreferenceTrainer(cfg, model, tokenizer, tmp_path, records=pairs, eval_records=pairs)
    calls = counting(monkeypatch)
    trainer.prepare_reference(use_cache=False)
    frozen = len(calls)
    metrics = trainer.training_step()
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert frozen >= linears and len(calls) - frozen >= 2 * linears  # the step's forward and input gradients
    assert abs(metrics["rewards/chosen"]) < 2e-6 and abs(metrics["rewards/rejected"]) < 2e-6
    assert metrics["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_the_engine_prefills_on_onednn_and_decodes_the_same_greedy_tokens(onednn_pays, monkeypatch):
    from tether.rollout import HFEngine, SamplingParams

    model, tokenizer = wide_model(seed=3)
    model.eval()
    prompts = [tokenizer.encode("<|user|>12+34=", add_special_tokens=False), [1, 40, 41]]
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    monkeypatch.setattr(linear, "_onednn_beats_mkl", lambda: False)
    expected = HFEngine(model, tokenizer).generate(prompts, params)
    monkeypatch.setattr(linear, "_onednn_beats_mkl", lambda: True)
    calls = counting(monkeypatch)
    rollout = HFEngine(model, tokenizer).generate(prompts, params)
    assert calls and tuple(calls[0]) == (sum(len(p) for p in prompts), 512)  # the prompts' real tokens, packed
    assert rollout.completion_ids == expected.completion_ids
    for mine, reference in zip(rollout.completion_logprobs, expected.completion_logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(mine), torch.tensor(reference), rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_runs_agrees_with_the_kernel(dtype):
    """Where ``onednn_runs`` says yes, oneDNN's prepacked product computes the linear map; where oneDNN is
    built in but it says no (bfloat16 on an AVX2 processor), the kernel refuses the product."""
    x, weight = torch.randn(3, 16, dtype=dtype), torch.randn(5, 16, dtype=dtype)

    def product() -> torch.Tensor:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 3)
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    if linear.onednn_runs(dtype):
        assert torch.allclose(product().float(), F.linear(x, weight).float(), rtol=2e-2, atol=2e-2)
    elif linear.onednn_available():
        with pytest.raises(RuntimeError):
            product()


def test_cpuinfo_fields_are_matched_by_their_whole_key(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("vendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\nmodel\t\t: 1\ncpu family\t: 25\n")
    monkeypatch.setattr(linear, "CPUINFO", cpuinfo)
    assert linear.cpuinfo_field("model") == "1"
    assert linear.cpuinfo_field("model name") == "AMD EPYC"
    assert linear.cpuinfo_field("cpu family") == "25"
    assert linear.cpuinfo_field("stepping") == ""
    monkeypatch.setattr(linear, "CPUINFO", tmp_path / "absent")
    assert linear.cpuinfo_field("vendor_id") == ""


def test_float32_decode_packs_use_onednn_on_every_amd_processor(monkeypatch):
    """oneDNN's float32 pack beat MKL's on AMD processors with and without AVX-512; Intel keeps MKL's."""
    for vendor, expected in (("AuthenticAMD", True), ("HygonGenuine", True), ("GenuineIntel", False), ("", False)):
        monkeypatch.setattr(linear, "cpu_vendor", lambda vendor=vendor: vendor)
        assert linear.onednn_packs_float32.__wrapped__() == (expected and linear.onednn_runs(torch.float32))
