"""Tests of the method in retireopd.py (sections 1-6): the math on hand-made tensors, the retirement
rule, the gradients, the prompts and the parsing of answers. Each test works its expected values out
by hand in its comments, so an instructor who turns a function into an exercise can grade it with
the tests named for it (docs/tests.md: which test grades which function). All are fast:

    python -m pytest -q test_method.py
"""

import json
import math

import pytest
import torch

import retireopd as R

torch.set_num_threads(1)  # tiny tensors: threading overhead only adds noise

# ==================================================================================================
# 1. GRPO advantages
# ==================================================================================================


def test_grpo_two_groups_hand_computed():
    # group 7: [1, 2, 3] -> mean 2, unbiased std 1          -> [-1, 0, 1] / (1 + eps)
    # group 3: [0, 10]   -> mean 5, unbiased std sqrt(50)   -> [-5, 5] / 7.0710678
    scores = torch.tensor([1.0, 0.0, 2.0, 10.0, 3.0])
    groups = torch.tensor([7, 3, 7, 3, 7])
    adv = R.grpo_advantages(scores, groups, eps=1e-6)
    expected = torch.tensor([-1 / (1 + 1e-6), -5 / (math.sqrt(50) + 1e-6), 0.0,
                             5 / (math.sqrt(50) + 1e-6), 1 / (1 + 1e-6)])
    assert torch.allclose(adv, expected, atol=1e-6)
    assert adv.dtype == torch.float32


def test_grpo_equal_scores_and_singletons_give_zero_not_nan():
    # all-equal group (0.1 three times: the float mean is not exactly 0.1) and a group of one
    scores = torch.tensor([0.1, 0.1, 0.1, 4.0, -0.1, 9.9])
    groups = torch.tensor([0, 0, 0, 1, 2, 2])
    adv = R.grpo_advantages(scores, groups)
    assert torch.equal(adv[:4], torch.zeros(4))
    assert not torch.isnan(adv).any()
    assert adv[4] < 0 < adv[5]


# ==================================================================================================
# 2. Token log-probs
# ==================================================================================================


def test_token_logprobs_hand_computed():
    # logits [0, ln 3]: p = [1/4, 3/4]; entropy = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.5623351
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]])
    logp, entropy = R.token_logprobs(logits, torch.tensor([1, 0]), torch.nn.Identity(), chunk=1,
                                     with_entropy=True)
    assert torch.allclose(logp, torch.tensor([math.log(0.75), math.log(0.25)]), atol=1e-6)
    assert torch.allclose(entropy, torch.full((2,), 0.5623351), atol=1e-6)


def test_token_logprobs_chunked_equals_naive_values_and_gradients():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    head = torch.nn.Linear(16, 1000, bias=False)
    tokens = torch.randint(0, 1000, (37,))
    chunked = R.token_logprobs(hidden, tokens, head, chunk=5)
    naive = torch.log_softmax(head(hidden), -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.allclose(chunked, naive, atol=1e-5)
    (g_chunked,) = torch.autograd.grad(chunked.sum(), hidden)
    (g_naive,) = torch.autograd.grad(naive.sum(), hidden)
    assert torch.allclose(g_chunked, g_naive, atol=1e-5)


# ==================================================================================================
# 3. The teacher-student gap K and the OPD loss
# ==================================================================================================



def test_token_logprobs_of_a_bf16_head_are_fp32_sums_of_its_weights():
    # --frozen-dtype bfloat16: the head's weights are bf16, the logits must still be fp32
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 300, bias=False).to(torch.bfloat16)
    hidden, tokens = torch.randn(9, 32).to(torch.bfloat16), torch.randint(0, 300, (9,))
    logp, entropy = R.token_logprobs(hidden, tokens, head, chunk=4, with_entropy=True)
    exact = torch.log_softmax(hidden.float() @ head.weight.float().T, -1)
    assert logp.dtype == torch.float32
    assert torch.allclose(logp, exact[torch.arange(9), tokens], atol=1e-5)
    assert torch.allclose(entropy, -(exact.exp() * exact).sum(-1), atol=1e-4)
    rounded = torch.log_softmax(head(hidden).float(), -1)[torch.arange(9), tokens]  # bf16 logits
    assert not torch.allclose(logp, rounded, atol=1e-5)

