"""The method's tests: each function of retireopd.py's sections 1-6 on toy tensors and the tiny model,
with its expected values worked out by hand in the comments, the retirement rule step by step, and the
gradients against their closed forms. An instructor who turns a function into an exercise grades it
with the tests named for it (docs/tests.md: which test grades which function). All fast (well under
30 s):

    python -m pytest -q test_retireopd.py

The sections follow the source: 2 skills, prompts and actions; 3 the math (advantages, log-probs, the
gap, the losses, the rule, the gradients); 4 the rollout; 5 the update; 6 one iteration and a phase,
wired. At the end, three small helpers below the banner that the method calls (evaluation's success
rates, the micro-batches, AdamW).
"""

import copy
import gc
import json
import math
import random
import weakref

import pytest
import torch

import engine
import retireopd as R
from conftest import small_cfg, FakeSuite


# ==================================================================================================
# 2. Skills, prompts and the action an answer sends
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


# ==================================================================================================
# 3. The math: GRPO advantages and turn scores
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


def test_turn_scores_hand_computed():
    # R_i = 10 for a won episode, 0 otherwise; each malformed turn loses 0.1 on its own turn only
    assert R.turn_scores(True, [False, True, False]) == pytest.approx([10.0, 9.9, 10.0])
    assert R.turn_scores(False, [True, False]) == pytest.approx([-0.1, 0.0])
    assert R.turn_scores(True, [True], success_reward=1.0, penalty=0.5) == pytest.approx([0.5])
    assert R.turn_scores(True, []) == []


# ==================================================================================================
# 3. The math: token log-probs
# ==================================================================================================


def test_token_logprobs_hand_computed():
    # logits [0, ln 3]: p = [1/4, 3/4]; entropy = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.5623351
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]])
    logp, entropy = R.token_logprobs(logits, torch.tensor([1, 0]), with_entropy=True)
    assert torch.allclose(logp, torch.tensor([math.log(0.75), math.log(0.25)]), atol=1e-6)
    assert torch.allclose(entropy, torch.full((2,), 0.5623351), atol=1e-6)


def test_head_logprobs_chunked_equals_naive_values_and_gradients():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    head = torch.nn.Linear(16, 1000, bias=False)
    tokens = torch.randint(0, 1000, (37,))
    chunked = R.head_logprobs(hidden, tokens, head, chunk=5)
    naive = torch.log_softmax(head(hidden), -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.allclose(chunked, naive, atol=1e-5)
    (g_chunked,) = torch.autograd.grad(chunked.sum(), hidden)
    (g_naive,) = torch.autograd.grad(naive.sum(), hidden)
    assert torch.allclose(g_chunked, g_naive, atol=1e-5)


def test_head_logprobs_of_a_bf16_head_are_fp32_sums_of_its_weights():
    # --frozen-dtype bfloat16: the head's weights are bf16, the logits must still be fp32
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 300, bias=False).to(torch.bfloat16)
    hidden, tokens = torch.randn(9, 32).to(torch.bfloat16), torch.randint(0, 300, (9,))
    logp, entropy = R.head_logprobs(hidden, tokens, head, chunk=4, with_entropy=True)
    exact = torch.log_softmax(hidden.float() @ head.weight.float().T, -1)
    assert logp.dtype == torch.float32
    assert torch.allclose(logp, exact[torch.arange(9), tokens], atol=1e-5)
    assert torch.allclose(entropy, -(exact.exp() * exact).sum(-1), atol=1e-4)
    rounded = torch.log_softmax(head(hidden).float(), -1)[torch.arange(9), tokens]  # bf16 logits
    assert not torch.allclose(logp, rounded, atol=1e-5)


