"""The RL policy loss: hand-checked values, clipping, KL, and the property distributed training
relies on: with global counts, the losses (and gradients) of the parts of a batch add up to the
whole batch's, for every aggregation and every split."""
from __future__ import annotations

import math

import pytest
import torch

from harness.data.rl_batch import RLBatch
from harness.training import (
    AGGREGATIONS,
    RLTrainBatch,
    loss_counts,
    make_rl_train_batch,
    rl_loss,
)

VOCAB = 251


def _tiny_batch() -> RLTrainBatch:
    """2 x 4: row 0 unpadded (prompt 1, response 3); row 1 left-padded (prompt 2, response 1).
    Loss tokens: (0, 1), (0, 2), (0, 3), (1, 3)."""
    ids = torch.tensor([[5, 6, 7, 8], [0, 9, 10, 11]])
    attn = torch.tensor([[True] * 4, [False, True, True, True]])
    resp = torch.tensor([[False, True, True, True], [False, False, False, True]])
    batch = RLBatch(ids, attn, resp, pad_id=0).validate(VOCAB)
    adv = torch.tensor([[0.0, 1.5, 1.5, 1.5], [0.0, 0.0, 0.0, -2.0]], dtype=torch.float64)
    old = torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, 0.0, 0.0, -3.0]], dtype=torch.float64)
    ref = torch.tensor([[0.0, -1.2, -1.9, -0.4], [0.0, 0.0, 0.0, -2.5]], dtype=torch.float64)
    return RLTrainBatch(batch, adv, old, ref)


# current logprobs for _tiny_batch: ratios exp(0.1), exp(0.3) (clipped), exp(-0.05) and exp(-0.4)
# (clipped, A < 0); junk at non-loss positions must be ignored.
_LP = torch.tensor([[7.0, -0.9, -1.7, -0.55], [3.0, -1.0, 2.0, -3.4]], dtype=torch.float64)


def _hand_token_losses(eps=0.2, kl_coef=0.0):
    """Per loss token, by hand in Python floats: {(row, col): loss}."""
    tb = _tiny_batch()
    out = {}
    for b, t in [(0, 1), (0, 2), (0, 3), (1, 3)]:
        lp, old, ref, a = (float(_LP[b, t]), float(tb.old_logprobs[b, t]),
                           float(tb.ref_logprobs[b, t]), float(tb.advantages[b, t]))
        r = math.exp(lp - old)
        pg = -min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
        kl = math.exp(ref - lp) - (ref - lp) - 1
        out[(b, t)] = pg + kl_coef * kl
    return out


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_loss_matches_hand_computation(aggregation, kl_coef):
    per = _hand_token_losses(kl_coef=kl_coef)
    row0 = [per[(0, 1)], per[(0, 2)], per[(0, 3)]]
    row1 = [per[(1, 3)]]
    expected = {
        "token-mean": sum(row0 + row1) / 4,
        "seq-mean-token-mean": (sum(row0) / 3 + sum(row1) / 1) / 2,
        "seq-mean-token-sum": (sum(row0) + sum(row1)) / 2,
    }[aggregation]
    loss, stats = rl_loss(_LP, _tiny_batch(), kl_coef=kl_coef, aggregation=aggregation)
    assert loss.dtype == torch.float64
    assert float(loss) == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert int(stats["tokens"]) == 4
    assert float(stats["clip_fraction"]) == pytest.approx(2 / 4)


def test_ratio_one_positive_advantage_is_minus_mean_advantage():
    tb = make_rl_train_batch(VOCAB, batch_size=4, seed=3, prompt_lengths=[2, 3, 4, 1],
                             response_lengths=[5, 1, 7, 3])
    tb = RLTrainBatch(tb.batch, tb.advantages.abs() + 0.1 * tb.loss_mask(), tb.old_logprobs,
                      tb.ref_logprobs)
    mask = tb.loss_mask()
    loss, stats = rl_loss(tb.old_logprobs.clone(), tb)
    expected = -(tb.advantages * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, expected)
    assert float(stats["ratio_mean"]) == pytest.approx(1.0)
    assert float(stats["clip_fraction"]) == 0.0


def test_clipping_engages_only_beyond_eps():
    tb = _tiny_batch()
    mask = tb.loss_mask()
    # A > 0 on row 0, A < 0 on row 1; every loss token gets ratio r.
    for r in (1.1, 1.19, 1.21, 1.3, 0.9, 0.81, 0.79, 0.7):
        lp = (tb.old_logprobs + math.log(r) * mask).requires_grad_(True)
        loss, stats = rl_loss(lp, tb)
        loss.backward()
        # Unclipped tokens carry gradient -A * r / N; clipped ones carry none.
        row0_zero = bool((lp.grad[0][mask[0]] == 0).all())
        row1_zero = bool((lp.grad[1][mask[1]] == 0).all())
        assert row0_zero == (r > 1.2), r  # A > 0: clipped above 1 + eps
        assert row1_zero == (r < 0.8), r  # A < 0: clipped below 1 - eps
        assert float(stats["clip_fraction"]) == pytest.approx(
            (3 * row0_zero + 1 * row1_zero) / 4)