def test_k3_and_the_gap_hand_computed_masked_and_zero_for_identical():
    # d = l^old - l^T = [0, ln 2, -ln 2, 5]; k3 = e^-d - 1 + d
    #   = [0, 0.5 - 1 + 0.693147, 2 - 1 - 0.693147, (masked out)] = [0, 0.193147, 0.306853]
    # K = mean(d) over the 3 unmasked tokens = (0 + ln 2 - ln 2) / 3 = 0 (signed: it can cancel)
    old = torch.tensor([0.0, math.log(2), -math.log(2), 5.0])
    teacher = torch.zeros(4)
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    assert torch.allclose(R.k3(old, teacher)[:3], torch.tensor([0.0, 0.193147, 0.306853]), atol=1e-6)
    gap, gap_k3 = R.teacher_student_gap(old, teacher, mask)
    assert gap == pytest.approx(0.0, abs=1e-7)
    assert gap_k3 == pytest.approx((0.193147 + 0.306853) / 3, abs=1e-6)
    # K = mean(l^old - l^T): [-1, -3] vs [-2, -2] -> (1 - 1) / 2 = 0; [-1] vs [-3] -> 2
    assert R.teacher_student_gap(torch.tensor([-1.0]), torch.tensor([-3.0]), torch.ones(1))[0] == 2.0
    assert R.teacher_student_gap(torch.tensor([-3.0]), torch.tensor([-1.0]), torch.ones(1))[0] == -2.0
    same = torch.randn(50)
    assert R.teacher_student_gap(same, same.clone(), torch.ones(50)) == (0.0, 0.0)
    assert torch.all(R.k3(torch.randn(1000) * 3, torch.randn(1000) * 3) >= 0)


def test_opd_loss_value_and_gradient_equal_the_closed_forms():
    # L = mean(rho * k3), rho = exp(l - l^old), k3 = exp(l^T - l) - 1 + l - l^T;
    # dL/dl_k = rho_k (l_k - l^T_k) / N
    torch.manual_seed(0)
    logp = (-torch.rand(40) * 3).requires_grad_(True)
    old, teacher = -torch.rand(40) * 3, -torch.rand(40) * 3
    mask = (torch.rand(40) > 0.2).float()
    loss, stats = R.opd_loss(logp, old, teacher, mask)
    rho = torch.exp(logp.detach() - old)
    expected = (rho * (torch.exp(teacher - logp.detach()) - 1 + logp.detach() - teacher) * mask).sum() / mask.sum()
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-6) and stats["opd_loss"] == pytest.approx(float(expected))
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(grad, rho * (logp.detach() - teacher) * mask / mask.sum(), atol=1e-6)
    # num_tokens: micro-batch losses add up to the mini-batch's token mean
    half, _ = R.opd_loss(logp[:20], old[:20], teacher[:20], mask[:20], num_tokens=mask.sum())
    rest, _ = R.opd_loss(logp[20:], old[20:], teacher[20:], mask[20:], num_tokens=mask.sum())
    assert float((half + rest).detach()) == pytest.approx(float(loss.detach()), rel=1e-6)


def test_opd_loss_clamps_at_10_and_20():
    # l - l^old = 12 > 10: rho = e^10, and no gradient through rho (the clamp binds)
    logp = torch.tensor([0.0], requires_grad=True)
    loss, _ = R.opd_loss(logp, torch.tensor([-12.0]), torch.tensor([-1.0]), torch.ones(1))
    k3 = math.exp(-1.0) - 1 + 1.0
    assert float(loss.detach()) == pytest.approx(math.exp(10) * k3, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logp)
    # d/dl [e^10 (e^(l^T - l) - 1 + l - l^T)] = e^10 (1 - e^(l^T - l)) = e^10 (1 - e^-1)
    assert float(grad) == pytest.approx(math.exp(10) * (1 - math.exp(-1.0)), rel=1e-5)
    # l^T - l = 25 > 20: the exponential is e^20, constant; the gradient is rho * (k3 + 1) = e^20 - 25 + 1
    logp = torch.tensor([-25.0], requires_grad=True)
    loss, _ = R.opd_loss(logp, torch.tensor([-25.0]), torch.tensor([0.0]), torch.ones(1))
    assert float(loss.detach()) == pytest.approx(math.exp(20) - 1 - 25, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logp)
    assert float(grad) == pytest.approx(math.exp(20) - 1 - 25 + 1, rel=1e-5)


# ==================================================================================================
# 4. PPO-clip policy loss with the dual clip
# ==================================================================================================