# ==================================================================================================
# 3. The math: the teacher-student gap K and the OPD loss
# ==================================================================================================


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
# 3. The math: the PPO-clip loss with the dual clip, the combined loss, its aggregation
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
    # and caps the log-ratio at 20 before exp, as verl's low_var_kl: a ratio of e^100 (inf in fp32) still
    # gives the clamped 10 and a zero gradient, not NaN (without the cap: 0 * inf in exp's backward)
    far = torch.tensor([-100.0], requires_grad=True)
    capped, _ = R.policy_loss(far, far.detach(), torch.zeros(1), torch.ones(1), ref_logp=torch.tensor([0.0]),
                              kl_coef=1.0)
    capped.backward()
    assert float(capped.detach()) == 10.0 and float(far.grad) == 0.0
    loss0, stats0 = R.policy_loss(logp, logp, torch.zeros(3), mask, ref_logp=ref, kl_coef=0.0,
                                  entropy=entropy, entropy_coef=0.0)
    assert float(loss0) == 0.0 and "kl_ref" not in stats0 and "entropy" not in stats0


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
    authors, stats = R.combined_loss(logp, old, mask, advantages=adv, denominators=denominators)
    assert float(exact.detach()) == pytest.approx(0.5) and float(authors.detach()) == pytest.approx(0.0, abs=1e-7)
    assert stats["pg_loss"] == pytest.approx(0.0, abs=1e-7)  # the logged terms are aggregated the same way
    (grad_exact,) = torch.autograd.grad(exact, logp)
    (grad_authors,) = torch.autograd.grad(authors, logp)
    assert torch.allclose(grad_exact, torch.tensor([-0.25, 0.25, 0.25, 0.25]))
    assert torch.allclose(grad_authors, torch.tensor([-1 / 2, 1 / 6, 1 / 6, 1 / 6]))
    # the OPD term and the entropy bonus are aggregated alike: teacher = logp + ln 2 on the first token only
    teacher = old + torch.tensor([math.log(2.0), 0.0, 0.0, 0.0])
    opd, opd_stats = R.combined_loss(logp, old, mask, teacher_logp=teacher, opd_coef=1.0, denominators=denominators)
    assert opd_stats["opd_loss"] == pytest.approx(0.3068528 / 2, abs=1e-6)  # k3 = 0.306853 on a D = 2 token


# ==================================================================================================
# 3. The math: S_T and the retirement rule (the authors' state machine)
# ==================================================================================================


def test_teacher_success_is_the_mean_of_the_last_two_validations():
    assert R.teacher_success_rate([0.1, 0.5, 0.75]) == pytest.approx(0.625)  # (0.5 + 0.75) / 2
    assert R.teacher_success_rate([0.4]) == pytest.approx(0.4)  # one validation only: that one


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
# 3. The math: gradient truth
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
# 4. The rollout
# ==================================================================================================


def test_teacher_scores_the_student_token_ids_and_empty_skills_give_zero_discrepancy(tiny, monkeypatch):
    model, tok = tiny
    cfg = small_cfg(env="alfworld")
    torch.manual_seed(0)
    samples, _, _ = R.rollout(model, tok, FakeSuite(), [0, 0], cfg, group_size=2, skills_in_prompt=False,
                              with_teacher_prompts=True, temperature=1.0)
    sample = samples[0]
    assert len(sample.teacher_prompt_ids) > len(sample.prompt_ids)
    assert tok.decode(sample.teacher_prompt_ids).count("Skills for this task") == 1
    assert "Skills for this task" not in tok.decode(sample.prompt_ids)
    student_logp = R.response_logprobs(model, samples, cfg)
    teacher_logp = R.response_logprobs(model, samples, cfg, teacher_prompt=True)
    assert [len(t) for t in teacher_logp] == [len(s.response_ids) for s in samples]
    assert not torch.allclose(torch.cat(student_logp), torch.cat(teacher_logp))  # prompts differ
    # empty skill text, teacher = student: exactly zero discrepancy
    monkeypatch.setattr(R, "skill_text", lambda env, task_type: "")
    samples, _, _ = R.rollout(model, tok, FakeSuite(), [0, 0], cfg, group_size=2, skills_in_prompt=False,
                              with_teacher_prompts=True, temperature=1.0)
    student_logp = torch.cat(R.response_logprobs(model, samples, cfg))
    teacher_logp = torch.cat(R.response_logprobs(model, samples, cfg, teacher_prompt=True))
    assert R.teacher_student_gap(student_logp, teacher_logp, torch.ones_like(student_logp)) == (0.0, 0.0)


