import math

import torch

from tether.core.language_modeling import next_token_loss


def test_next_token_loss_by_hand():
    """Uniform logits over V=4: every target costs log 4. Labels [x, 1, -100, 2] -> targets at
    positions 0 and 2 (labels[1], labels[3]); 2 tokens; sum = 2 log 4; mean = log 4."""
    logits = torch.zeros(1, 4, 4, requires_grad=True)
    labels = torch.tensor([[-100, 1, -100, 2]])
    loss, metrics = next_token_loss(logits, labels)
    assert math.isclose(loss.item(), math.log(4), rel_tol=1e-6)
    assert metrics["loss_tokens"].item() == 2
    # a global denominator of 8 tokens divides the same sum
    loss8, _ = next_token_loss(logits, labels, denominator=8)
    assert math.isclose(loss8.item(), 2 * math.log(4) / 8, rel_tol=1e-6)


def test_next_token_loss_matches_a_loop():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.randint(0, 7, (2, 5))
    labels[0, 2] = -100
    loss, _ = next_token_loss(logits, labels)
    total, count = 0.0, 0
    for b in range(2):
        for t in range(4):
            target = labels[b, t + 1].item()
            if target != -100:
                total -= torch.log_softmax(logits[b, t], -1)[target].item()
                count += 1
    assert math.isclose(loss.item(), total / count, rel_tol=1e-5)


def test_aligned_labels_give_the_shifted_loss():
    """predicted_labels by hand, and the loss on logits already aligned with them (the loss positions only, as a
    large-vocabulary SFT step computes them) equals the shifted loss over every position."""
    from tether.core.language_modeling import predicted_labels

    labels = torch.tensor([[-100, 1, -100, 2], [5, 6, 7, -100]])
    assert predicted_labels(labels).tolist() == [[1, -100, 2, -100], [6, 7, -100, -100]]
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 9)
    loss, metrics = next_token_loss(logits, labels, denominator=5)
    predicted = predicted_labels(labels).reshape(-1)
    positions = (predicted != -100).nonzero().squeeze(-1)
    scored = logits.reshape(-1, 9)[positions][None]
    aligned, aligned_metrics = next_token_loss(scored, predicted[positions][None], denominator=5, aligned=True)
    torch.testing.assert_close(aligned, loss)
    assert aligned_metrics["loss_tokens"] == metrics["loss_tokens"] == 4