def test_policy_loss_clipping_and_dual_clip_hand_computed():
    # ratios r and advantages A, clip 0.2, dual clip c = 3; per token L = max(-rA, -clip(r)A),
    # and where A < 0 also min(L, -cA):
    #   r=1.5, A=+1: max(-1.5, -1.2) = -1.2  (clipped: no gradient)
    #   r=1.5, A=-1: max( 1.5,  1.2) =  1.5  (unclipped: gradient -A r = 1.5)
    #   r=0.5, A=+1: max(-0.5, -0.8) = -0.5  (unclipped: gradient -0.5)
    #   r=0.5, A=-1: max( 0.5,  0.8) =  0.8  (clipped)
    #   r=1.1, A=+2: inside the range = -2.2 (gradient -2.2)
    #   r=5.0, A=-1: max(5, 1.2) = 5 > cap -cA = 3 -> 3 (dual clip: no gradient)
    #   r=5.0, A=+1: max(-5, -1.2) = -1.2 (clipped; the dual clip applies to A < 0 only)
    #   r=2.5, A=-2: max(5, 2.4) = 5 < cap 6 -> 5 (gradient -A r = 5)
    ratios = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.1, 5.0, 5.0, 2.5])
    logp = torch.log(ratios).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0, -1.0, 1.0, -2.0])
    loss, stats = R.policy_loss(logp, torch.zeros(8), adv, torch.ones(8), clip=0.2, dual_clip=3.0)
    per_token = [-1.2, 1.5, -0.5, 0.8, -2.2, 3.0, -1.2, 5.0]
    assert float(loss.detach()) == pytest.approx(sum(per_token) / 8, abs=1e-6)
    assert stats["pg_loss"] == pytest.approx(sum(per_token) / 8, abs=1e-6)
    # the clipped term is the larger on tokens 0, 3 and 6 -> 3/8; the dual clip binds on token 5 -> 1/8
    assert stats["clip_frac"] == pytest.approx(3 / 8) and stats["dual_clip_frac"] == pytest.approx(1 / 8)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(grad, torch.tensor([0.0, 1.5, -0.5, 0.0, -2.2, 0.0, 0.0, 5.0]) / 8, atol=1e-6)
    # without the dual clip (c huge) token 5 costs 5 and passes its gradient
    loss_plain, stats_plain = R.policy_loss(logp, torch.zeros(8), adv, torch.ones(8), clip=0.2, dual_clip=1e9)
    assert float(loss_plain.detach()) == pytest.approx((sum(per_token) - 3.0 + 5.0) / 8, abs=1e-6)
    assert stats_plain["dual_clip_frac"] == 0.0


def test_policy_loss_masked_with_reference_kl_entropy_and_token_mean_over_minibatch():
    logp = torch.tensor([math.log(0.5), math.log(0.25), 0.0])
    ref = torch.tensor([math.log(0.25), math.log(0.25), -30.0])
    entropy = torch.tensor([1.0, 3.0, 100.0])
    mask = torch.tensor([1.0, 1.0, 0.0])  # the third token is padding: it must not count
    # ratio 1 everywhere, advantages 0 -> the surrogate is 0. k3(logp, ref): ref - logp = [-ln 2, 0] ->
    # [0.5 - 1 + ln 2, 0] = [0.193147, 0]; loss = (0.01 * 0.193147 - 0.001 * (1 + 3)) / 4 tokens
    loss, stats = R.policy_loss(logp, logp, torch.zeros(3), mask, ref_logp=ref, kl_coef=0.01,
                                entropy=entropy, entropy_coef=0.001, num_tokens=4)
    assert math.isclose(float(loss), (0.01 * 0.193147 - 0.004) / 4, abs_tol=1e-7)
    assert math.isclose(stats["kl_ref"], 0.193147 / 4, abs_tol=1e-6)
    assert math.isclose(stats["entropy"], 1.0, abs_tol=1e-6)
    assert stats["approx_kl_old"] == 0.0 and stats["clip_frac"] == 0.0
    # verl clamps the reference k3 at 10: ref far above logp gives e^30 unclamped
    clamped, stats = R.policy_loss(torch.tensor([-30.0]), torch.tensor([-30.0]), torch.zeros(1), torch.ones(1),
                                   ref_logp=torch.tensor([0.0]), kl_coef=1.0)
    assert float(clamped) == 10.0 and stats["kl_ref"] == 10.0
    loss0, stats0 = R.policy_loss(logp, logp, torch.zeros(3), mask, ref_logp=ref, kl_coef=0.0,
                                  entropy=entropy, entropy_coef=0.0)
    assert float(loss0) == 0.0 and "kl_ref" not in stats0 and "entropy" not in stats0