def test_environment_exceptions_end_the_episode_as_a_logged_failure(tiny):
    model, tok = tiny

    class Broken(FakeSuite):
        class Env(FakeSuite.Env):
            def step(self, action):
                raise RuntimeError("engine crashed")

    # a scripted policy that always answers well-formed, so the environment is stepped
    scripted = lambda m, t, prompts, n, temp, **_: [engine.Sampled(t(  # noqa: E731
        "<think>x</think><action>look</action><|im_end|>")["input_ids"], False)] * len(prompts)
    original, R.generate = R.generate, scripted
    try:
        samples, episodes, stats = R.rollout(model, tok, Broken(), [0], small_cfg(env="alfworld", max_turns=3),
                                             group_size=2, skills_in_prompt=False, with_teacher_prompts=False,
                                             temperature=1.0)
    finally:
        R.generate = original
    assert stats["env_errors"] == 2 and len(samples) == 2  # one turn each, then the episode ended
    assert all(e.done and not e.won and "engine crashed" in e.error for e in episodes)
    assert all(not s.malformed and s.score == 0.0 for s in samples)


def test_malformed_answers_are_penalised_and_still_step_the_environment(tiny):
    model, tok = tiny  # the random tiny model never writes the tags: every turn is malformed
    cfg = small_cfg(env="alfworld", max_turns=3)
    samples, episodes, stats = R.rollout(model, tok, FakeSuite(), [0], cfg, group_size=2,
                                         skills_in_prompt=False, with_teacher_prompts=False, temperature=1.0)
    assert len(samples) == 6 and all(s.malformed for s in samples)
    assert all(s.score == pytest.approx(-0.1) for s in samples)
    assert all(len(e.history) == 3 and e.turns == 3 and not e.won for e in episodes)  # stepped every turn
    assert all(len(action) <= 30 for e in episodes for _, action in e.history)  # an answer's last 30 characters
    assert stats["malformed_frac"] == 1.0


class RecordingSuite(FakeSuite):
    """FakeSuite whose environment records what it was sent, and numbers its observations."""

    class Env(FakeSuite.Env):
        def __init__(self):
            self.sent = []

        def step(self, action):
            self.sent.append(action)
            won = action == "open box 1"
            return f"observation {len(self.sent)}", 10.0 * won, won, {"admissible": ["look"], "won": won}


def test_a_malformed_turn_steps_the_env_with_the_projection_and_enters_the_history(tiny, monkeypatch):
    model, tok = tiny
    monkeypatch.setattr(R, "generate", _scripted(tok, [
        ("<action>Look</action><|im_end|>", False),                     # no <think>: "look", malformed
        ("I will Open The Box 1 now, of course<|im_end|>", False),       # no tags: its last 30 characters
        ("<think>x</think><action>open box 1</action><|im_end|>", False)]))  # wins
    samples, (episode,), _ = R.rollout(model, tok, RecordingSuite(), [0], small_cfg(env="alfworld", max_turns=5),
                                       group_size=1, skills_in_prompt=False, with_teacher_prompts=False,
                                       temperature=1.0)
    fallback = " open the box 1 now, of course"  # 30 characters, lowercased, not stripped (theirs)
    assert episode.env.sent == ["look", fallback, "open box 1"] and episode.won
    assert episode.history == [("a box 1", "look"), ("observation 1", fallback), ("observation 2", "open box 1")]
    assert [s.malformed for s in samples] == [True, True, False]
    assert [s.score for s in samples] == pytest.approx([9.9, 9.9, 10.0])
    third_prompt = tok.decode(samples[2].prompt_ids)  # the turn after the malformed ones shows both pairs
    assert "You have taken 2 step(s)" in third_prompt
    assert "Observation: a box 1\nAction: look\nObservation: observation 1\nAction:  open the box 1 now" in third_prompt
    assert "Current observation:\nobservation 2" in third_prompt


def _scripted(tok, answers):
    turn = [0]

    def generate(model, tokenizer, prompts, n, temperature, **_):
        text, cut = answers[min(turn[0], len(answers) - 1)]
        turn[0] += 1
        return [engine.Sampled(tok(text)["input_ids"], cut)] * len(prompts)
    return generate


