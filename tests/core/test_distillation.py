"""Distillation divergences: hand-computed values, a naive second implementation, gradients, top-k."""

import math

import pytest
import torch

from tether.core.distillation import (
    DISTILLATION_DIVERGENCES,
    forward_kl,
    generalized_jsd,
    sampled_reverse_kl,
    top_k_restricted,
)

P_T = torch.tensor([0.5, 0.25, 0.25])
P_S = torch.tensor([0.25, 0.5, 0.25])


def naive_kl(p, q):
    return sum(float(a) * math.log(float(a) / float(b)) for a, b in zip(p, q, strict=True) if a > 0)


def naive_jsd(p_s, p_t, beta):
    """GKD's generalised JSD written out over the vocabulary in plain Python floats."""
    m = [beta * float(t) + (1 - beta) * float(s) for s, t in zip(p_s, p_t, strict=True)]
    return beta * naive_kl(p_t, m) + (1 - beta) * naive_kl(p_s, m)


def test_hand_computed_values():
    # KL(T || S) = 0.5 ln 2 + 0.25 ln 0.5 = 0.25 ln 2; symmetric here, so KL(S || T) is the same
    assert float(forward_kl(P_S.log(), P_T.log())) == pytest.approx(0.25 * math.log(2), abs=1e-7)
    assert float(generalized_jsd(P_S.log(), P_T.log(), beta=1.0)) == pytest.approx(0.25 * math.log(2), abs=1e-7)
    # JSD(0.5) with M = (0.375, 0.375, 0.25): 0.5 [0.5 ln(4/3) + 0.25 ln(2/3)] + 0.5 [0.25 ln(2/3) + 0.5 ln(4/3)]
    expected = 0.5 * math.log(4 / 3) + 0.25 * math.log(2 / 3)
    assert float(generalized_jsd(P_S.log(), P_T.log(), beta=0.5)) == pytest.approx(expected, abs=1e-7)
    assert sampled_reverse_kl(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -0.5]])).tolist() == [[0.5, -1.5]]


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_against_a_naive_implementation_on_random_distributions(beta):
    torch.manual_seed(0)
    student, teacher = torch.randn(4, 5, 7).log_softmax(-1), (2 * torch.randn(4, 5, 7)).log_softmax(-1)
    got = generalized_jsd(student, teacher, beta=beta)
    for i in range(4):
        for j in range(5):
            s, t = student[i, j].exp(), teacher[i, j].exp()
            want = naive_kl(t, s) if beta == 0 else naive_kl(s, t) if beta == 1 else naive_jsd(s, t, beta)
            assert float(got[i, j]) == pytest.approx(want, abs=1e-5)
            assert float(forward_kl(student, teacher)[i, j]) == pytest.approx(naive_kl(t, s), abs=1e-5)
    assert bool((got >= -1e-7).all())
    assert float(generalized_jsd(teacher, teacher, beta=beta).abs().max()) < 1e-6


def test_gradients():
    torch.manual_seed(1)
    logits = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(3, 6, dtype=torch.float64).log_softmax(-1)
    # d KL(T || softmax(z)) / dz = softmax(z) - p_T
    forward_kl(logits.log_softmax(-1), teacher).sum().backward()
    assert torch.allclose(logits.grad, logits.softmax(-1).detach() - teacher.exp(), atol=1e-12)
    for beta in (0.3, 1.0):
        assert torch.autograd.gradcheck(
            lambda z, b=beta: generalized_jsd(z.log_softmax(-1), teacher, beta=b), (logits.detach().requires_grad_(),))


def test_sampled_reverse_kl_is_an_unbiased_estimate_of_the_reverse_kl():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.multinomial(P_S, 200_000, replacement=True, generator=generator)
    estimate = sampled_reverse_kl(P_S.log()[tokens], P_T.log()[tokens]).mean()
    assert float(estimate) == pytest.approx(naive_kl(P_S, P_T), abs=3e-3)


def test_top_k_restricts_to_the_teacher_s_most_likely_tokens_and_renormalises():
    student, teacher = torch.tensor([0.1, 0.2, 0.3, 0.4]).log(), torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    s2, t2 = top_k_restricted(student, teacher, 2)
    assert t2.exp().tolist() == pytest.approx([4 / 7, 3 / 7]) and s2.exp().tolist() == pytest.approx([1 / 3, 2 / 3])
    full_s, full_t = top_k_restricted(student, teacher, 10)
    assert float(forward_kl(full_s, full_t)) == pytest.approx(float(forward_kl(student, teacher)), abs=1e-6)
    assert float(forward_kl(*top_k_restricted(student, teacher, 1))) == pytest.approx(0.0, abs=1e-7)


def test_registry_and_errors():
    assert DISTILLATION_DIVERGENCES.needs("reverse_kl") == {"token_logprobs"}
    assert DISTILLATION_DIVERGENCES.needs("jsd") == DISTILLATION_DIVERGENCES.needs("forward_kl") == {"distributions"}
    with pytest.raises(ValueError, match="share the student's vocabulary"):
        forward_kl(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(P_S.log(), P_T.log(), beta=1.5)