def test_turn_scores_hand_computed():
    # R_i = 10 for a won episode, 0 otherwise; each malformed turn loses 0.1 on its own turn only
    assert R.turn_scores(True, [False, True, False]) == pytest.approx([10.0, 9.9, 10.0])
    assert R.turn_scores(False, [True, False]) == pytest.approx([-0.1, 0.0])
    assert R.turn_scores(True, [True], success_reward=1.0, penalty=0.5) == pytest.approx([0.5])
    assert R.turn_scores(True, []) == []


def test_combined_loss_hand_computed_value_gradient_and_terms():
    # ratio 1 (logp = old), A = [2, 0] over 2 tokens: L_PPO = mean(-A) = -1.
    # teacher = logp + [ln 2, 0]: k3 = [e^{ln 2} - 1 - ln 2, 0] = [0.306853, 0], rho = 1: L_OPD = 0.153426.
    # lambda = 0.1: L = -1 + 0.0153426. Gradient: d L_PPO = -A/2 = [-1, 0]; d(lambda rho k3)/dl =
    # lambda rho (l - l^T)/2 = [0.1 * -ln 2 / 2, 0] = [-0.034657, 0].
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    old, mask, adv = logp.detach().clone(), torch.ones(2), torch.tensor([2.0, 0.0])
    teacher = old + torch.tensor([math.log(2.0), 0.0])
    loss, stats = R.combined_loss(logp, old, mask, advantages=adv, teacher_logp=teacher, opd_coef=0.1)
    assert float(loss.detach()) == pytest.approx(-1 + 0.1 * 0.3068528 / 2, abs=1e-6)
    assert stats["pg_loss"] == pytest.approx(-1.0) and stats["opd_loss"] == pytest.approx(0.3068528 / 2, abs=1e-6)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(grad, torch.tensor([-1 - 0.1 * math.log(2.0) / 2, 0.0]), atol=1e-6)
    # the terms alone: lambda = 0 (or no teacher) is L_PPO; no advantages (--algo opd) is lambda L_OPD
    ppo_only, ppo_stats = R.combined_loss(logp, old, mask, advantages=adv, teacher_logp=teacher, opd_coef=0.0)
    assert float(ppo_only.detach()) == pytest.approx(-1.0) and "opd_loss" not in ppo_stats
    assert float(R.combined_loss(logp, old, mask, advantages=adv)[0].detach()) == pytest.approx(-1.0)
    opd_only, opd_stats = R.combined_loss(logp, old, mask, teacher_logp=teacher, opd_coef=0.1)
    assert float(opd_only.detach()) == pytest.approx(0.1 * 0.3068528 / 2, abs=1e-7) and "pg_loss" not in opd_stats


def test_micro_batch_denominators_hand_computed():
    # lengths 2, 2, 4, 1, 1 in groups of 2 rows: T = 4, 5, 1; S = ceil(5 / 2) = 3 accumulation steps -> D = S T
    assert R.micro_batch_denominators([2, 2, 4, 1, 1], rows=2) == [12, 12, 15, 15, 3]
    # equal lengths, a full mini-batch: D = S T = 2 x 6 = 12 = N, the exact token-mean
    assert R.micro_batch_denominators([3, 3, 3, 3], rows=2) == [12] * 4
    # a last mini-batch of 2 rows where the mini-batch holds 4: S = 2 all the same, so it weighs half
    assert R.micro_batch_denominators([3, 3], rows=2, mini_batch=4) == [12, 12]
    assert R.micro_batch_denominators([5], rows=8) == [5]  # one group: its own token-mean