def test_turn_scores_cut_answers_and_episode_reward_on_every_turn(tiny, monkeypatch):
    model, tok = tiny
    monkeypatch.setattr(R, "generate", _scripted(tok, [
        ("<think>x</think><action>look</action>", True),          # cut at the cap: malformed (look is still sent)
        ("garbage", False),                                        # malformed
        ("<think>x</think><action>open box 1</action><|im_end|>", False)]))  # wins
    samples, episodes, stats = R.rollout(model, tok, FakeSuite(), [0], small_cfg(env="alfworld", max_turns=5),
                                         group_size=2, skills_in_prompt=False, with_teacher_prompts=False, temperature=1.0)
    assert all(e.won and e.turns == 3 for e in episodes)
    assert all([action for _, action in e.history] == ["look", "garbage", "open box 1"] for e in episodes)
    lengths = [len(tok(text)["input_ids"]) for text in ("<think>x</think><action>look</action>", "garbage",
                                                       "<think>x</think><action>open box 1</action><|im_end|>")]
    assert stats["gen_steps"] == sum(lengths)  # one batched call per turn, as long as its longest answer
    assert [s.malformed for s in samples[:6:2]] == [True, True, False]
    assert [s.score for s in samples[:6:2]] == pytest.approx([9.9, 9.9, 10.0])


def test_prompt_shows_only_the_last_h_pairs(tiny):
    model, tok = tiny
    episode = R.EpisodeState(env=None, group=0, task="t", observation="now", admissible=["look"],
                        history=[("obsA", "a"), ("obsB", "b"), ("obsC", "c")])
    student, _, _ = R.episode_prompts(tok, episode, small_cfg(history=2), "")
    text = tok.decode(student)
    assert "obsA" not in text and "obsB" in text and "obsC" in text


def test_teacher_prompt_is_the_truncated_student_prompt_plus_skills(tiny):
    model, tok = tiny
    episode = R.EpisodeState(env=None, group=0, task="t", observation="long observation " * 200, admissible=["look"],
                        history=[("old observation " * 50, "a"), ("obsB", "b")])
    cfg = small_cfg(max_prompt_tokens=300)
    skills = R.skill_text("alfworld", "pick_and_place_simple")
    student, teacher, truncated = R.episode_prompts(tok, episode, cfg, skills)
    assert truncated and len(student) <= 300
    s_text, t_text = tok.decode(student), tok.decode(teacher)
    intro = R.ENV_INTRO["webshop"]
    assert t_text == s_text.replace(intro, skills + "\n\n" + intro, 1)


# ==================================================================================================
# 5. The update: log-probs of the sampled tokens, the combined loss in mini-batches
# ==================================================================================================


def test_batched_logprobs_equal_each_sequence_alone(tiny):
    model, tok = tiny
    prompts = [R.encode_prompt(tok, "short"), R.encode_prompt(tok, "a much longer prompt " * 5)]
    torch.manual_seed(1)
    responses = [ids for ids, *_ in R.generate(model, tok, prompts, 6, 1.0)]  # left-padded batch
    cfg = small_cfg()
    with torch.no_grad():
        together = R.sequence_logprobs(model, prompts, responses, cfg)
        alone = torch.cat([R.sequence_logprobs(model, [p], [r], cfg) for p, r in zip(prompts, responses)])
    assert together.shape == (sum(map(len, responses)),)
    assert torch.allclose(together, alone, atol=1e-5)


def test_lm_head_sees_at_most_chunk_rows_and_only_response_positions(tiny):
    head, rows = torch.nn.Linear(16, 1000, bias=False), []
    head.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[0]))
    R.head_logprobs(torch.randn(37, 16), torch.randint(0, 1000, (37,)), head, chunk=5)
    assert max(rows) <= 5 and sum(rows) == 37
    model, tok = tiny
    rows.clear()
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, o: rows.append(i[0].shape[0]))
    try:
        with torch.no_grad():
            R.sequence_logprobs(model, [R.encode_prompt(tok, "hi " * 30)], [[5, 6, 7]], small_cfg(logprob_chunk=2))
    finally:
        hook.remove()
    assert rows == [2, 1]