def test_clip_eps_high_widens_only_the_upper_bound():
    tb = _tiny_batch()
    mask = tb.loss_mask()
    lp = tb.old_logprobs + math.log(1.25) * mask  # ratio 1.25: beyond 1.2, within 1.28
    _, sym = rl_loss(lp, tb, clip_eps=0.2)
    _, asym = rl_loss(lp, tb, clip_eps=0.2, clip_eps_high=0.28)
    assert float(sym["clip_fraction"]) == pytest.approx(3 / 4)   # row 0 (A > 0) clipped
    assert float(asym["clip_fraction"]) == 0.0
    lp = tb.old_logprobs + math.log(0.75) * mask  # below 1 - eps: eps_high must not matter
    _, low = rl_loss(lp, tb, clip_eps=0.2, clip_eps_high=0.28)
    assert float(low["clip_fraction"]) == pytest.approx(1 / 4)   # row 1 (A < 0) clipped


def test_kl_is_zero_when_ref_equals_logprobs():
    tb = make_rl_train_batch(VOCAB, batch_size=4, seed=1, prompt_lengths=3,
                             response_lengths=[4, 2, 6, 1])
    lp = tb.ref_logprobs.clone()
    with_kl, stats = rl_loss(lp, tb, kl_coef=0.5)
    without, _ = rl_loss(lp, tb, kl_coef=0.0)
    assert float(stats["kl"]) == 0.0
    assert torch.equal(with_kl, without)
    # ... and positive otherwise.
    _, stats = rl_loss(tb.old_logprobs, tb, kl_coef=0.5)
    assert float(stats["kl"]) > 0.0


def test_non_loss_positions_cannot_poison_loss_or_grad():
    tb = _tiny_batch()
    lp = _LP.clone()
    lp[~tb.loss_mask()] = float("nan")
    lp[0, 0] = float("inf")
    lp.requires_grad_(True)
    loss, _ = rl_loss(lp, tb, kl_coef=0.1)
    loss.backward()
    assert torch.isfinite(loss) and bool(torch.isfinite(lp.grad).all())
    assert bool((lp.grad[~tb.loss_mask()] == 0).all())


def _global_batch() -> RLTrainBatch:
    # Very different lengths per row, so parts hold different token counts.
    return make_rl_train_batch(VOCAB, batch_size=8, seed=11,
                               prompt_lengths=[5, 3, 7, 1, 10, 2, 12, 4],
                               response_lengths=[19, 9, 10, 23, 4, 13, 0, 16])


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_parts_with_global_counts_sum_to_the_whole(aggregation):
    tb = _global_batch()
    noise = torch.randn(tb.old_logprobs.shape, generator=torch.Generator().manual_seed(0))
    lp_full = (tb.old_logprobs + 0.3 * noise * tb.loss_mask()).requires_grad_(True)
    kwargs = dict(aggregation=aggregation, kl_coef=0.05, clip_eps_high=0.28)
    full, full_stats = rl_loss(lp_full, tb, **kwargs)
    full.backward()
    assert 0 < float(full_stats["clip_fraction"]) < 1  # both branches exercised
    tokens, seqs = loss_counts(tb)
    assert seqs == 7  # the row with no response is not a sequence of the loss
    for n in (1, 2, 4):
        lp = lp_full.detach().clone().requires_grad_(True)
        total = torch.zeros((), dtype=torch.float32)
        stat_sums = dict.fromkeys(full_stats, 0.0)
        for part, lp_part in zip(tb.split(n), lp.split(tb.batch_size // n)):
            loss, stats = rl_loss(lp_part, part, global_token_count=tokens,
                                  global_seq_count=seqs, **kwargs)
            total = total + loss
            for k in stats:
                stat_sums[k] += float(stats[k])
        total.backward()
        torch.testing.assert_close(total, full.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(lp.grad, lp_full.grad), f"gradients differ for {n} parts"
        for k, v in full_stats.items():
            assert stat_sums[k] == pytest.approx(float(v), rel=1e-5, abs=1e-6), k


def test_local_counts_would_not_sum_to_the_whole():
    """Why global counts exist: local means of unequal parts do not add up to the global mean."""
    tb = _global_batch()
    lp = tb.old_logprobs.clone()
    full, _ = rl_loss(lp, tb)
    halves = sum(rl_loss(lp_part, part)[0] for part, lp_part in zip(tb.split(2), lp.split(4)))
    assert abs(float(halves) - 2 * float(full)) > 1e-3 and abs(float(halves) - float(full)) > 1e-3


def test_bad_inputs_raise():
    tb = _tiny_batch()
    with pytest.raises(ValueError, match="aggregation"):
        rl_loss(_LP, tb, aggregation="mean")
    with pytest.raises(ValueError, match="logprobs"):
        rl_loss(_LP[:, :3], tb)