def test_loss_agg_authors_differs_from_the_token_mean_by_a_hand_computed_amount():
    # two samples, 1 and 3 tokens, ratio 1: the surrogate per token is -A, A = +1 on the first, -1 on the others.
    #   exact:   (-1 + 1 + 1 + 1) / 4 = 0.5,   d/dl = -A / 4
    #   authors, groups of 1 row (S = 2): (-1/1 + 3/3) / 2 = 0,   d/dl = -A / D with D = [2, 6, 6, 6]
    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0], requires_grad=True)
    old, mask, adv = logp.detach().clone(), torch.ones(4), torch.tensor([1.0, -1.0, -1.0, -1.0])
    exact, _ = R.combined_loss(logp, old, mask, advantages=adv, num_tokens=4)
    denominators = torch.tensor([float(d) for d, n in zip(R.micro_batch_denominators([1, 3], rows=1), [1, 3])
                                 for _ in range(n)])
    assert denominators.tolist() == [2.0, 6.0, 6.0, 6.0]
    authors, stats = R.combined_loss(logp, old, mask, advantages=adv, num_tokens=denominators)
    assert float(exact.detach()) == pytest.approx(0.5) and float(authors.detach()) == pytest.approx(0.0, abs=1e-7)
    assert stats["pg_loss"] == pytest.approx(0.0, abs=1e-7)  # the logged terms are aggregated the same way
    (grad_exact,) = torch.autograd.grad(exact, logp)
    (grad_authors,) = torch.autograd.grad(authors, logp)
    assert torch.allclose(grad_exact, torch.tensor([-0.25, 0.25, 0.25, 0.25]))
    assert torch.allclose(grad_authors, torch.tensor([-1 / 2, 1 / 6, 1 / 6, 1 / 6]))
    # the OPD term and the entropy bonus are aggregated alike: teacher = logp + ln 2 on the first token only
    teacher = old + torch.tensor([math.log(2.0), 0.0, 0.0, 0.0])
    opd, opd_stats = R.combined_loss(logp, old, mask, teacher_logp=teacher, opd_coef=1.0, num_tokens=denominators)
    assert opd_stats["opd_loss"] == pytest.approx(0.3068528 / 2, abs=1e-6)  # k3 = 0.306853 on a D = 2 token


def test_teacher_success_is_the_mean_of_the_last_two_validations():
    assert R.teacher_success_rate([0.1, 0.5, 0.75]) == pytest.approx(0.625)  # (0.5 + 0.75) / 2
    assert R.teacher_success_rate([0.4]) == pytest.approx(0.4)  # one validation only: that one


# ==================================================================================================
# 5. The retirement rule (the authors' state machine)
# ==================================================================================================


def test_rule_pieces_hand_computed():
    assert R.alignment_progress(None, 0.5) is None  # no previous block: invalid
    assert R.alignment_progress(1e-9, 0.5) is None  # |K_{m-1}| <= 1e-8: invalid
    assert R.alignment_progress(-1e-9, 0.5) is None
    assert R.alignment_progress(0.5, 0.4) == pytest.approx(0.2)  # shrank by 20%
    assert R.alignment_progress(0.5, 0.6) == pytest.approx(-0.2)  # grew
    assert R.alignment_progress(0.5, 0.5) == 0.0
    # the denominator is signed, as the authors wrote it: -0.5 -> -0.4 is "progress" 0.2
    assert R.alignment_progress(-0.5, -0.4) == pytest.approx(0.2)
    assert R.competence(0.6, 0.4, 0.8) == pytest.approx(0.625)  # (0.6 + 0.4) / 1.6
    assert R.should_retire(0.0, 0.9)  # both at the boundary: <= 0 and >= 0.9
    assert not R.should_retire(1e-9, 1.0)  # the gap still shrinks a little
    assert not R.should_retire(-0.5, 0.89)  # not competent
    assert not R.should_retire(None, 1.0)  # invalid criterion
    assert R.should_retire(0.05, 0.5, threshold=0.1, rho=0.5)


def test_a_competence_of_rho_up_to_float_rounding_retires():
    # 12-episode panels: S = 8/12 and 10/12 with S_T = 10/12 give (8/12 + 10/12) / (2 * 10/12) = 18/20 = 0.9
    # exactly, but 0.8999999999999999 in floats. The rule treats it as the tie it is (README: Ours vs the
    # authors' code); one notch of a 1000-episode panel below rho is not a tie.
    tie = R.competence(8 / 12, 10 / 12, 10 / 12)
    assert tie < 0.9 and tie == pytest.approx(0.9, abs=1e-15)
    assert R.should_retire(-0.1, tie)
    assert not R.should_retire(-0.1, 0.9 - 0.001)
    assert not R.should_retire(-0.1, 0.9 - 1e-8)
    state = R.Retirement(teacher_success=10 / 12, window=1)  # the same tie through the state machine
    drive(state, [0.3, 0.3], {0: 8 / 12, 1: 10 / 12})
    assert state.retired and state.retired_at == 2


def drive(state, gaps, validations):
    """Feed K per iteration and validation successes {iteration: S}; return the logged records."""
    records = []
    for iteration, gap in enumerate(gaps):
        record = state.observe_gap(iteration, gap)
        if iteration in validations:
            record.update(state.observe_validation(iteration, validations[iteration]))
        records.append(record)
    return records