def test_micro_batching_does_not_change_the_loss_or_gradient(tiny):
    model, tok = tiny
    cfg = small_cfg(env="alfworld")
    torch.manual_seed(3)
    samples, _, _ = R.rollout(model, tok, FakeSuite(), [0, 0], cfg, group_size=2, skills_in_prompt=False,
                              with_teacher_prompts=False, temperature=1.0)
    old = R.response_logprobs(model, samples, cfg)
    advantages = [torch.randn(len(s.response_ids)) for s in samples]

    def loss_and_grad_norm(token_budget):
        copied = copy.deepcopy(model)
        optimizer = torch.optim.SGD(copied.parameters(), lr=0.0)  # measure, do not move
        out = R.ppo_update(copied, optimizer, samples, old, advantages,
                           R.dataclasses.replace(cfg, token_budget=token_budget, grad_clip=1e9),
                           mini_batch=len(samples), rng=random.Random(0))
        return out["loss"], out["grad_norm"]

    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    assert len(R.make_micro_batches(lengths, max(lengths))) == len(samples)  # one per micro-batch
    (loss_micro, grad_micro), (loss_one, grad_one) = loss_and_grad_norm(max(lengths)), loss_and_grad_norm(10 ** 6)
    assert loss_micro == pytest.approx(loss_one, abs=1e-5)
    assert grad_micro == pytest.approx(grad_one, rel=1e-4)  # the accumulated gradient, not only the loss


def _update_gradient(model, samples, advantages, cfg, mini_batch):
    """(loss, flat gradient) of one ppo_update step that does not move the model (SGD, lr 0)."""
    copied = copy.deepcopy(model)
    optimizer = torch.optim.SGD(copied.parameters(), lr=0.0)
    grads, step = [], optimizer.step
    optimizer.step = lambda: (grads.append(torch.cat([p.grad.flatten() for p in copied.parameters()])), step())[1]
    old = R.response_logprobs(copied, samples, cfg)
    out = R.ppo_update(copied, optimizer, samples, old, advantages, cfg, mini_batch=mini_batch, rng=random.Random(0))
    (grad,) = grads
    return out["loss"], grad


def test_loss_agg_authors_equals_the_token_mean_for_equal_lengths_and_not_otherwise(tiny):
    model, tok = tiny
    rng = random.Random(5)
    cfg = small_cfg(entropy_coef=0.0, grad_clip=1e9, token_budget=64)  # token budget: several micro-batches
    authors = R.dataclasses.replace(cfg, loss_agg="authors", micro_batch_rows=2)

    def batch(lengths):
        samples = [R.TurnSample(0, k, [rng.randrange(1000) for _ in range(rng.randrange(2, 9))],
                                [rng.randrange(1000) for _ in range(n)], False) for k, n in enumerate(lengths)]
        return samples, [torch.full((n,), a) for n, a in zip(lengths, (1.0, -0.5, 0.3, -1.2, 0.8, 0.1))]

    samples, advantages = batch([4] * 6)  # equal lengths, a full mini-batch of 3 groups of 2
    (loss_exact, grad_exact), (loss_authors, grad_authors) = (
        _update_gradient(model, samples, advantages, c, mini_batch=6) for c in (cfg, authors))
    assert loss_authors == pytest.approx(loss_exact, rel=1e-6, abs=1e-7)
    assert torch.allclose(grad_authors, grad_exact, rtol=1e-5, atol=1e-8)
    # unequal lengths: ratio 1, so the loss is sum_i -A_i n_i / D_i over the groups of the shuffled order
    lengths = [1, 7, 2, 5, 3, 3]
    samples, advantages = batch(lengths)
    order = list(range(6))
    random.Random(0).shuffle(order)  # ppo_update's mini-batch order (rng Random(0))
    expected = {"exact": -sum(float(advantages[i][0]) * lengths[i] for i in order) / sum(lengths), "authors": 0.0}
    for pair in (order[0:2], order[2:4], order[4:6]):  # S = 3 steps; each group's token-mean, / S
        expected["authors"] -= sum(float(advantages[i][0]) * lengths[i] for i in pair) / sum(lengths[i] for i in pair) / 3
    (loss_exact, grad_exact), (loss_authors, grad_authors) = (
        _update_gradient(model, samples, advantages, c, mini_batch=6) for c in (cfg, authors))
    assert loss_exact == pytest.approx(expected["exact"], abs=1e-6)
    assert loss_authors == pytest.approx(expected["authors"], abs=1e-6)
    assert abs(expected["authors"] - expected["exact"]) > 0.05  # the toy is not a tie
    assert float(torch.nn.functional.cosine_similarity(grad_exact, grad_authors, dim=0)) < 0.999