def test_rule_rising_gap_with_competence_retires_at_the_second_judged_block():
    # W = 2, validations every 2 iterations, S_T = 0.5:
    #   block 0 = mean(1.0, 1.0) = 1.0, judged at it. 1: baseline only (no decision)
    #   block 1 = mean(1.0, 1.4) = 1.2, judged at it. 3: progress (1.0 - 1.2)/1.0 = -0.2 <= 0,
    #   competence (0.5 + 0.4) / (2 * 0.5) = 0.9 >= 0.9 -> retire; effective from iteration 4
    state = R.Retirement(teacher_success=0.5, window=2)
    records = drive(state, [1.0, 1.0, 1.0, 1.4], {1: 0.4, 3: 0.5})
    assert records[1]["gap_block"] == 1.0 and records[3]["gap_block"] == pytest.approx(1.2)
    assert records[1]["criterion_valid"] is False and records[1]["progress"] is None
    assert records[3]["criterion_valid"] and records[3]["progress"] == pytest.approx(-0.2)
    assert records[3]["competence"] == pytest.approx(0.9)
    assert state.retired and state.retired_at == 4
    # the latch: the gap collapses and success falls, the teacher stays retired
    drive(state, [0.1, 0.1], {1: 0.0})
    assert state.retired and state.retired_at == 4


def test_rule_falling_gap_does_not_retire_and_competence_uses_this_and_the_previous_judging_validation():
    state = R.Retirement(teacher_success=0.5, window=1)
    # K: 1.0 (baseline), 0.8 (shrinks 20%), 0.8 (did not shrink) with S 0.9, 0.9, then 0.5, 0.4
    records = drive(state, [1.0, 0.8, 0.8, 0.8], {0: 0.9, 1: 0.9, 2: 0.5, 3: 0.4})
    assert records[1]["progress"] == pytest.approx(0.2)  # shrank: no retirement at it. 1
    # it. 2: progress 0, competence (0.5 + 0.9)/1 = 1.4 -> retire (the previous validation is it. 1's)
    assert records[2]["progress"] == 0.0 and records[2]["competence"] == pytest.approx(1.4)
    assert state.retired and state.retired_at == 3
    strict = R.Retirement(teacher_success=0.5, window=1)
    records = drive(strict, [1.0, 0.9, 0.8, 0.7], {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0})
    assert all(r["progress"] > 0 for r in records[1:]) and not strict.retired  # always shrinking
    # competence from this and the previous judging validation only (W = 1: every validation judges):
    # S = 0.0, 0.0, 0.8, 0.1 -> at it. 2: (0.8 + 0.0)/(2 * 0.5) = 0.8, at it. 3: (0.1 + 0.8)/1 = 0.9
    two = R.Retirement(teacher_success=0.5, window=1)
    records = drive(two, [1.0, 1.0, 1.0, 1.0], {0: 0.0, 1: 0.0, 2: 0.8, 3: 0.1})
    assert [r["competence"] for r in records[1:]] == pytest.approx([0.0, 0.8, 0.9])
    assert two.retired_at == 4


def test_rule_near_zero_previous_block_is_invalid_and_only_full_blocks_are_judged_in_order():
    state = R.Retirement(teacher_success=0.1, window=1)
    records = drive(state, [0.0, 5.0, 5.0], {0: 1.0, 1: 1.0, 2: 1.0})
    assert records[1]["criterion_valid"] is False  # K_{m-1} = 0: (0 - 5) / 0 is undefined
    assert records[2]["criterion_valid"] and state.retired_at == 3
    # W = 3, eval_every = 1: the validations at it. 0 and 1 find no full block; block 0 (it. 0-2)
    # is judged at it. 2 (baseline), block 1 (it. 3-5) at it. 5
    every = R.Retirement(teacher_success=0.5, window=3)
    records = drive(every, [1, 1, 1, 2, 2, 2], {k: 0.5 for k in range(6)})
    assert [r.get("judged_block") for r in records] == [None, None, 1.0, None, None, 2.0]
    assert every.judged == 2 and every.retired_at == 6
    # validations sparser than blocks, which a run never has (validate_config: eval_every <= W, so at most
    # the newest block waits): the class alone judges the blocks in order, the oldest unjudged first
    late = R.Retirement(teacher_success=0.5, window=1)
    records = drive(late, [1.0, 2.0, 3.0], {2: 0.5})
    assert records[2]["judged_block"] == 1.0 and late.judged == 1 and late.blocks[2][1] == 3.0


def test_rule_fixed_schedule_never_mode_and_state_survives_a_checkpoint():
    fixed = R.Retirement(teacher_success=None, mode="fixed", window=1, retire_at=2)
    for k in range(4):
        fixed.observe_gap(k, 1.0)
        fixed.observe_validation(k, 1.0)  # no S_T: nothing judged, nothing adaptive
        fixed.observe_schedule(k)
        assert fixed.retired == (k >= 1)
    assert fixed.retired_at == 2
    never = R.Retirement(teacher_success=0.5, mode="never", window=1)
    records = drive(never, [1.0, 1.0, 1.0], {0: 1.0, 1: 1.0, 2: 1.0})
    assert records[2]["criterion_valid"] and records[2]["progress"] == 0.0 and not never.retired
    # halfway through, save (as a checkpoint does) and rebuild: the same decisions follow
    gaps, vals = [1.0, 0.9, 1.1, 1.0, 1.2, 1.3], {1: 0.2, 3: 0.5, 5: 0.5}
    whole = R.Retirement(teacher_success=0.5, window=2)
    drive(whole, gaps, vals)
    first = R.Retirement(teacher_success=0.5, window=2)
    for k in range(3):
        first.observe_gap(k, gaps[k])
        if k in vals:
            first.observe_validation(k, vals[k])
    resumed = R.Retirement(**json.loads(json.dumps(R.dataclasses.asdict(first))))
    for k in range(3, 6):
        resumed.observe_gap(k, gaps[k])
        if k in vals:
            resumed.observe_validation(k, vals[k])
    assert R.dataclasses.asdict(resumed) == R.dataclasses.asdict(whole)
    # blocks 0.95, 1.05, 1.25. At it. 3: progress (0.95 - 1.05)/0.95 < 0 but competence
    # (0.5 + 0.2)/1.0 = 0.7 < 0.9; at it. 5: 1.25 >= 1.05 and (0.5 + 0.5)/1.0 = 1.0 -> retired from it. 6
    assert whole.retired_at == 6


# ==================================================================================================
# 6. Gradient truth: the OPD loss lowers KL(student || teacher); the naive loss does not move
# ==================================================================================================


def exact_kl(student_logits, teacher_logp):
    logp = torch.log_softmax(student_logits, -1)
    return float((logp.exp() * (logp - teacher_logp)).sum().detach())


def test_opd_loss_lowers_exact_kl_on_a_toy_categorical_policy():
    torch.manual_seed(0)
    teacher_logp = torch.log_softmax(torch.tensor([2.0, 0.0, -1.0, 1.0, -2.0]), -1)
    theta = torch.zeros(5, requires_grad=True)  # student: uniform
    kls = [exact_kl(theta, teacher_logp)]
    optimizer = torch.optim.SGD([theta], lr=0.5)
    for _ in range(20):
        logp_all = torch.log_softmax(theta, -1)
        tokens = torch.multinomial(logp_all.exp().detach(), 256, replacement=True)  # on-policy
        logp = logp_all[tokens]
        loss, _ = R.opd_loss(logp, logp.detach(), teacher_logp[tokens], torch.ones_like(logp))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        kls.append(exact_kl(theta, teacher_logp))
    assert kls[-1] < 0.2 * kls[0]


def test_opd_expected_gradient_is_the_kl_gradient_and_naive_is_zero():
    # Exact expectations over the student's own distribution (no sampling noise), at rho = 1:
    #   E_pi[grad (rho k3)] = E_pi[(l^theta - l^T) grad l^theta] = grad KL(pi || T);
    #   E_pi[grad (l^theta - l^T)] = 0.
    teacher_logp = torch.log_softmax(torch.tensor([1.0, -1.0, 0.5]), -1)
    theta = torch.tensor([0.3, -0.2, 0.0], requires_grad=True)
    logp = torch.log_softmax(theta, -1)
    weights = logp.exp().detach()  # probability of sampling each token
    per_token = [R.opd_loss(logp[v:v + 1], logp[v:v + 1].detach(), teacher_logp[v:v + 1], torch.ones(1))[0]
                 for v in range(3)]
    (grad_opd,) = torch.autograd.grad(sum(w * l for w, l in zip(weights, per_token)), theta, retain_graph=True)
    (grad_naive,) = torch.autograd.grad((weights * (logp - teacher_logp)).sum(), theta, retain_graph=True)
    (grad_kl,) = torch.autograd.grad((logp.exp() * (logp - teacher_logp)).sum(), theta)
    assert torch.allclose(grad_opd, grad_kl, atol=1e-6)
    assert grad_kl.abs().max() > 1e-2
    assert grad_naive.abs().max() < 1e-6