def test_non_finite_loss_skips_the_optimizer_step(tiny):
    model, tok = tiny
    cfg = small_cfg(env="alfworld", entropy_coef=0.0)  # also: a zero coefficient skips the entropy
    torch.manual_seed(0)
    samples, _, _ = R.rollout(model, tok, FakeSuite(), [0], cfg, group_size=2, skills_in_prompt=False,
                              with_teacher_prompts=False, temperature=1.0)
    old = R.response_logprobs(model, samples, cfg)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    poisoned = [torch.full((len(s.response_ids),), float("nan")) for s in samples]
    out = R.ppo_update(model, optimizer, samples, old, poisoned, cfg, mini_batch=4)
    assert out["skipped_steps"] == 1 and out["optimizer_steps"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    healthy = [torch.ones(len(s.response_ids)) for s in samples]
    out = R.ppo_update(model, optimizer, samples, old, healthy, cfg, mini_batch=4)
    assert out["skipped_steps"] == 0 and out["optimizer_steps"] == 1 and "entropy" not in out
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_finite_loss_with_overflowing_gradient_is_skipped(tiny):
    model, tok = tiny
    model = copy.deepcopy(model)
    cfg = small_cfg(env="alfworld", entropy_coef=0.0, kl_coef=0.0)
    torch.manual_seed(0)
    samples, _, _ = R.rollout(model, tok, FakeSuite(), [0], cfg, group_size=2, skills_in_prompt=False,
                              with_teacher_prompts=False, temperature=1.0)
    old = R.response_logprobs(model, samples, cfg)
    before = [p.detach().clone() for p in model.parameters()]
    huge = [torch.full((len(s.response_ids),), 1e30) for s in samples]
    out = R.ppo_update(model, torch.optim.AdamW(model.parameters(), lr=1e-2), samples, old, huge, cfg, mini_batch=4)
    assert math.isfinite(out["loss"]) and out["skipped_steps"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# ==================================================================================================
# 6. One iteration, a phase: what reaches the update, which prompt each model sees, what is freed
# ==================================================================================================


def _student_phase(tiny, tmp_path, teacher, retirement=None, iterations=1, batch_tasks=1):
    model, tok = tiny
    cfg = small_cfg(env="alfworld", iterations=iterations, batch_tasks=batch_tasks, group_size=2,
                    eval_every=5, save_every=0, kl_coef=0.0, run_dir=str(tmp_path))
    frozen = R.FrozenModels(teacher=teacher)
    R.train_phase("student", copy.deepcopy(model), tok, FakeSuite(), cfg, R.Run(cfg), skills_in_prompt=False,
                  frozen=frozen, retirement=retirement)
    return frozen, R.read_jsonl(tmp_path / "metrics.jsonl")


def test_teacher_is_freed_at_retirement(tiny, tmp_path):
    teacher = copy.deepcopy(tiny[0]).requires_grad_(False)
    alive = weakref.ref(teacher)
    retirement = R.Retirement(teacher_success=None, mode="fixed", window=1, retire_at=2)
    frozen, _ = _student_phase(tiny, tmp_path, teacher, retirement, iterations=3)
    del teacher
    gc.collect()
    assert retirement.retired and frozen.teacher is None and alive() is None


def test_pipeline_teacher_scores_the_skill_prompt(tiny, tmp_path, monkeypatch):
    # teacher = an exact copy of the student: D > 0 only because the teacher sees its skills
    _, metrics = _student_phase(tiny, tmp_path / "skills", copy.deepcopy(tiny[0]))
    assert metrics[0]["gap_k3"] > 0 and metrics[0]["gap"] != 0
    monkeypatch.setattr(R, "skill_text", lambda env, task_type: "")
    _, metrics = _student_phase(tiny, tmp_path / "empty", copy.deepcopy(tiny[0]))
    assert metrics[0]["gap"] == 0.0 and metrics[0]["gap_k3"] == 0.0


def test_pipeline_logs_the_sampling_vs_scoring_logprob_gap(tiny, tmp_path):
    _, metrics = _student_phase(tiny, tmp_path, None)
    # CPU fp32: the cached decode and the full scoring forward agree to rounding
    # (the gap's arithmetic is checked by hand in test_engine.py's sampling_numerics test)
    assert "sample_logp_gap_mean" in metrics[0] and metrics[0]["sample_logp_gap_max"] < 1e-4


def test_pipeline_grpo_groups_are_tasks_not_episodes(tiny, tmp_path, monkeypatch):
    seen = []
    real = R.grpo_advantages
    monkeypatch.setattr(R, "grpo_advantages", lambda s, g, *a, **k: (seen.append(g.clone()), real(s, g, *a, **k))[1])
    _student_phase(tiny, tmp_path, None, batch_tasks=2)
    assert len(set(seen[0].tolist())) == 2   # B = 2 tasks -> 2 groups of G = 2 episodes each


def _one_student_update(tiny, tmp_path, monkeypatch, **phase):
    """What reaches ppo_update in one phase-2 iteration whose first episode wins."""
    model, tok = tiny
    win = tok("<think>x</think><action>open box 1</action><|im_end|>")["input_ids"]
    bad = tok("garbage<|im_end|>")["input_ids"]
    monkeypatch.setattr(R, "generate", lambda m, t, prompts, n, temp, **_:
                        [engine.Sampled(win, False)] + [engine.Sampled(bad, False)] * (len(prompts) - 1))
    captured, real = {}, R.ppo_update

    def spy(policy, optimizer, samples, old, adv, cfg, **kwargs):
        captured.update(samples=samples, old=old, adv=adv, **kwargs)
        return real(policy, optimizer, samples, old, adv, cfg, **kwargs)

    monkeypatch.setattr(R, "ppo_update", spy)
    cfg = small_cfg(env="alfworld", iterations=1, batch_tasks=1, group_size=2, eval_every=1, save_every=0,
                    opd_mini_batch=3, mini_batch=5, run_dir=str(tmp_path))
    teacher = copy.deepcopy(model)
    R.train_phase("student", copy.deepcopy(model), tok, FakeSuite(), cfg, R.Run(cfg), skills_in_prompt=False,
                  frozen=R.FrozenModels(teacher=teacher), **phase)
    teacher_logp = R.response_logprobs(teacher, captured["samples"], cfg, teacher_prompt=True)
    grpo = R.grpo_advantages(torch.tensor([s.score for s in captured["samples"]]),
                             torch.tensor([s.group for s in captured["samples"]]))
    return captured, teacher_logp, grpo


def test_pure_opd_trains_on_the_opd_loss_alone(tiny, tmp_path, monkeypatch):
    cap, t_logp, grpo = _one_student_update(tiny, tmp_path, monkeypatch, grpo_loss=False)
    assert grpo.abs().max() > 0       # the GRPO signal exists but must not be used
    assert cap["adv"] is None and cap["opd_coef"] == 0.01 and cap["mini_batch"] == 3
    assert all(torch.equal(a, b) for a, b in zip(cap["teacher_logp"], t_logp))
    (record,) = R.read_jsonl(tmp_path / "metrics.jsonl")
    assert "pg_loss" not in record and record["loss"] == pytest.approx(0.01 * record["opd_loss"], rel=1e-6)


def test_grpo_plus_opd_gets_the_grpo_advantage_and_the_teacher_logprobs(tiny, tmp_path, monkeypatch):
    cap, t_logp, grpo = _one_student_update(tiny, tmp_path, monkeypatch)
    assert any((t - o).abs().max() > 0 for o, t in zip(cap["old"], t_logp))
    flat_old, flat_teacher = torch.cat(cap["old"]), torch.cat(t_logp)
    (record,) = R.read_jsonl(tmp_path / "metrics.jsonl")
    assert record["gap"] == pytest.approx(float((flat_old - flat_teacher).mean()), rel=1e-5)
    assert record["gap_k3"] == pytest.approx(float(R.k3(flat_old, flat_teacher).mean()), rel=1e-5)
    # phase 2 with a teacher: the authors' protocol (mini-batch 128 here 3, no reference KL)
    assert cap["mini_batch"] == 3 and cap["kl_coef"] == 0.0 and cap["ref_logp"] is None
    assert cap["opd_coef"] == 0.01 and all(torch.equal(a, b) for a, b in zip(cap["teacher_logp"], t_logp))
    for adv, g, s in zip(cap["adv"], grpo, cap["samples"]):  # one GRPO advantage per turn-sample
        assert torch.equal(adv, torch.full((len(s.response_ids),), float(g)))
    # the combined loss is L_PPO - entropy + lambda L_OPD (ratio 1 on one mini-batch: pg = -mean A)
    assert record["loss"] == pytest.approx(record["pg_loss"] - 0.001 * record["entropy"]
                                           + 0.01 * record["opd_loss"], rel=1e-5, abs=1e-7)


# ==================================================================================================
# Below the banner, what the method calls: evaluation's success rates (7), micro-batches and AdamW (8)
# ==================================================================================================


def test_success_by_task_type():
    records = [("pick_and_place_simple", True), ("pick_and_place_simple", False),
               ("pick_and_place_simple", True), ("look_at_obj_in_light", False),
               ("pick_two_obj_and_place", True)]
    out = R.success_by_task_type(records)
    assert out == {"pick_and_place_simple": pytest.approx(2 / 3), "look_at_obj_in_light": 0.0,
                   "pick_two_obj_and_place": 1.0, "overall": pytest.approx(3 / 5), "n": 5}
    assert R.success_by_task_type([]) == {"overall": 0.0, "n": 0}


@pytest.mark.parametrize("eval_batch, batches", [(256, [10]), (10, [10]), (4, [4, 4, 2]), (3, [3, 3, 3, 1])])
def test_a_panel_is_played_in_as_few_lock_step_batches_as_eval_batch_allows(tiny, monkeypatch, eval_batch, batches):
    model, tok = tiny
    played = []
    real_rollout = R.rollout
    monkeypatch.setattr(R, "rollout", lambda model, tok, suite, tasks, *a, **k: (
        played.append(len(tasks)), real_rollout(model, tok, suite, tasks, *a, **k))[1])
    result = R.evaluate(model, tok, FakeSuite(), [0] * 10, small_cfg(eval_batch=eval_batch, max_turns=1),
                        skills_in_prompt=False, desc="validation")
    assert played == batches and result["n"] == 10


def test_make_micro_batches_respects_budget_and_sorts():
    lengths = [5, 50, 7, 48, 6, 200]
    batches = R.make_micro_batches(lengths, token_budget=100)
    assert sorted(i for b in batches for i in b) == list(range(6))
    assert batches[0] == [5]  # longer than the budget: alone
    for batch in batches:
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 100
    assert batches[1] == [1, 3]  # 50 and 48 together, 5/6/7 together


def test_adamw_steps_as_adamw_on_cpu_and_is_fused_on_cuda(monkeypatch):
    # What matters on each device. CPU: one step is decoupled-weight-decay Adam with the config's lr and
    # weight decay (checked by hand: w <- w (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)). CUDA: the fused
    # kernel (no temporary fp32 copy of the parameters, ~6 GB at 1.5B), asked for whatever the torch
    # default: checked on this machine with a parameter that says it is on CUDA.
    weight = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    model = torch.nn.Linear(1, 1)
    monkeypatch.setattr(model, "parameters", lambda: iter([weight]))
    optimizer = R.build_adamw(model, small_cfg(lr=0.1, weight_decay=0.5))
    weight.grad = torch.tensor([0.3, -0.4])
    optimizer.step()
    # first step: m_hat = g, v_hat = g^2, so the Adam term is lr * g / (|g| + eps) = lr * sign(g)
    expected = torch.tensor([1.0, -2.0]) * (1 - 0.1 * 0.5) - 0.1 * torch.tensor([0.3, -0.4]) / (
        torch.tensor([0.3, 0.4]) + 1e-8)
    assert torch.allclose(weight.detach(), expected, atol=1e-7)
    asked = {}
    monkeypatch.setattr(R.torch.optim, "AdamW", lambda params, **kwargs: asked.update(kwargs))
    on_cuda = type("OnCuda", (), {"device": torch.device("cuda", 0)})()
    monkeypatch.setattr(model, "parameters", lambda: iter([on_cuda]))
    R.build_adamw(model, small_cfg(lr=3e-4, weight_decay=0.5))
    assert asked == {"lr": 3e-4, "weight_decay": 0.5, "fused": True}
    monkeypatch.setattr(model, "parameters", lambda: iter([weight]))
    R.build_adamw(model, small_cfg(lr=3e-4, weight_decay=0.5))
    assert asked["fused"] is None  # CPU: torch's own choice