# ==================================================================================================
# 7. Prompts and action parsing
# ==================================================================================================


def test_project_action_follows_the_authors_projection_branch_by_branch():
    project = R.project_action
    # well formed: the text between the first <action> and the first </action>, stripped, lowercased
    assert project("<think>go</think><action>Go To Cabinet 1</action>", "alfworld") == ("go to cabinet 1", True)
    assert project("<think>a</think> <action> click[buy now] </action> trailing", "webshop") == ("click[buy now]", True)
    assert project("<think>a</think><action>look</action><action>go</action>", "alfworld") == ("look", True)
    assert project("<think>x</think><ACTION>Look</ACTION>", "alfworld") == ("look", True)  # tags found lowercased
    assert project("<think>x</think><action> </action>", "alfworld") == ("", True)  # empty: well formed, as theirs
    assert project("<think>x</think></action>go<action>", "alfworld") == ("", True)  # </action> first: ""
    # <think> or </think> missing (looked for as written: <THINK> is not <think>): the action is sent, malformed
    assert project("<action>look</action>", "alfworld") == ("look", False)
    assert project("<think>x<action>look</action>", "alfworld") == ("look", False)
    assert project("x</think><action>look</action>", "kitchen") == ("look", False)
    assert project("<THINK>x</THINK><action>look</action>", "alfworld") == ("look", False)
    # a CJK Unified Ideograph (U+4E00-U+9FFF) anywhere: malformed; kana and hangul are outside the authors' range
    assert project("<think>看</think><action>look</action>", "alfworld") == ("look", False)
    assert project("<think>x</think><action>look 一</action>", "alfworld") == ("look 一", False)
    assert project("<think>みる 보다</think><action>look</action>", "alfworld") == ("look", True)
    # no <action> ... </action> pair: the answer's last 30 characters (WebShop 20), lowercased, malformed
    rambling = "I should Go To The Cabinet 1 and then look around"
    assert project(rambling, "alfworld") == ("cabinet 1 and then look around", False)
    assert project(rambling, "kitchen") == ("cabinet 1 and then look around", False)
    assert project(rambling, "webshop") == ("and then look around", False)
    assert project("<think>x</think><action>look", "alfworld") == ("<think>x</think><action>look", False)  # short
    assert project("", "alfworld") == ("", False)
    # ours: an answer cut at --max-response-tokens is projected the same way, and malformed
    assert project("<think>x</think><action>look</action>", "alfworld", cut=True) == ("look", False)
    assert project("<think>x</think><action>lo", "webshop", cut=True) == (">x</think><action>lo", False)  # 26 - 6


def test_action_from_answer_is_the_action_of_a_well_formed_answer():
    assert R.action_from_answer("<think>go</think><action>Go To Cabinet 1</action>") == "go to cabinet 1"
    assert R.action_from_answer("<think>x</think><action> </action>") == ""  # empty: well formed
    for malformed in ("<action>look</action>", "<think>x</think><action>look", "<think>看</think><action>look</action>",
                      ""):
        assert R.action_from_answer(malformed) is None


def test_teacher_prompt_is_student_prompt_plus_skills_before_task():
    student = R.build_user_message("alfworld", "put a mug in the fridge", 3, [("obs0", "look")], "obs1",
                                   ["look", "go to fridge 1"])
    skills = R.skill_text("alfworld", "pick_cool_then_place_in_recep")
    teacher = R.build_user_message("alfworld", "put a mug in the fridge", 3, [("obs0", "look")], "obs1",
                                   ["look", "go to fridge 1"], skills)
    assert teacher == skills + "\n\n" + student
    # what the authors' prompts carry: the task, the steps taken, the last pairs, the observation,
    # the admissible actions and the format
    for part in ("Your task: put a mug in the fridge", "You have taken 3 step(s)", "Observation: obs0\nAction: look",
                 "Current observation:\nobs1", "'go to fridge 1'", "<action> </action>"):
        assert part in student, part
    assert "cool X with fridge 1" in skills and "Skills for this task" in skills
    assert R.skill_text("webshop", "fashion") != R.skill_text("webshop", "food")
    for task_type in R.alfworld_env.ALFWORLD_TASK_TYPES:
        assert len(R.skill_text("alfworld", task_type)) > len(R.skill_text("alfworld", "unknown"))
