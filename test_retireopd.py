"""Tests of what runs the method (the method's own functions are graded in test_method.py): the token
plumbing on the tiny model, alfworld_env.py on the real engine, and end-to-end runs of every algorithm.

    python -m pytest -q                  # the whole suite (webshop_env has its own test file)
    python -m pytest -q -m "not slow"    # the fast tier

The fast tier is the math, the plumbing on the tiny model, the environments on fixture games
and the built-in catalogue, the flag and folder checks, and a few runs of main() of a second or
two (both phases once, phase 2 on each environment, a retirement by the rule): about 90 s on a
2-core CPU, with test_method.py. `slow` (registered in pytest.ini) marks the rest: the other end-to-end runs of the
training script (the other --algo runs, resumes after a kill or a crash, plots, the benchmark),
tests that start subprocesses, replays of the real ALFWorld games and of all WebShop golden
goals, and the offline demo that must learn (minutes).

Expected values are worked out by hand in the comments. Tests that read ../shared skip when it
is absent. The test sections 1-7 (the math, the rule, the gradients, the prompts) are in
test_method.py; this file goes on from section 8.
"""

import importlib.util
import contextlib
import copy
import gc
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time
import weakref
from collections import Counter
from pathlib import Path

import pytest
import torch

import checks
import multigpu
import retireopd as R
import tiny as built_in_models  # (the name `tiny` is the fixture of the tiny model)
import tools

torch.set_num_threads(1)  # tiny tensors: threading overhead only adds noise


# ==================================================================================================
# 8. Token plumbing with the tiny model
# ==================================================================================================


@pytest.fixture(scope="module")
def pristine_tiny():
    return R.load_policy("tiny", torch.device("cpu"), torch.float32, seed=0)


@pytest.fixture
def tiny(pristine_tiny):
    """(model, tokenizer): a fresh copy for every test, which may train it or change its settings."""
    return tuple(copy.deepcopy(part) for part in pristine_tiny)


def small_cfg(**overrides):
    cfg = R.Config(model="tiny", env="webshop", max_turns=2, max_prompt_tokens=4096, mini_batch=4,
                   max_response_tokens=8, token_budget=4096)
    return R.dataclasses.replace(cfg, **overrides)


def test_tiny_model_and_tokenizer(tiny):
    model, tok = tiny
    n_params = sum(p.numel() for p in model.parameters())
    assert 100_000 < n_params < 1_000_000
    text = "<think>héllo 看</think><action>go to cabinet 1</action>"
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level: everything round-trips
    prompt = tok.decode(R.encode_prompt(tok, "hi"))
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # a lone user message


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


def test_sampling_is_full_distribution_despite_checkpoint_generation_config(tiny, tmp_path):
    model, tok = tiny
    # a checkpoint whose generation config would truncate and reshape the distribution
    model.generation_config.update(do_sample=True, top_k=2, top_p=0.1, temperature=0.05,
                                   repetition_penalty=3.0, min_p=0.5)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, loaded_tok = R.load_policy(str(tmp_path), torch.device("cpu"), torch.float32)
    assert loaded.generation_config.top_k is None and loaded.generation_config.temperature is None
    captured = {}
    original = loaded.generate

    def spy(**kwargs):  # record the processed scores next to the raw logits
        out = original(**kwargs, return_dict_in_generate=True, output_scores=True, output_logits=True)
        captured.update(scores=out.scores, logits=out.logits)
        return out.sequences

    loaded.generate = spy
    prompt = R.encode_prompt(loaded_tok, "anything")
    torch.manual_seed(0)
    R.generate(loaded, loaded_tok, [prompt] * 64, 3, 1.0)
    for scores, logits in zip(captured["scores"], captured["logits"]):
        assert torch.equal(scores, logits)  # no warper/processor touched the distribution
    # and the samples spread over many tokens (top_k=2 would allow two)
    sampled = R.generate(loaded, loaded_tok, [prompt] * 64, 1, 1.0)
    assert len({ids[0] for ids, *_ in sampled}) > 10
    # the old-policy log-probs of our forward pass equal the sampling distribution's
    responses = [ids for ids, *_ in R.generate(loaded, loaded_tok, [prompt] * 2, 3, 1.0)]
    captured_logp = torch.stack([torch.log_softmax(step[0], -1) for step in captured["logits"]])
    ours = R.sequence_logprobs(loaded, [prompt], [responses[0]], small_cfg())
    expected = captured_logp[torch.arange(len(responses[0])), torch.tensor(responses[0])]
    assert torch.allclose(ours, expected, atol=1e-4)


class FakeSuite:
    """A one-turn environment for plumbing tests: the task is to say 'open box 1'."""

    class Env:
        def reset(self):
            return "a box 1", {"task": "open the box", "task_type": "pick_and_place_simple",
                               "admissible": ["open box 1", "look"], "won": False}

        def step(self, action):
            won = action == "open box 1"
            return "ok", 10.0 * won, won, {"admissible": ["look"], "won": won}

    def __init__(self):
        self.train, self.validation_panel, self.report_panel = [0], [0], [0]

    def task_type(self, task):
        return "pick_and_place_simple"

    def new_episode(self, task, slot=0):
        return self.Env()


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
    scripted = lambda m, t, prompts, n, temp, **_: [R.Sampled(t(  # noqa: E731
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


def test_loss_agg_flags_fail_in_one_line_before_anything_runs(tmp_path):
    for flags, message in ((["--loss-agg", "seq-mean"], "--loss-agg: exact"),
                           (["--micro-batch-rows", "0"], "--micro-batch-rows must be >= 1")):
        with pytest.raises(SystemExit, match=message) as failure:
            R.main(["--model", "tiny", "--run-dir", str(tmp_path / "x"), *flags])
        assert "\n" not in str(failure.value.code)
    assert not (tmp_path / "x").exists()
    assert R.parse_config({"model": "tiny", "run_dir": str(tmp_path / "y")}).loss_agg == "exact"  # the default


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


def test_gpu_numerics_path_on_cpu_bf16_autocast_and_gradient_checkpointing(tiny, monkeypatch):
    """What a GPU run does, checked here with CPU bf16 autocast standing in for CUDA's: the
    checkpointed update gives the plain update's gradient on every parameter (a checkpoint that
    silently cut the graph would leave layers without gradient), recomputation really happens,
    log-probs stay fp32, and a frozen fp32 copy scoring the same prompt gives D = 0 exactly."""
    model, tok = tiny
    monkeypatch.setattr(R, "autocast", lambda device: torch.autocast("cpu", dtype=torch.bfloat16))
    cfg = small_cfg(env="alfworld")
    torch.manual_seed(5)
    samples, _, _ = R.rollout(model, tok, FakeSuite(), [0, 0], cfg, group_size=2, skills_in_prompt=False,
                              with_teacher_prompts=False, temperature=1.0)
    prompts, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    frozen = copy.deepcopy(model).requires_grad_(False).eval()
    old = R.response_logprobs(model, samples, cfg)
    assert all(logp.dtype == torch.float32 for logp in old)
    frozen_logp = torch.cat(R.response_logprobs(frozen, samples, cfg))
    assert R.teacher_student_gap(torch.cat(old), frozen_logp, torch.ones_like(frozen_logp)) == (0.0, 0.0)

    def gradients(checkpointing):
        copied = copy.deepcopy(model)
        if checkpointing:
            copied.activation_checkpointing_enable()  # what main() does on a GPU
        copied.train()
        calls = []
        # a pre-hook on a module inside the layer: the checkpoint wraps the layer's forward, not its
        # hooks, and the recomputation stops as soon as it has what the backward needs
        copied.model.layers[0].mlp.register_forward_pre_hook(lambda *args: calls.append(1))
        logp, entropy = R.sequence_logprobs(copied, prompts, responses, cfg, with_entropy=True)
        assert logp.dtype == torch.float32
        (logp.sum() + 0.1 * entropy.sum()).backward()
        return {name: p.grad for name, p in copied.named_parameters()}, len(calls)

    plain, plain_calls = gradients(False)
    checkpointed, checkpointed_calls = gradients(True)
    assert (plain_calls, checkpointed_calls) == (1, 2)  # layer 0 recomputed in the backward pass
    assert set(plain) == set(checkpointed)
    for name, grad in checkpointed.items():
        assert grad is not None and grad.abs().sum() > 0, name
        assert torch.allclose(grad, plain[name], rtol=1e-3, atol=1e-6), name

    def update(checkpointing):  # the real update path: ppo_update puts the model in training mode
        copied = copy.deepcopy(model).eval()
        if checkpointing:
            copied.activation_checkpointing_enable()
        calls = []
        copied.model.layers[0].mlp.register_forward_pre_hook(lambda *args: calls.append(1))
        out = R.ppo_update(copied, torch.optim.SGD(copied.parameters(), lr=0.0), samples, old,
                           [torch.randn(len(r), generator=torch.Generator().manual_seed(k)) for k, r in enumerate(responses)],
                           R.dataclasses.replace(cfg, grad_clip=1e9), mini_batch=len(samples), rng=random.Random(0))
        return out["loss"], out["grad_norm"], len(calls)

    (loss_plain, norm_plain, calls_plain), (loss_ckpt, norm_ckpt, calls_ckpt) = update(False), update(True)
    assert calls_ckpt == 2 * calls_plain > 0
    assert loss_ckpt == pytest.approx(loss_plain, abs=1e-6) and norm_ckpt == pytest.approx(norm_plain, rel=1e-3)

def test_make_micro_batches_respects_budget_and_sorts():
    lengths = [5, 50, 7, 48, 6, 200]
    batches = R.make_micro_batches(lengths, token_budget=100)
    assert sorted(i for b in batches for i in b) == list(range(6))
    assert batches[0] == [5]  # longer than the budget: alone
    for batch in batches:
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 100
    assert batches[1] == [1, 3]  # 50 and 48 together, 5/6/7 together


# ==================================================================================================
# 9. End to end: every --algo with the tiny model (WebShop built-in catalogue; ALFWorld fixtures)
# ==================================================================================================

QUICK = ["--model", "tiny", "--iterations", "3", "--batch-tasks", "1", "--group-size", "2",
         "--max-turns", "2", "--max-response-tokens", "6", "--eval-every", "1", "--eval-episodes", "2",
         "--window", "1", "--save-every", "1", "--teacher-success", "0.5", "--warm-start", "0",
         "--opd-coef", "0.01", "--kl-coef", "0.01", "--entropy-coef", "0.001"]
# The random tiny model (--warm-start 0: no behaviour cloning, every code path in seconds) never
# wins, so the teacher's S_T would be 0 and --algo retireopd would stop before phase 2:
# --teacher-success 0.5 lets phase 2 run (and the rule never retires: competence 0). The protocol
# coefficients are the authors' (the demo preset changes them; see TINY_PRESET).


def run_cli(tmp_path, name, *flags):
    run_dir = tmp_path / name
    R.main(QUICK + ["--run-dir", str(run_dir), *flags])
    return run_dir, R.read_jsonl(run_dir / "metrics.jsonl"), R.read_jsonl(run_dir / "events.jsonl")


def phases(metrics):
    return [(m["phase"], m["iteration"]) for m in metrics]


# in the fast tier: both phases once (retireopd on WebShop) and phase 2 alone on each environment
FAST_RUNS = {("retireopd", "webshop"), ("grpo", "webshop"), ("grpo", "alfworld")}


@pytest.mark.parametrize("algo,env", [
    pytest.param(algo, env, id=f"{algo}-{env}", marks=() if (algo, env) in FAST_RUNS else pytest.mark.slow)
    for env in ("webshop", "alfworld") for algo in ("retireopd", "grpo", "skill-grpo", "opd", "grpo+opd")])
def test_every_algo_runs_to_completion(tmp_path, algo, env):
    # webshop: the built-in catalogue; alfworld: the fixture games, through the real engine
    run_dir, metrics, events = run_cli(tmp_path, algo, "--algo", algo, "--env", env)
    teacher_its = [("teacher", k) for k in range(3)]
    student_its = [("student", k) for k in range(3)]
    expected = {"grpo": student_its, "skill-grpo": teacher_its}.get(algo, teacher_its + student_its)
    assert phases(metrics) == expected
    assert json.loads((run_dir / "config.json").read_text())["algo"] == algo
    assert (run_dir / ("teacher" if algo == "skill-grpo" else "student") / "config.json").is_file()
    evals = R.read_jsonl(run_dir / "eval.jsonl")
    assert evals and all("overall" in e and e["seed"] == 12345 for e in evals)
    if algo == "skill-grpo":  # the teacher's report is with and without its skills
        assert {e["skills"] for e in evals if e["panel"] == "report"} == {True, False}
    # a validation after every iteration (--eval-every 1), and, as the authors' phase-1 and GRPO scripts
    # (val_before_train; their phase-2 scripts turn it off), one before the first update of a phase
    # without a teacher; the teacher's, as theirs, with its skills and without
    validations = [(e["phase"], e["iteration"], e["skills"]) for e in evals if e["panel"] == "validation"]
    teacher_validations = [("teacher", k, skills) for k in (-1, 0, 1, 2) for skills in (True, False)]
    grpo_validations = [("student", k, False) for k in (-1, 0, 1, 2)]
    assert validations == {"grpo": grpo_validations, "skill-grpo": teacher_validations}.get(
        algo, teacher_validations + grpo_validations[1:])
    assert all(bool(e.get("before_training")) == (e["iteration"] == -1) for e in evals if e["panel"] == "validation")
    retirements = [e for e in events if e["event"] == "retirement"]
    students = [m for m in metrics if m["phase"] == "student"]
    if algo in ("opd", "grpo+opd", "retireopd"):  # not retired (competence 0): the teacher scores every iteration
        assert not retirements and all(m["teacher_active"] and "gap" in m and m["opd_coef"] == 0.01 for m in students)
        assert all(m["criterion_valid"] for m in students[1:])  # W = 1: judged from the second block on
    if algo == "opd":  # pure distillation: no policy-gradient term at all
        assert all("pg_loss" not in m and m["loss"] == pytest.approx(0.01 * m["opd_loss"]) for m in students)
    if algo == "grpo":
        assert all(not m["teacher_active"] and "gap" not in m and m["opd_coef"] == 0.0 for m in students)
    assert events[-1]["event"] == "done"


def test_retireopd_retires_by_the_rule_then_trains_with_grpo_alone(tmp_path, monkeypatch):
    # The random tiny model never wins, so the rule's inputs are injected: a student validation
    # success of 0.5 (= S_T: competence 1.0) and a gap that never shrinks (K = 1.0 each iteration).
    real_evaluate, real_gap = R.evaluate, R.teacher_student_gap
    monkeypatch.setattr(R, "evaluate", lambda model, tok, suite, tasks, cfg, skills, desc: {
        **real_evaluate(model, tok, suite, tasks, cfg, skills, desc), **({} if skills else {"overall": 0.5})})
    monkeypatch.setattr(R, "teacher_student_gap", lambda *a: (1.0, real_gap(*a)[1]))
    teacher_calls, real_score = [], R.response_logprobs
    monkeypatch.setattr(R, "response_logprobs", lambda model, samples, cfg, teacher_prompt=False: (
        teacher_calls.append(teacher_prompt), real_score(model, samples, cfg, teacher_prompt))[1])
    run_dir, metrics, events = run_cli(tmp_path, "adaptive", "--env", "webshop", "--iterations", "4")
    (retirement,) = [e for e in events if e["event"] == "retirement"]
    # W = 1: block 0 sets the baselines at iteration 0; iteration 1 judges block 1: progress 0, competence 1
    assert retirement["rule"] == "adaptive" and retirement["retired_at"] == 2
    assert retirement["progress"] == 0.0 and retirement["competence"] == 1.0 and retirement["criterion_valid"]
    students = [m for m in metrics if m["phase"] == "student"]
    assert [m["teacher_active"] for m in students] == [True, True, False, False]
    assert [m["opd_coef"] for m in students] == [0.01, 0.01, 0.0, 0.0]
    assert [m["retired"] for m in students] == [False, True, True, True]
    assert all("gap" not in m and "t_teacher" not in m and "opd_loss" not in m for m in students[2:])
    assert teacher_calls.count(True) == 2  # the teacher scored phase-2 iterations 0 and 1 only
    assert json.loads((run_dir / "student" / "retireopd.json").read_text())["retired_at"] == 2


@pytest.mark.slow
def test_retire_at_n_is_a_fixed_schedule(tmp_path):
    _, metrics, events = run_cli(tmp_path, "fixed", "--env", "webshop", "--iterations", "4", "--retire-at", "3")
    (retirement,) = [e for e in events if e["event"] == "retirement"]
    assert retirement["rule"] == "fixed" and retirement["retired_at"] == 3
    students = [m for m in metrics if m["phase"] == "student"]
    assert [m["teacher_active"] for m in students] == [True, True, True, False]


@pytest.mark.slow
def test_saved_teacher_is_reused_and_models_load_by_folder(tmp_path):
    first, _, _ = run_cli(tmp_path, "first", "--algo", "skill-grpo", "--env", "webshop")
    stored = json.loads((first / "teacher" / "retireopd.json").read_text())
    validations = [m["val_success"] for m in R.read_jsonl(first / "metrics.jsonl")]
    assert stored["validations"] == validations[-2:] and stored["env"] == "webshop"
    assert stored["teacher_success"] == sum(validations[-2:]) / 2
    second, metrics, events = run_cli(tmp_path, "second", "--algo", "grpo+opd", "--env", "webshop",
                                      "--teacher", str(first / "teacher"))
    assert phases(metrics) == [("student", k) for k in range(3)]  # phase 1 skipped
    with pytest.raises(SystemExit, match="trained on webshop"):
        R.main(QUICK + ["--env", "alfworld", "--teacher", str(first / "teacher"), "--run-dir", str(tmp_path / "z")])
    for folder in (first / "teacher", second / "student"):  # final models: bf16, servable
        assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model, tok = R.load_policy(str(second / "student"), torch.device("cpu"), torch.float32)
    (ids, *_), = R.generate(model, tok, [R.encode_prompt(tok, "hello")], 4, 1.0)
    assert 1 <= len(ids) <= 4


def test_final_models_are_bf16_and_generate_checkpoints_keep_fp32(tiny, tmp_path):
    model, tok = tiny
    run = R.Run(small_cfg(run_dir=str(tmp_path)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    final = run.save_model(model, tok, "student", {"algo": "grpo"})
    config = json.loads((final / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    loaded = R.transformers.AutoModelForCausalLM.from_pretrained(final)
    assert loaded.dtype == torch.bfloat16
    for key, value in loaded.state_dict().items():  # the fp32 weights rounded to bf16, nothing else
        assert torch.equal(value, before[key].to(torch.bfloat16)), key
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()  # still tied
    # 2 B/param, the tied embedding once (a second copy would add 2 x 512 x 64 B); the header is small
    assert (final / "model.safetensors").stat().st_size < 2 * sum(p.numel() for p in model.parameters()) + 16_384
    tok_loaded = R.transformers.AutoTokenizer.from_pretrained(final)
    torch.manual_seed(0)
    (ids, _, logp), = R.generate(loaded, tok_loaded, [R.encode_prompt(tok_loaded, "hello")], 4, 1.0)
    assert 1 <= len(ids) <= 4 and logp.dtype == torch.float32 and bool((logp < 0).all())
    assert all(torch.equal(v, before[k]) and v.dtype == torch.float32 for k, v in model.state_dict().items())
    run.checkpoint(model, tok, {"phase": "student", "iteration": 0})  # resumable: the fp32 master weights
    resumable = R.transformers.AutoModelForCausalLM.from_pretrained(run.checkpoints()[-1])
    assert resumable.dtype == torch.float32
    assert all(torch.equal(v, before[k]) for k, v in resumable.state_dict().items())


def test_a_bf16_saved_teacher_loaded_in_fp32_gives_zero_discrepancy_only_against_the_same_weights(tiny, tmp_path):
    """Phase 2 loads the teacher from its bf16 folder into --frozen-dtype float32: the teacher is
    then the bf16-rounded model, exactly. Against the same weights D = 0 exactly; against the fp32
    weights it was rounded from, D is small but not 0 (the cost of servable final models)."""
    model, tok = tiny
    R.Run(small_cfg(run_dir=str(tmp_path))).save_model(model, tok, "teacher")
    teacher, _ = R.load_policy(str(tmp_path / "teacher"), torch.device("cpu"), torch.float32)
    assert teacher.dtype == torch.float32
    rounded_student = copy.deepcopy(model).to(torch.bfloat16).to(torch.float32)
    cfg = small_cfg(env="alfworld")
    torch.manual_seed(0)
    samples, _, _ = R.rollout(model, tok, FakeSuite(), [0, 0], cfg, group_size=2, skills_in_prompt=False,
                              with_teacher_prompts=False, temperature=1.0)
    teacher_logp = torch.cat(R.response_logprobs(teacher, samples, cfg))
    for student, zero in ((rounded_student, True), (model, False)):
        student_logp = torch.cat(R.response_logprobs(student, samples, cfg))
        _, discrepancy = R.teacher_student_gap(student_logp, teacher_logp, torch.ones_like(student_logp))
        assert (discrepancy == 0.0) == zero
        assert discrepancy < 1e-5  # measured: ~1.5e-7 on the tiny model


def test_bad_flags_fail_before_any_model_is_loaded(tmp_path):
    for flags, message in ((["--algo", "ppo"], "--algo"), (["--group-size", "1"], "--group-size"),
                           (["--rho", "1.5"], "--rho"), (["--window", "0"], "--window"),
                           (["--eval-every", "0"], "--eval-every"), (["--eval-every", "6"], "--eval-every"),
                           (["--dual-clip", "1"], "--dual-clip"), (["--teacher-success", "0"], "--teacher-success"),
                           (["--opd-mini-batch", "0"], "--opd-mini-batch"), (["--opd-kl-coef", "-1"], "--opd-kl-coef"),
                           (["--kl-coef", "-1"], "--kl-coef"), (["--env", "atari"], "--env"),
                           (["--teacher", str(tmp_path)], "retireopd.json"),
                           (["--retire-at", "2", "--algo", "grpo"], "--retire-at"),
                           (["--retire-at", "99"], "--retire-at"), (["--temperature", "0.7"], "--temperature"),
                           (["--frozen-dtype", "int8"], "--frozen-dtype"), (["--model", "Qwen2.5-15B"], "alias"),
                           (["--env-workers", "-1"], "--env-workers"),
                           (["--prefill-batch", "-1"], "--prefill-batch"),
                           (["--env", "alfworld", "--alfworld-data", str(tmp_path / "none")], "alfworld-download"),
                           (["--env", "webshop", "--webshop-data", str(tmp_path)], "items_shuffle_1000.json"),
                           # accepted silently once: nothing trains, an empty panel, all pairs but the first
                           (["--ppo-epochs", "0"], "--ppo-epochs"), (["--eval-episodes", "0"], "--eval-episodes"),
                           (["--history", "-1"], "--history"), (["--keep-checkpoints", "0"], "--keep-checkpoints"),
                           (["--save-every", "-1"], "--save-every"), (["--logprob-chunk", "0"], "--logprob-chunk"),
                           (["--clip-eps", "0"], "--clip-eps"), (["--grad-clip", "0"], "--grad-clip"),
                           (["--success-reward", "0"], "--success-reward"),
                           (["--eval-temperature", "-1"], "--eval-temperature"),
                           (["--weight-decay", "-1"], "--weight-decay")):
        with pytest.raises(SystemExit, match=message) as failure:
            R.main(["--model", "tiny", "--run-dir", str(tmp_path / "x"), *flags])
        assert "\n" not in str(failure.value.code), flags  # one mistake, one line (--window 0 once gave two)
    assert not (tmp_path / "x").exists()


def test_webshop_data_error_names_the_flag(tmp_path):
    with pytest.raises(SystemExit, match="--webshop-data DIR") as failure:
        R.main(["--model", "tiny", "--env", "webshop", "--webshop-data", str(tmp_path), "--run-dir", str(tmp_path / "x")])
    assert "data_dir or" not in str(failure.value.code)  # the Python argument, not what a user types


def test_help_says_which_defaults_the_tiny_preset_replaces():
    helps = {action.dest: action.help for action in R.build_parser()._actions}
    for name, value in built_in_models.TINY_PRESET.items():
        default = R.Config.__dataclass_fields__[name].default
        assert f"[default: {default}; tiny: {value}]" in helps[name].replace("%%", "%"), name
    assert helps["seed"].endswith("[default: 0]")  # a flag the preset leaves alone says nothing about tiny


# ==================================================================================================
# 10. ALFWorld on the real alfworld/TextWorld engine: fixture games we write, and the shared real games
# ==================================================================================================

from alfworld_env import (  # noqa: E402
    ALFWORLD_FIXTURE_GAMES, ALFWORLD_TASK_TYPES, AlfWorldDataError, AlfWorldEnv,
    alfworld_data_root, alfworld_eval_panel, alfworld_task_type, discover_alfworld_games,
    write_fixture_alfworld_games, _ALFWORLD_MEMO,
)
from retireopd import success_by_task_type  # noqa: E402

HAVE_ALFWORLD = importlib.util.find_spec("alfworld") is not None
needs_alfworld = pytest.mark.skipif(not HAVE_ALFWORLD, reason="alfworld is not installed")


def _shared_alfworld():
    shared = os.environ.get("RETIREOPD_SHARED")
    base = Path(shared) if shared else Path(__file__).resolve().parent.parent / "shared"
    return base / "alfworld"


@pytest.fixture(scope="module")
def fixture_root(tmp_path_factory):
    if not HAVE_ALFWORLD:
        pytest.skip("alfworld is not installed")
    return write_fixture_alfworld_games(tmp_path_factory.mktemp("alfworld_fixture"))


def _load(game):
    with open(game) as f:
        return json.load(f)


def _walkthrough(game):
    return _load(game)["walkthrough"]


# ---------------------------------------------------------------------------- pure helpers

def test_task_types_constant_matches_alfworld_ids():
    assert ALFWORLD_TASK_TYPES == (
        "pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
        "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_two_obj_and_place")
    if HAVE_ALFWORLD:
        from alfworld.agents.environment.alfred_tw_env import TASK_TYPES
        assert tuple(TASK_TYPES[i] for i in range(1, 7)) == ALFWORLD_TASK_TYPES


@pytest.mark.parametrize("path,expected", [
    ("d/json_2.1.1/train/pick_cool_then_place_in_recep-Apple-None-CounterTop-14/trial_T1/"
     "game.tw-pddl", "pick_cool_then_place_in_recep"),
    ("pick_two_obj_and_place-Pan-None-CounterTop-14/trial_T1", "pick_two_obj_and_place"),
    ("look_at_obj_in_light-CD-None-DeskLamp-320/trial_x/game.tw-pddl", "look_at_obj_in_light"),
    ("x/pick_and_place_simple-Mug-None-SideTable-329/trial_T2/game.tw-pddl",
     "pick_and_place_simple"),
])
def test_task_type_from_path(path, expected):
    assert alfworld_task_type(path) == expected


@pytest.mark.parametrize("path", [
    "pick_and_place_with_movable_recep-Apple-Bowl-Fridge-1/trial_T1/game.tw-pddl",
    "some/other/folder/game.tw-pddl",
])
def test_task_type_unknown_raises(path):
    with pytest.raises(ValueError):
        alfworld_task_type(path)


def test_data_root_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "env"))
    assert alfworld_data_root(tmp_path / "flag") == tmp_path / "flag"
    assert alfworld_data_root() == tmp_path / "env"
    monkeypatch.delenv("ALFWORLD_DATA")
    assert alfworld_data_root() == Path.home() / ".cache" / "alfworld"


def test_missing_data_folder_is_a_clear_error(tmp_path):
    with pytest.raises(AlfWorldDataError) as err:
        discover_alfworld_games(tmp_path, "train")
    msg = str(err.value)
    assert "alfworld-download" in msg and "~/.cache/alfworld" in msg and "ALFWORLD_DATA" in msg
    assert str(tmp_path / "json_2.1.1" / "train") in msg and "not found" in msg
    assert isinstance(err.value, FileNotFoundError)


def test_empty_split_folder_is_an_error(tmp_path):
    (tmp_path / "json_2.1.1" / "train").mkdir(parents=True)
    with pytest.raises(AlfWorldDataError, match="no playable"):
        discover_alfworld_games(tmp_path, "train")


def test_success_by_task_type():
    records = [("pick_and_place_simple", True), ("pick_and_place_simple", False),
               ("pick_and_place_simple", True), ("look_at_obj_in_light", False),
               ("pick_two_obj_and_place", True)]
    out = success_by_task_type(records)
    assert out == {"pick_and_place_simple": pytest.approx(2 / 3), "look_at_obj_in_light": 0.0,
                   "pick_two_obj_and_place": 1.0, "overall": pytest.approx(3 / 5), "n": 5}
    assert success_by_task_type([]) == {"overall": 0.0, "n": 0}


# ---------------------------------------------------------------------------- fixture games

@needs_alfworld
def test_fixture_writer_layout(fixture_root):
    task_types = {row[1] for row in ALFWORLD_FIXTURE_GAMES}
    assert {"pick_and_place_simple", "pick_cool_then_place_in_recep",
            "pick_clean_then_place_in_recep"} <= task_types
    trials = sorted((fixture_root / "json_2.1.1").glob("*/*/*"))
    assert len(trials) == len(ALFWORLD_FIXTURE_GAMES)
    for trial in trials:
        game = _load(trial / "game.tw-pddl")
        assert set(game) == {"pddl_domain", "grammar", "pddl_problem", "solvable", "walkthrough"}
        assert game["solvable"] is True and game["walkthrough"]
        assert "UNKNOWN GOAL" not in game["grammar"] and "(:goal" in game["pddl_problem"]
        traj = _load(trial / "traj_data.json")
        assert traj["task_type"] == alfworld_task_type(trial)
        assert traj["pddl_params"]["object_target"] == trial.parent.name.split("-")[1]
        assert traj["turk_annotations"]["anns"][0]["task_desc"]


@needs_alfworld
def test_discovery_filters_like_alfworld(fixture_root, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(fixture_root, root)
    train = root / "json_2.1.1" / "train"
    good = sorted(str(p) for p in train.glob("*/*/game.tw-pddl"))
    assert len(good) == 6
    src = Path(good[0]).parent

    def clone(folder, drop=None, edit=None):
        dst = train / folder / "trial_x"
        shutil.copytree(src, dst)
        if drop:
            (dst / drop).unlink()
        if edit:
            game = _load(dst / "game.tw-pddl")
            edit(game)
            (dst / "game.tw-pddl").write_text(json.dumps(game))

    clone("pick_and_place_with_movable_recep-Apple-Bowl-Fridge-1")
    clone("pick_heat_then_place_in_recep-AppleSliced-None-Fridge-1")
    clone("pick_and_place_simple-Mug-None-Desk-2", drop="traj_data.json")
    clone("pick_and_place_simple-Mug-None-Desk-3", drop="game.tw-pddl")
    clone("pick_and_place_simple-Mug-None-Desk-4", edit=lambda g: g.update(solvable=False))
    clone("pick_and_place_simple-Mug-None-Desk-5", edit=lambda g: g.pop("solvable"))
    clone("unknown_task-Mug-None-Desk-6")
    corrupt = train / "pick_and_place_simple-Mug-None-Desk-7" / "trial_x"
    corrupt.mkdir(parents=True)
    (corrupt / "game.tw-pddl").write_text("{not json")
    (corrupt / "traj_data.json").write_text("{}")
    clone("pick_and_place_simple-Mug-None-Desk-8")           # a valid extra game: found
    found = discover_alfworld_games(root, "train")
    extra = str(train / "pick_and_place_simple-Mug-None-Desk-8" / "trial_x" / "game.tw-pddl")
    assert found == sorted(good + [extra])
    assert discover_alfworld_games(root, "train") == found      # deterministic
    assert len(discover_alfworld_games(root, "valid_seen")) == 3


@needs_alfworld
def test_eval_panel(fixture_root, tmp_path):
    with pytest.warns(UserWarning, match="valid_unseen"):
        panel = alfworld_eval_panel(fixture_root)
    assert panel == sorted(discover_alfworld_games(fixture_root, "valid_seen")) and len(panel) == 3
    with pytest.warns(UserWarning):
        assert alfworld_eval_panel(fixture_root, max_episodes=2) == panel[:2]
    both = alfworld_eval_panel(fixture_root, splits=("valid_seen", "train"))
    assert both == sorted(both) and len(both) == 9
    assert both[0].split(os.sep)[-4] == "train"     # sorted by path: train < valid_seen
    with pytest.raises(AlfWorldDataError):
        alfworld_eval_panel(tmp_path)


@needs_alfworld
def test_capped_eval_panel_covers_every_task_type(fixture_root, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(fixture_root, root)
    seen = root / "json_2.1.1" / "valid_seen"
    # a second pick_and_place_simple game that sorts before the other types' games
    shutil.copytree(seen / "pick_and_place_simple-Book-None-Desk-906", seen / "pick_and_place_simple-Book-None-Desk-916")
    full = alfworld_eval_panel(root, splits=("valid_seen",))
    assert [alfworld_task_type(g) for g in full] == ["pick_and_place_simple"] * 2 + [
        "pick_clean_then_place_in_recep", "pick_cool_then_place_in_recep"]
    capped = alfworld_eval_panel(root, splits=("valid_seen",), max_episodes=3)
    assert capped == [full[0], full[2], full[3]]        # one per type, not the first three
    assert alfworld_eval_panel(root, splits=("valid_seen",), max_episodes=4) == full
    assert alfworld_eval_panel(root, splits=("valid_seen",), max_episodes=1) == [full[0]]


@needs_alfworld
def test_reset_gives_task_and_admissible(fixture_root):
    for game in discover_alfworld_games(fixture_root, "train"):
        traj = _load(Path(game).parent / "traj_data.json")
        env = AlfWorldEnv(game)
        obs, info = env.reset()
        sentence = traj["turk_annotations"]["anns"][0]["task_desc"]
        assert info["task"] == sentence[0].lower() + sentence[1:]
        assert obs.startswith("-= Welcome to TextWorld, ALFRED! =-")
        assert obs.rstrip().endswith("Your task is to: " + info["task"])
        assert info["task_type"] == traj["task_type"] == alfworld_task_type(game)
        assert "help" not in info["admissible"]
        assert {"look", "inventory"} <= set(info["admissible"])
        assert any(a.startswith("go to ") for a in info["admissible"])
        assert info["won"] is False and info["error"] is None and info["turn"] == 0
        env.close()


@needs_alfworld
def test_walkthrough_wins_exactly_at_the_end(fixture_root):
    games = (discover_alfworld_games(fixture_root, "train")
             + discover_alfworld_games(fixture_root, "valid_seen"))
    assert len(games) == len(ALFWORLD_FIXTURE_GAMES)
    for game in games:
        env = AlfWorldEnv(game, max_turns=50)
        _, info = env.reset()
        actions = _walkthrough(game)
        for k, action in enumerate(actions):
            assert action in info["admissible"], (game, action)
            obs, reward, done, info = env.step(action)
            last = k == len(actions) - 1
            assert info["won"] is last and done is last, (game, action)
            assert reward == (1.0 if last else 0.0)
            assert "Nothing happens." not in obs
        assert info["turn"] == len(actions)
        # a finished episode ignores further steps
        obs2, reward, done, info2 = env.step("look")
        assert (obs2, reward, done, info2["turn"]) == (obs, 0.0, True, len(actions))


@needs_alfworld
def test_inadmissible_command_changes_nothing(fixture_root):
    game = discover_alfworld_games(fixture_root, "train")[0]
    env = AlfWorldEnv(game)
    _, info0 = env.reset()
    bad = "take unicorn 1 from shelf 1"
    assert bad not in info0["admissible"]
    obs, reward, done, info = env.step(bad)
    assert obs == "Nothing happens."
    assert info["admissible"] == info0["admissible"]
    assert (reward, done, info["won"], info["turn"]) == (0.0, False, False, 1)
    for action in _walkthrough(game):     # the state is unchanged: the walkthrough still wins
        _, reward, done, info = env.step(action)
    assert info["won"] and reward == 1.0 and done


@needs_alfworld
def test_turn_cap(fixture_root):
    game = discover_alfworld_games(fixture_root, "train")[0]
    env = AlfWorldEnv(game, max_turns=3)
    env.reset()
    dones = [env.step("look")[2] for _ in range(3)]
    assert dones == [False, False, True]
    obs, reward, done, info = env.step(_walkthrough(game)[0])
    assert done and reward == 0.0 and info["turn"] == 3 and not info["won"]
    _, info = env.reset()                   # a reset starts a new episode in the same slot
    assert info["turn"] == 0 and env.step("look")[2] is False


@needs_alfworld
def test_malformed_answer_is_a_counted_noop(fixture_root):
    game = discover_alfworld_games(fixture_root, "train")[1]
    actions = _walkthrough(game)
    env = AlfWorldEnv(game, max_turns=len(actions) + 2)
    env.reset()
    obs1, _, _, info1 = env.step(actions[0])
    obs2, reward, done, info2 = env.step(None)
    assert obs2 == obs1 and info2["admissible"] == info1["admissible"]
    assert (reward, done, info2["won"], info2["turn"]) == (0.0, False, False, 2)
    for action in actions[1:]:              # state unchanged: the rest of the walkthrough wins
        _, reward, done, info = env.step(action)
    assert info["won"] and reward == 1.0 and done and info["turn"] == len(actions) + 1
    env2 = AlfWorldEnv(game, max_turns=2)   # no-ops count toward the turn cap
    env2.reset()
    assert [env2.step(None)[2] for _ in range(2)] == [False, True]


@needs_alfworld
def test_engine_exception_ends_episode_as_failure(fixture_root, tmp_path, monkeypatch):
    game = discover_alfworld_games(fixture_root, "train")[0]
    env = AlfWorldEnv(game)
    obs0, _ = env.reset()

    def broken_step(command):
        raise RuntimeError("engine exploded")

    monkeypatch.setattr(env._engine, "step", broken_step)
    obs, reward, done, info = env.step("look")
    assert done and reward == 0.0 and info["won"] is False
    assert "engine exploded" in info["error"] and "RuntimeError" in info["error"]
    assert obs == obs0
    assert env.step("look")[2] is True      # stays finished, never raises
    # a corrupt game file fails at reset, also without raising
    bad = tmp_path / "pick_and_place_simple-Mug-None-Desk-1" / "trial_x" / "game.tw-pddl"
    bad.parent.mkdir(parents=True)
    bad.write_text(json.dumps({"pddl_domain": "(define", "grammar": "", "pddl_problem": "",
                               "solvable": True}))
    env_bad = AlfWorldEnv(bad)
    obs, info = env_bad.reset()
    assert info["error"] and info["won"] is False and env_bad.done
    assert env_bad.step("look")[1:3] == (0.0, True)
    # the pool hands out a working engine afterwards
    env3 = AlfWorldEnv(game)
    env3.reset()
    assert env3.step(_walkthrough(game)[0])[3]["error"] is None


@pytest.mark.slow
@needs_alfworld
def test_memoised_engine_gives_identical_text(fixture_root, monkeypatch):
    argv = ["retireopd.py", "--model", "tiny"]
    monkeypatch.setattr(sys, "argv", list(argv))
    for game in discover_alfworld_games(fixture_root, "train"):
        runs = []
        for memoise in (False, True, True):
            env = AlfWorldEnv(game, memoise=memoise)
            obs, info = env.reset()
            trace = [(obs, info["admissible"])]
            for action in ["look", "inventory", "take unicorn 1 from shelf 1"] + _walkthrough(game):
                obs, _, _, info = env.step(action)
                trace.append((obs, info["admissible"], info["won"]))
            runs.append(trace)
            env.close()
        assert runs[0] == runs[1] == runs[2], game
    assert sys.argv == argv                  # fast-downward's translator overwrites sys.argv
    assert _ALFWORLD_MEMO.stats["sas_hits"] > 0 and _ALFWORLD_MEMO.stats["logic_hits"] > 0
    assert _ALFWORLD_MEMO.conditions
    # the engine calls leave TextWorld's own functions in place
    import fast_downward
    import fast_downward.interface
    import textworld.logic
    import textworld.envs.pddl.logic as pddl_logic
    import textworld.envs.pddl.textgen as textgen
    assert fast_downward.pddl2sas is fast_downward.interface.pddl2sas
    assert textgen.Rule is textworld.logic.Rule
    assert pddl_logic.GameLogic.__name__ == "GameLogic" and isinstance(pddl_logic.GameLogic, type)
    assert textgen._parse_and_convert.__module__ == textgen.__name__
    # the memo hands out copies: its own parsed templates never hold a game's state
    assert _ALFWORLD_MEMO.templates
    for symbols in _ALFWORLD_MEMO.templates.values():
        assert all(not getattr(sym, "context", None) for sym in symbols)


@needs_alfworld
def test_group_members_are_independent(fixture_root):
    game = discover_alfworld_games(fixture_root, "train")[1]
    actions = _walkthrough(game)
    group = [AlfWorldEnv(game) for _ in range(3)]
    starts = [env.reset() for env in group]
    assert starts[0] == starts[1] == starts[2]
    for action in actions:                   # member 0 plays, member 1 only looks, 2 idles
        _, _, _, info0 = group[0].step(action)
        _, _, _, info1 = group[1].step("look")
    assert info0["won"] and not info1["won"]
    assert group[2].step(None)[3]["admissible"] == starts[2][1]["admissible"]
    for action in actions:
        _, reward, _, info2 = group[2].step(action)
    assert info2["won"] and reward == 1.0


@pytest.mark.slow
@needs_alfworld
def test_env_workers_play_exactly_like_this_process(fixture_root, tiny, monkeypatch):
    """--env-workers: the same episodes, turn for turn, when worker processes own the games; a
    task's G episodes share a worker; a dead worker is a clear error, not a hang."""
    model, tok = tiny
    games = discover_alfworld_games(fixture_root, "train")
    walkthroughs = {}
    for game in games:
        _, info = AlfWorldEnv(game).reset()
        walkthroughs[info["task"]] = _walkthrough(game)
    turn = [0]

    def scripted(m, t, prompts, n, temp, **_):  # each game's walkthrough, one step per turn
        answers = []
        for prompt in prompts:
            task = t.decode(prompt).split("Your task: ", 1)[1].split("\n", 1)[0]
            steps = walkthroughs[task]
            action = steps[turn[0]] if turn[0] < len(steps) else "look"
            answers.append(R.Sampled(t(f"<think>x</think><action>{action}</action><|im_end|>")["input_ids"], False))
        turn[0] += 1
        return answers

    monkeypatch.setattr(R, "generate", scripted)
    longest = max(map(len, walkthroughs.values()))

    def play(workers):
        cfg = small_cfg(env="alfworld", alfworld_data=str(fixture_root), max_turns=longest + 1,
                        env_workers=workers)
        with pytest.warns(UserWarning, match="valid_unseen"):  # the fixtures have no such split
            suite = R.TaskSuite(cfg)
        turn[0] = 0
        try:
            samples, episodes, _ = R.rollout(model, tok, suite, games, cfg, group_size=2, skills_in_prompt=False,
                                             with_teacher_prompts=False, temperature=1.0)
            if workers:
                assert [e.env.worker for e in episodes] == [g % workers for g in range(len(games)) for _ in range(2)]
                suite.workers.processes[1].kill()
                suite.workers.processes[1].join()
                with pytest.raises(RuntimeError, match=r"worker 1 died .*--resume"):
                    R.env_calls([(e.env, "reset", ()) for e in episodes])
                with pytest.raises(RuntimeError, match="unusable"):  # never a stale answer
                    episodes[0].env.reset()
        finally:
            suite.close()
        return ([(s.episode, s.prompt_ids, s.response_ids, s.score) for s in samples],
                [(e.task, e.observation, e.history, e.admissible, e.won, e.turns, e.error) for e in episodes])

    here, there = play(0), play(2)
    assert all(won for *_, won, _, _ in here[1]) and len(here[1]) == 2 * len(games)
    assert there == here

# ---------------------------------------------------------------------------- real games

def _real_games():
    root = _shared_alfworld()
    manifest = root / "manifest.jsonl"
    if not HAVE_ALFWORLD or not manifest.is_file():
        return root, []
    return root, [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()]


REAL_ROOT, REAL_GAMES = _real_games()
needs_real = pytest.mark.skipif(not REAL_GAMES, reason="shared/alfworld or alfworld missing")


@needs_real
def test_real_games_discovery():
    found = discover_alfworld_games(REAL_ROOT, "valid_seen")
    assert len(found) == 24
    assert found == sorted(str(REAL_ROOT / g["gamefile"]) for g in REAL_GAMES)
    with pytest.warns(UserWarning):
        assert alfworld_eval_panel(REAL_ROOT) == found
    with pytest.warns(UserWarning):
        capped = alfworld_eval_panel(REAL_ROOT, max_episodes=12)
    assert sorted(Counter(alfworld_task_type(g) for g in capped).values()) == [2] * 6


@pytest.mark.slow
@needs_real
@pytest.mark.parametrize("record", REAL_GAMES, ids=[g["path"].split("/")[2] for g in REAL_GAMES])
def test_real_game_expert_replay_wins(record):
    env = AlfWorldEnv(REAL_ROOT / record["gamefile"], max_turns=50)
    assert env.task_type == record["task_type"]
    obs, info = env.reset()
    assert obs == record["initial_observation"]
    assert "Your task is to: " + info["task"] == record["task"]
    assert len(info["admissible"]) == record["n_admissible_at_reset"] - 1   # without "help"
    actions = record["expert_actions"]
    for k, action in enumerate(actions):
        # the recorded expert sometimes sends "help": hidden from the list, still executed
        assert action in info["admissible"] or action == "help"
        obs, reward, done, info = env.step(action)
        last = k == len(actions) - 1
        assert info["won"] is last and done is last and info["error"] is None
    assert reward == 1.0 and obs == record["final_feedback"]
    env.close()


# ==================================================================================================
# 11. Nothing lost, nothing crashes: resume, guards, the tokenizer round trip, the docs
# ==================================================================================================

TIMING_KEYS = ("t_", "tokens_per_s", "peak_mem_gb")


def comparable(metrics):
    return [{k: v for k, v in m.items() if not k.startswith(TIMING_KEYS) and "per_s" not in k} for m in metrics]


@pytest.mark.slow
def test_sigkill_in_phase_two_then_resume_loses_and_repeats_nothing(tmp_path):
    import subprocess
    import time as time_module
    flags = QUICK + ["--env", "webshop", "--iterations", "4"]
    reference = tmp_path / "uninterrupted"
    R.main(flags + ["--run-dir", str(reference)])
    killed = tmp_path / "killed"
    process = subprocess.Popen([sys.executable, "retireopd.py", *flags, "--run-dir", str(killed)],
                               cwd=Path(__file__).parent, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})  # as this process: same sums
    deadline = time_module.time() + 300
    while time_module.time() < deadline and process.poll() is None:  # kill once phase 2 has checkpoints
        if any(m["phase"] == "student" and m["iteration"] >= 1 for m in R.read_jsonl(killed / "metrics.jsonl")):
            process.kill()
            break
        time_module.sleep(0.05)
    process.wait()
    assert process.returncode != 0, "the run finished before it could be killed"
    R.main(["--resume", str(killed)])
    metrics = R.read_jsonl(killed / "metrics.jsonl")
    assert phases(metrics) == [(p, k) for p in ("teacher", "student") for k in range(4)]
    # the same seed gives the same run: every logged value but the timings, and the final weights
    assert comparable(metrics) == comparable(R.read_jsonl(reference / "metrics.jsonl"))
    ours = R.load_policy(str(killed / "student"), torch.device("cpu"), torch.float32)[0].state_dict()
    theirs = R.load_policy(str(reference / "student"), torch.device("cpu"), torch.float32)[0].state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    events = [e["event"] for e in R.read_jsonl(killed / "events.jsonl")]
    assert "resume" in events and events[-1] == "done"


class Crash(Exception):
    """Stops a run where a kill would (raised in place of a save)."""


def crash_instead_of_saving(monkeypatch, run_dir, flags, crash_at):
    """Run QUICK + flags in run_dir until the first Run.save_model(name) (a checkpoint or a final
    model) for which crash_at(name) is true: there the run stops, that save not even begun."""
    real_save = R.Run.save_model

    def save_model(self, model, tokenizer, name, *args, **kwargs):
        if crash_at(name):
            raise Crash(name)
        return real_save(self, model, tokenizer, name, *args, **kwargs)
    with monkeypatch.context() as patch:
        patch.setattr(R.Run, "save_model", save_model)
        with pytest.raises(Crash):
            R.main(QUICK + ["--run-dir", str(run_dir), *flags])


def test_resume_before_the_first_checkpoint_starts_over_without_duplicates(tmp_path, monkeypatch):
    run_dir = tmp_path / "early"
    # --save-every 0: the first checkpoint would be the last iteration's; the run dies there instead
    crash_instead_of_saving(monkeypatch, run_dir, ["--env", "webshop", "--algo", "grpo", "--save-every", "0"],
                            lambda name: name.startswith("checkpoints/"))
    assert phases(R.read_jsonl(run_dir / "metrics.jsonl")) == [("student", k) for k in range(3)]
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
    R.main(["--resume", str(run_dir)])
    assert phases(R.read_jsonl(run_dir / "metrics.jsonl")) == [("student", k) for k in range(3)]
    validations = [(e["iteration"], e["skills"]) for e in R.read_jsonl(run_dir / "eval.jsonl")
                   if e["panel"] == "validation"]
    assert validations == [(k, False) for k in (-1, 0, 1, 2)]  # the one before training too, once
    with pytest.raises(SystemExit, match="--group-size"):  # a resume may not change the config
        R.main(["--resume", str(run_dir), "--group-size", "4"])
    assert R.resume_config(str(run_dir), {"env_workers": 3}).env_workers == 3  # only how it runs
    assert R.resume_config(str(run_dir), {"prefill_batch": 4}).prefill_batch == 4  # e.g. after running out of memory


# --- the run folder: what it holds, a damaged one, places it cannot be, write failures ------------

def folder_snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_folder_that_holds_a_run_is_refused_and_left_as_it_was(tmp_path):
    run_dir, _, _ = run_cli(tmp_path, "R", "--env", "webshop")
    before = folder_snapshot(run_dir)
    refusal = f"retireopd: {run_dir} holds a run: `--resume {run_dir}` continues it, or choose another `--run-dir`"
    # another run (once: its student distilled from the WebShop teacher), then the same command twice
    for flags in (["--env", "alfworld", "--iterations", "4"], ["--env", "webshop"]):
        with pytest.raises(SystemExit) as failure:
            R.main(QUICK + ["--run-dir", str(run_dir), *flags])
        assert failure.value.code == refusal
    assert folder_snapshot(run_dir) == before  # config, logs, checkpoints, teacher: untouched
    assert json.loads((run_dir / "run.json").read_text())["env"] == "webshop"  # what the folder holds
    legacy = tmp_path / "older"  # a run folder written before run.json existed
    legacy.mkdir()
    (legacy / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit, match="holds a run"):
        R.main(QUICK + ["--env", "webshop", "--run-dir", str(legacy)])


@pytest.mark.slow
def test_a_resume_after_retirement_keeps_the_distilling_phase_protocol(tmp_path, monkeypatch):
    # phase 2 keeps --opd-mini-batch (and no KL) after its teacher is retired, also when a resume
    # finds the teacher retired and loads none. At most 2 x 2 x 2 = 8 turn-samples per iteration:
    # one optimizer step with --opd-mini-batch 8, one per sample with --mini-batch 1.
    flags = ["--env", "webshop", "--iterations", "4", "--retire-at", "1", "--batch-tasks", "2",
             "--mini-batch", "1", "--opd-mini-batch", "8"]
    reference = tmp_path / "uninterrupted"
    R.main(QUICK + ["--run-dir", str(reference), *flags])
    crashed = tmp_path / "crashed"
    crash_instead_of_saving(monkeypatch, crashed, flags, lambda name: name.endswith("1-student-00002"))
    R.main(["--resume", str(crashed)])
    ours, theirs = R.read_jsonl(crashed / "metrics.jsonl"), R.read_jsonl(reference / "metrics.jsonl")
    student = [m for m in ours if m["phase"] == "student"]
    assert [m["teacher_active"] for m in student] == [True, False, False, False]
    assert all(m["optimizer_steps"] == 1 and "kl_ref" not in m for m in student)
    assert comparable(ours) == comparable(theirs)


def test_algo_opd_needs_a_positive_opd_coef(tmp_path):
    with pytest.raises(SystemExit, match="--algo opd trains on lambda \\* L_OPD alone: --opd-coef must be > 0"):
        R.main(QUICK + ["--run-dir", str(tmp_path / "run"), "--algo", "opd", "--opd-coef", "0"])
    assert not (tmp_path / "run").exists()


def test_resume_checks_the_environment_of_the_runs_own_teacher(tmp_path):
    run_dir = tmp_path / "stopped"
    at = QUICK.index("--teacher-success")
    without_s_t = QUICK[:at] + QUICK[at + 2:]
    with pytest.raises(SystemExit, match="S_T = 0"):  # the random teacher: phase 1 ends, phase 2 cannot start
        R.main(without_s_t + ["--env", "kitchen", "--run-dir", str(run_dir)])
    stored = json.loads((run_dir / "teacher" / "retireopd.json").read_text())
    (run_dir / "teacher" / "retireopd.json").write_text(json.dumps({**stored, "env": "alfworld"}))  # another env's
    with pytest.raises(SystemExit, match="trained on alfworld, this run is --env kitchen"):
        R.main(["--resume", str(run_dir), "--teacher-success", "0.5"])


def test_resume_of_a_finished_run_says_so_and_changes_nothing(tmp_path, capsys):
    run_dir, _, _ = run_cli(tmp_path, "finished", "--env", "webshop", "--algo", "grpo")
    before = folder_snapshot(run_dir)
    capsys.readouterr()
    assert R.main(["--resume", str(run_dir)]) == run_dir  # exits 0
    said = capsys.readouterr().out
    assert said == f"[retireopd] {run_dir} already finished: nothing to resume (its outputs are there)\n"
    assert folder_snapshot(run_dir) == before  # no second evaluation, no second `done`


@pytest.mark.slow
def test_a_crash_while_saving_the_teacher_then_resume_logs_each_line_once(tmp_path, monkeypatch):
    flags = ["--env", "webshop", "--algo", "skill-grpo"]
    reference, _, _ = run_cli(tmp_path, "reference", *flags)
    run_dir = tmp_path / "crashed"
    crash_instead_of_saving(monkeypatch, run_dir, flags, lambda name: name == "teacher")  # after its reports
    R.main(["--resume", str(run_dir)])

    def logged(folder):
        evals = [(e["phase"], e["iteration"], e["panel"], e["skills"], e["overall"])
                 for e in R.read_jsonl(folder / "eval.jsonl")]
        return evals, [e["event"] for e in R.read_jsonl(folder / "events.jsonl") if e["event"] != "resume"]
    assert logged(run_dir) == logged(reference)  # the reports, teacher_ready, the memory estimate: once each


def cut_in_half(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.slow
def test_resume_sets_damaged_checkpoints_aside_and_drops_a_cut_last_log_line(tmp_path, monkeypatch, capsys):
    flags = ["--env", "webshop", "--algo", "grpo", "--iterations", "4", "--keep-checkpoints", "3"]
    reference, _, _ = run_cli(tmp_path, "reference", *flags)
    run_dir = tmp_path / "damaged"
    crash_instead_of_saving(monkeypatch, run_dir, flags, lambda name: name == "checkpoints/1-student-00003")
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["1-student-00000", "1-student-00001", "1-student-00002"]
    cut_in_half(checkpoints / "1-student-00002" / "trainer.pt")  # a crash or a full disk while writing them
    cut_in_half(checkpoints / "1-student-00001" / "model.safetensors")
    shutil.copytree(reference / "checkpoints" / "1-student-00003", checkpoints / "1-student-00003")  # another run's
    for name in ("metrics.jsonl", "events.jsonl"):
        with open(run_dir / name, "a") as f:
            f.write('{"phase": "student", "itera')  # killed in the middle of a line
    capsys.readouterr()
    R.main(["--resume", str(run_dir)])
    out = capsys.readouterr().out
    assert "checkpoint 1-student-00003 is not usable (it belongs to run" in out
    assert "checkpoint 1-student-00002 is not usable (trainer.pt does not load" in out
    assert "checkpoint 1-student-00001 is not usable (model.safetensors is cut short" in out
    assert f"the last line of {run_dir / 'metrics.jsonl'} was cut short" in out
    assert f"the last line of {run_dir / 'events.jsonl'} was cut short" in out
    assert "resuming" in out and "from checkpoint 1-student-00000" in out
    assert {p.name for p in checkpoints.iterdir()} >= {f"1-student-0000{k}.corrupt" for k in (1, 2, 3)}
    # iterations 1-3 were redone from the intact checkpoint: the same run as the uninterrupted one
    assert comparable(R.read_jsonl(run_dir / "metrics.jsonl")) == comparable(R.read_jsonl(reference / "metrics.jsonl"))
    ours = R.load_policy(str(run_dir / "student"), torch.device("cpu"), torch.float32)[0].state_dict()
    theirs = R.load_policy(str(reference / "student"), torch.device("cpu"), torch.float32)[0].state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert [e["event"] for e in R.read_jsonl(run_dir / "events.jsonl")].count("done") == 1


def test_read_jsonl_drops_only_a_cut_last_line(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"iteration": 0}\n{"iteration": 1}\n{"itera')
    assert R.read_jsonl(log) == [{"iteration": 0}, {"iteration": 1}]
    log.write_text('{"iteration": 0}\n{"itera\n{"iteration": 2}\n')  # damaged before the last line: not guessed at
    with pytest.raises(SystemExit, match="line 2 is not JSON"):
        R.read_jsonl(log)


def test_saved_model_problem_finds_a_half_written_safetensors_file(tiny, tmp_path):
    model, tok = tiny
    folder = R.Run(small_cfg(run_dir=str(tmp_path))).save_model(model, tok, "student")
    assert checks.saved_model_problem(folder) is None
    cut_in_half(folder / "model.safetensors")
    assert "model.safetensors is cut short" in checks.saved_model_problem(folder)
    with open(folder / "model.safetensors", "r+b") as f:  # cut inside its header
        f.truncate(20)
    assert "header is incomplete" in checks.saved_model_problem(folder)


def test_unwritable_run_folders_are_one_line_errors_before_anything_runs(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    for run_dir, message in ((a_file, f"{a_file} is a file, not a folder"),
                             (a_file / "run", f"{a_file} is a file, not a folder"),
                             (Path("/proc/retireopd-run"), "cannot create or write a folder there")):
        with pytest.raises(SystemExit) as failure:
            R.main(QUICK + ["--env", "webshop", "--run-dir", str(run_dir)])
        assert str(failure.value.code).startswith(f"retireopd: --run-dir {run_dir}: {message}")
        assert "\n" not in str(failure.value.code)


def private_tmpfs_command(tmp_path, options, command):
    """`command` run with a fresh tmpfs (mount `options`) on tmp_path/mnt, in a private mount
    namespace (nothing outlives the process), or None where this machine does not allow one."""
    import subprocess
    mount = tmp_path / "mnt"
    mount.mkdir(exist_ok=True)
    wrapper = ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o "$0" none "$1" && shift && exec "$@"', options,
               str(mount)]
    if shutil.which("unshare") is None or subprocess.run([*wrapper, "true"], capture_output=True).returncode != 0:
        return None
    return [*wrapper, *command]


@pytest.mark.slow
def test_a_read_only_disk_is_a_one_line_error(tmp_path):
    import subprocess
    run_dir = tmp_path / "mnt" / "run"
    command = private_tmpfs_command(tmp_path, "ro,size=1m", [sys.executable, "retireopd.py", *QUICK, "--env",
                                                             "webshop", "--run-dir", str(run_dir)])
    if command is None:  # (as root, chmod does not stop writes: a read-only mount is the real thing)
        pytest.skip("no private mount namespace here (unshare -rm) for a real read-only filesystem")
    done = subprocess.run(command, cwd=Path(__file__).parent, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.strip() == (
        f"retireopd: --run-dir {run_dir}: cannot create or write a folder there (Read-only file system): "
        "choose one on a writable disk")


FULL_DISK_DRIVER = """
import json, os, resource, signal, sys
from pathlib import Path
import checks
import retireopd as R
run_dir, how, summary, flags = Path(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
ballast, soft_limit = run_dir.parent / "ballast", resource.getrlimit(resource.RLIMIT_FSIZE)
real_checkpoint, filled = R.Run.checkpoint, []

def checkpoint(self, *args, **kwargs):  # after the first checkpoint, the disk fills up (once)
    real_checkpoint(self, *args, **kwargs)
    if filled:
        return
    filled.append(how)
    if how == "fsize":  # files stop growing at 512 KiB: the write fails as on a full disk (EFBIG, not ENOSPC)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (512 * 1024, soft_limit[1]))
        return
    # room for the log lines and the next checkpoint's weights, not for its trainer.pt: torch.save fails
    # ("unexpected pos", as reported), after safetensors succeeded
    newest = self.checkpoints()[-1]
    room = sum(f.stat().st_size for f in newest.iterdir() if f.name != "trainer.pt") + 256 * 1024
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, bytes(1 << 16))
    except OSError:  # full
        os.ftruncate(fd, max(0, os.fstat(fd).st_size - room))
    os.close(fd)

R.Run.checkpoint = checkpoint
try:
    R.main(flags + ["--run-dir", str(run_dir)])
    message = None
except SystemExit as stop:
    message = str(stop.code)
left = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
kept_whole = all(checks.saved_model_problem(run_dir / "checkpoints" / name) is None for name in left)
ballast.unlink(missing_ok=True)  # make room again, then resume
resource.setrlimit(resource.RLIMIT_FSIZE, soft_limit)
R.main(["--resume", str(run_dir)])
metrics = [(m["phase"], m["iteration"]) for m in R.read_jsonl(run_dir / "metrics.jsonl")]
Path(summary).write_text(json.dumps({"message": message, "left": left, "kept_whole": kept_whole, "metrics": metrics}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["tmpfs", "fsize"])
def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one_and_says_what_to_do(tmp_path, how):
    import subprocess
    flags = QUICK + ["--env", "webshop", "--algo", "grpo"]
    summary = tmp_path / "summary.json"
    driver = [sys.executable, "-c", FULL_DISK_DRIVER]
    run_dir = tmp_path / "mnt" / "run"
    if how == "tmpfs":  # a real full disk: a small tmpfs filled up after the first checkpoint
        command = private_tmpfs_command(tmp_path, "size=64m", driver)
        if command is None:
            pytest.skip("no private mount namespace here (unshare -rm) for a small filesystem to fill")
    else:
        command = driver
    done = subprocess.run([*command, str(run_dir), how, str(summary), json.dumps(flags)], cwd=Path(__file__).parent,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-8000:]
    result = json.loads(summary.read_text())
    message = result["message"]
    assert message.startswith(f"retireopd: could not write {run_dir / 'checkpoints' / '1-student-00001'} (")
    assert ("the disk is full: " in message) == (how == "tmpfs")  # (fsize: "File too large", the disk has room)
    assert f"the last checkpoint, 1-student-00000, is kept: `--resume {run_dir}` continues from it" in message
    assert "\n" not in message and (("--keep-checkpoints" in message and "--save-every" in message) if how == "tmpfs"
                                    else "ulimit -f" in message and "free some space" not in message)
    assert result["left"] == ["1-student-00000"] and result["kept_whole"]  # no half-written one left
    assert result["metrics"] == [["student", k] for k in range(3)]  # resumed, nothing twice


@pytest.mark.slow
def test_ctrl_c_names_the_run_folder_to_resume(tmp_path):
    import signal
    import subprocess
    import time as time_module
    run_dir = tmp_path / "my run"  # a space: the command must still be one to copy
    process = subprocess.Popen([sys.executable, "retireopd.py", *QUICK, "--env", "webshop", "--algo", "grpo",
                                "--iterations", "50", "--run-dir", str(run_dir)], cwd=Path(__file__).parent,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               # Ctrl-C reaches the run even when these tests run as a background job, which
                               # a shell starts with SIGINT ignored (the run would inherit that)
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time_module.time() + 120
    while time_module.time() < deadline and process.poll() is None and not R.read_jsonl(run_dir / "metrics.jsonl"):
        time_module.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 1, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (f"[retireopd] interrupted: continue with `python retireopd.py "
                                               f"--resume '{run_dir}'` (from the last checkpoint)")


# --- --report-to: the live dashboard gets what the logs get ---------------------------------------------

def test_tracker_records_are_the_log_lines_numbers_at_one_step_across_the_phases():
    cfg = R.Config(model="tiny", iterations=4, teacher_iterations=3)
    line = {"phase": "student", "iteration": 1, "success": 0.5, "retired": True, "gap": None, "phase_note": "x",
            "nested": {"a": 2, "b": {"c": False}}}
    assert tools.tracker_record(cfg, "metrics.jsonl", line) == (5, {  # phase 1's 3 updates, then phase 2's 2nd
        "student/success": 0.5, "student/retired": 1.0, "student/nested/a": 2.0, "student/nested/b/c": 0.0})
    assert tools.tracker_record(cfg, "metrics.jsonl", {"phase": "teacher", "iteration": 2, "loss": -1}) == (
        3, {"teacher/loss": -1.0})
    validation = {"phase": "teacher", "iteration": 0, "panel": "validation", "dorl": 1.0, "overall": 0.25, "n": 4,
                  "skills": True, "seed": 12345, "temperature": 0.4}
    assert tools.tracker_record(cfg, "eval.jsonl", validation) == (1, {
        "teacher/validation_skills/dorl": 1.0, "teacher/validation_skills/overall": 0.25,
        "teacher/validation_skills/n": 4.0, "teacher/validation_skills/seed": 12345.0,
        "teacher/validation_skills/temperature": 0.4})
    report = {"phase": "student", "iteration": 3, "panel": "report", "overall": 1.0, "skills": False}
    assert tools.tracker_record(cfg, "eval.jsonl", report) == (7, {"student/report_no_skills/overall": 1.0})
    before = {"phase": "teacher", "iteration": -1, "panel": "validation", "overall": 0.0, "skills": False,
              "before_training": True}  # the validation before any update: step 0, never a negative one
    assert tools.tracker_record(cfg, "eval.jsonl", before) == (0, {"teacher/validation_no_skills/overall": 0.0})
    retirement = {"event": "retirement", "rule": "adaptive", "retired_at": 2, "decided_after_iteration": 1,
                  "judged_block": 0.2, "progress": -1.0, "competence": 1.1, "val_success": 0.9, "criterion_valid": True}
    assert tools.tracker_record(cfg, "events.jsonl", retirement) == (5, {
        "student/retirement/retired_at": 2.0, "student/retirement/judged_block": 0.2,
        "student/retirement/progress": -1.0, "student/retirement/competence": 1.1,
        "student/retirement/val_success": 0.9, "student/retirement/criterion_valid": 1.0})
    for event in ({"event": "done", "wall_s": 3.0}, {"event": "memory_estimate", "phase": "phase 1", "gib": {}}):
        assert tools.tracker_record(cfg, "events.jsonl", event) is None
    grpo = R.dataclasses.replace(cfg, algo="grpo")  # no phase 1: phase 2's validation before training is step 0
    assert tools.tracker_record(grpo, "metrics.jsonl", {"phase": "student", "iteration": 1})[0] == 2


@pytest.mark.parametrize("tracker,module", [("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb")])
def test_a_missing_tracker_package_is_a_one_line_error_before_anything_is_written(tmp_path, monkeypatch, capsys,
                                                                                   tracker, module):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed: importing it raises ImportError
    with pytest.raises(SystemExit) as stop:
        R.main(QUICK + ["--env", "webshop", "--report-to", tracker, "--run-dir", str(tmp_path / "run")])
    assert str(stop.value) == (f"retireopd: --report-to {tracker} needs the {tracker} package, not installed here: "
                               f"pip install {tracker}")
    assert not (tmp_path / "run").exists()
    with pytest.raises(SystemExit, match="--report-to: none, tensorboard or wandb"):
        R.parse_config({"model": "tiny", "report_to": "mlflow", "run_dir": str(tmp_path / "other")})


def test_only_rank_0_reports(tmp_path, monkeypatch):
    run = R.Run(R.parse_config({"model": "tiny", "env": "webshop", "run_dir": str(tmp_path / "run")}))
    sent = []
    run.tracker = type("Recorder", (), {"log": lambda self, name, record: sent.append((name, record))})()
    run.log("metrics.jsonl", {"phase": "teacher", "iteration": 0, "success": 0.0})
    monkeypatch.setenv("RANK", "1")  # under torchrun, another rank logs the same line: it writes and sends nothing
    run.log("metrics.jsonl", {"phase": "teacher", "iteration": 1, "success": 0.0})
    assert sent == [("metrics.jsonl", {"phase": "teacher", "iteration": 0, "success": 0.0})]
    assert len(R.read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 1


def scalars(folder):
    """{tag: [(step, value)]} of every scalar in a TensorBoard log folder, read back by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.slow
def test_tensorboard_gets_every_metrics_line_evaluation_and_the_retirement_and_a_resume_appends(tmp_path,
                                                                                              monkeypatch):
    pytest.importorskip("tensorboard", reason="tensorboard is in requirements.txt; without it this test cannot run")
    run_dir = tmp_path / "run"  # interrupted where the checkpoint after student iteration 1 would be written
    flags = ["--env", "webshop", "--iterations", "4", "--retire-at", "2", "--report-to", "tensorboard"]
    crash_instead_of_saving(monkeypatch, run_dir, flags, lambda name: name == "checkpoints/1-student-00001")
    before = scalars(run_dir / "tensorboard")
    assert [step for step, _ in before["student/success"]] == [5, 6]  # phase 1's 4 updates, then phase 2's
    R.main(["--resume", str(run_dir)])  # redoes student iteration 1, then goes on
    assert len(list((run_dir / "tensorboard").iterdir())) == 2  # the same folder: a second event file
    logged = scalars(run_dir / "tensorboard")
    metrics = R.read_jsonl(run_dir / "metrics.jsonl")
    for m in metrics:  # each number of each line, once, at its step (the redone iteration's first try purged)
        step = m["iteration"] + 1 + (4 if m["phase"] == "student" else 0)
        for key in ("success", "loss", "grad_norm", "retired", "gap"):
            if key in m:
                assert [v for s, v in logged[f"{m['phase']}/{key}"] if s == step] == [pytest.approx(float(m[key]))]
    assert [s for s, _ in logged["student/success"]] == [5, 6, 7, 8] and [s for s, _ in logged["teacher/loss"]] == [
        1, 2, 3, 4]
    for e in R.read_jsonl(run_dir / "eval.jsonl"):
        tag = f"{e['phase']}/{e['panel']}_{'skills' if e['skills'] else 'no_skills'}/overall"
        step = e["iteration"] + 1 + (4 if e["phase"] == "student" else 0)  # before training: step 0
        assert [v for s, v in logged[tag] if s == step] == [pytest.approx(e["overall"])]
    assert logged["student/retirement/retired_at"] == [(6, 2.0)]  # decided after student iteration 1


@pytest.mark.slow
def test_wandb_offline_gets_the_same_numbers_and_a_resume_continues_the_same_run(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="wandb is in requirements.txt; without it this test cannot run")
    for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
                       "WANDB_CONSOLE": "off", "WANDB_PROJECT": "retireopd-test"}.items():
        monkeypatch.setenv(key, value)  # no network: the run is written to WANDB_DIR/wandb/offline-run-*
    run_dir = tmp_path / "run"
    flags = ["--env", "webshop", "--algo", "grpo", "--report-to", "wandb"]
    crash_instead_of_saving(monkeypatch, run_dir, flags, lambda name: name == "checkpoints/1-student-00001")
    wandb.finish()  # what the end of a crashed process does
    R.main(["--resume", str(run_dir)])
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    offline = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(folder.name.endswith("-" + run_id) for folder in offline)  # one W&B run, twice
    history, runs = [], []
    for folder in offline:  # read back by wandb's own reader of its transaction log
        (log,) = folder.glob("run-*.wandb")
        done = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                              capture_output=True, text=True, timeout=120)
        records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        history += [r["history"]["item"] for r in records if r.get("type") == "history"]
        runs += [r["run"] for r in records if r.get("type") == "run"]
    assert {r["run_id"] for r in runs} == {run_id} and {r["project"] for r in runs} == {"retireopd-test"}
    by_step = {}
    for item in history:
        by_step.setdefault(item["_step"], {}).update(item)
    metrics = R.read_jsonl(run_dir / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [0, 1, 2]  # --algo grpo: no phase 1; before training is step 0
    assert sorted(by_step) == [0, 1, 2, 3]
    for m in metrics:
        for key in ("success", "loss", "grad_norm", "samples"):
            assert by_step[m["iteration"] + 1][f"student/{key}"] == pytest.approx(float(m[key]))
    evaluations = R.read_jsonl(run_dir / "eval.jsonl")
    assert evaluations[0]["iteration"] == -1 and evaluations[0]["before_training"]
    for e in evaluations:
        assert by_step[e["iteration"] + 1][f"student/{e['panel']}_no_skills/overall"] == pytest.approx(e["overall"])


# --- --model: a missing folder, an unknown hub id, no network: one line, in seconds, nothing written ---

def closed_port_url():
    """An address where nothing listens: connecting is refused at once, like a hub without network."""
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


@contextlib.contextmanager
def stand_in_hub(known=()):
    """A local HTTP server answering the hub's model API: 200 for the repos in `known`, else the
    hub's 404 with X-Error-Code RepoNotFound."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            repo = self.path.split("?")[0].removeprefix("/api/models/")
            body = json.dumps({"id": repo} if repo in known else {"error": "Repository Not Found"}).encode()
            self.send_response(200 if repo in known else 404)
            if repo not in known:
                self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        do_HEAD = do_GET

        def log_message(self, *args):
            pass
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """point(url): this process's Hugging Face hub is at url (None: HF_HUB_OFFLINE), its cache empty."""
    import huggingface_hub
    clear = checks.hub_answer.cache_clear

    def point(url):
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", url or "https://huggingface.co")
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", url is None)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
        clear()
    yield point
    clear()


def test_model_problems_are_one_line_in_seconds_before_anything_is_written(tmp_path, hub):
    import time as time_module
    run_dir = tmp_path / "run"

    def failure(model, *flags):
        start = time_module.time()
        with pytest.raises(SystemExit) as stop:
            R.main(["--model", model, "--env", "webshop", "--run-dir", str(run_dir), *flags])
        assert time_module.time() - start < 15 and not run_dir.exists()  # (it once retried for 100 s)
        assert "\n" not in str(stop.value.code)
        return str(stop.value.code)
    # a local folder that is not there: said first, even where the environment's data is missing too
    message = failure("./nonexistent_dir", "--env", "alfworld", "--alfworld-data", str(tmp_path / "no-data"))
    assert message.startswith("retireopd: --model ./nonexistent_dir: no such folder")
    assert "tiny" in message and "random:" in message
    assert "has no config.json" in failure(str(tmp_path))
    with stand_in_hub(known={"org/model"}) as url:
        hub(url)
        assert "no model nonexistent/path on the Hugging Face hub" in failure("nonexistent/path")
        assert checks.model_source_problem("org/model") is None  # with network: from_pretrained downloads as usual
    hub(closed_port_url())
    message = failure("Qwen2.5-1.5B")
    assert "cannot reach the Hugging Face hub" in message
    assert "Qwen/Qwen2.5-1.5B-Instruct is not in its cache" in message
    assert "HF_HUB_OFFLINE" in message and "tiny" in message and "local model folder" in message
    hub(None)
    message = failure("Qwen2.5-1.5B")
    assert "is not in the Hugging Face cache" in message and "HF_HUB_OFFLINE is set" in message


@pytest.mark.slow
def test_hf_hub_offline_is_honoured_and_a_cached_model_loads_while_the_hub_is_unreachable(tiny, tmp_path):
    import subprocess
    import time as time_module
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["HF_HUB_CACHE"] = str(tmp_path / "cache")
    start = time_module.time()
    done = subprocess.run([sys.executable, "retireopd.py", "--model", "Qwen2.5-1.5B", "--run-dir", str(tmp_path / "r")],
                          cwd=Path(__file__).parent, capture_output=True, text=True, timeout=120,
                          env={**env, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 1 and time_module.time() - start < 30 and not (tmp_path / "r").exists()
    assert done.stderr.strip().startswith("retireopd: --model Qwen2.5-1.5B: Qwen/Qwen2.5-1.5B-Instruct is not in "
                                          "the Hugging Face cache") and "\n" not in done.stderr.strip()
    model, tok = tiny  # a model in the hub cache, as a download leaves it
    repo = tmp_path / "cache" / "models--retireopd-test--tiny"
    model.save_pretrained(repo / "snapshots" / ("0" * 40))
    tok.save_pretrained(repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    load = ("import time, torch, checks, retireopd as R; start = time.time(); "
            "assert checks.model_source_problem('retireopd-test/tiny') is None; "
            "R.load_policy('retireopd-test/tiny', torch.device('cpu'), torch.float32); print(time.time() - start)")
    done = subprocess.run([sys.executable, "-c", load], cwd=Path(__file__).parent, capture_output=True, text=True,
                          timeout=300, env={**env, "HF_ENDPOINT": closed_port_url()})
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.split()[-1]) < 15  # from the cache at once, not after the hub's retries
    start = time_module.time()  # --show-prompts reads the cached tokenizer the same way
    done = subprocess.run([sys.executable, "retireopd.py", "--show-prompts", "--model", "retireopd-test/tiny", "--env",
                           "kitchen", "--run-dir", str(tmp_path / "prompts")], cwd=Path(__file__).parent,
                          capture_output=True, text=True, timeout=300, env={**env, "HF_ENDPOINT": closed_port_url()})
    assert done.returncode == 0, done.stderr[-2000:]
    assert time_module.time() - start < 30 and "===== teacher" in done.stdout and not (tmp_path / "prompts").exists()


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


def test_tiny_tokenizer_saves_and_reloads_identically(tiny, tmp_path):
    model, tok = tiny
    tok.save_pretrained(tmp_path)
    model.config.save_pretrained(tmp_path)
    reloaded = R.transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = R.build_user_message("alfworld", "put 2 mugs in cabinet 10", 1, [("x-large, $40.00", "go to cabinet 1")],
                                "You see a mug 1.", ["take mug 1 from cabinet 1"])
    assert R.encode_prompt(reloaded, text) == R.encode_prompt(tok, text)
    assert reloaded.eos_token_id == tok.eos_token_id and reloaded.pad_token_id == tok.pad_token_id


@pytest.mark.slow
def test_every_metric_key_is_in_the_readme_glossary(tmp_path):
    _, metrics, _ = run_cli(tmp_path, "glossary", "--env", "webshop", "--iterations", "3")
    keys = {key for m in metrics for key in m}
    glossary = (Path(__file__).parent / "docs" / "metrics.md").read_text()
    missing = sorted(k for k in keys if f"`{k}`" not in glossary)
    assert not missing, f"metrics.jsonl keys missing from docs/metrics.md: {missing}"


def test_readme_code_map_names_real_code_and_the_method_sits_above_the_banner():
    # The README's paper -> code map names each function with its section; sections 1-6 are the
    # method, which must be defined above the plumbing banner (a reader who stops there has it all).
    import ast
    import re
    source = (Path(__file__).parent / "retireopd.py").read_text()
    banner = next(n for n, line in enumerate(source.splitlines(), 1) if line.startswith("# The method ends here"))
    defined = {getattr(node, "name", None) or ast.unparse(node.targets[0]): node.lineno
               for node in ast.parse(source).body if hasattr(node, "name") or isinstance(node, ast.Assign)}
    table = (Path(__file__).parent / "README.md").read_text().split("## Paper → code map")[1].split("\n## ")[0]
    rows = re.findall(r"\| ((?:`\w+`(?:, )?)+) \((\d+)", table)
    assert len(rows) >= 20
    for names, section in rows:
        for name in re.findall(r"`(\w+)`", names):
            assert name in defined, f"the README's code map names {name}, which retireopd.py does not define"
            assert (defined[name] < banner) == (int(section) <= 6), f"{name} (section {section}) is on the wrong side"


def test_the_method_calls_multigpu_only_inside_if_ddp_blocks():
    # A one-process reader of sections 1-6 skips every torchrun step by skipping `if ddp:` blocks (and the
    # `... if ddp else ...` and `ddp and ...` expressions): no call into multigpu.py hides in a neutral line.
    import ast
    source = (Path(__file__).parent / "retireopd.py").read_text()
    banner = next(n for n, line in enumerate(source.splitlines(), 1) if line.startswith("# The method ends here"))
    tree = ast.parse(source)
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp)) and isinstance(node.test, ast.Name) and node.test.id == "ddp":
            for part in (node.body if isinstance(node, ast.If) else [node.body]):
                guarded |= {id(inner) for inner in ast.walk(part)}
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And) and getattr(node.values[0], "id", "") == "ddp":
            guarded |= {id(inner) for part in node.values[1:] for inner in ast.walk(part)}  # `ddp and ...`
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
             and node.value.id == "multigpu" and node.lineno < banner]
    assert len(calls) >= 8  # the method's torchrun steps: shares of tasks, lockstep passes, gathers, ...
    loose = [node.lineno for node in calls if id(node) not in guarded]
    assert loose == [], f"multigpu calls outside an `if ddp:` block above the banner, lines {loose}"


def test_the_bare_command_is_the_offline_demo_and_a_real_model_gets_the_papers_protocol(tmp_path):
    demo = R.parse_config({"run_dir": str(tmp_path / "demo")})
    assert (demo.model, demo.env, demo.warm_start, demo.opd_coef) == ("tiny", "kitchen", 500, 10.0)
    paper = R.parse_config({"model": "Qwen2.5-1.5B", "run_dir": str(tmp_path / "paper")})
    assert (paper.env, paper.iterations, paper.lr, paper.opd_coef, paper.warm_start) == ("alfworld", 150, 1e-6, 0.01, 0)
    assert (paper.mini_batch, paper.opd_mini_batch, paper.window, paper.rho) == (256, 128, 5, 0.9)
    assert not (tmp_path / "demo").exists() and not (tmp_path / "paper").exists()  # parsing writes nothing


@pytest.mark.parametrize("env", ["kitchen", "webshop", "alfworld"])
def test_show_prompts_prints_the_students_and_the_teachers_first_prompt_and_writes_nothing(tmp_path, capsys, env):
    run_dir = tmp_path / "run"
    assert R.main(["--show-prompts", "--env", env, "--run-dir", str(run_dir)]) is None
    out = capsys.readouterr().out
    student, teacher = out.split("===== teacher")[0], "===== teacher" + out.split("===== teacher")[1]
    assert student.startswith("===== student (s_t)") and "<|im_start|>user" in student and "<|im_start|>assistant" in student
    assert "Skills for this task" not in student and "Skills for this task" in teacher
    # the teacher's prompt is the student's with the skill block in front of the same content
    student_text = student.split("=====\n", 1)[1].split("<|im_start|>user\n", 1)[1]
    assert teacher.split("=====\n", 1)[1].rstrip().endswith(student_text.rstrip())
    assert not run_dir.exists()


def test_show_prompts_says_a_data_problem_in_one_line(tmp_path):
    with pytest.raises(SystemExit) as stop:
        R.main(["--show-prompts", "--env", "webshop", "--webshop-data", str(tmp_path / "none"),
                "--run-dir", str(tmp_path / "run")])
    assert str(stop.value).startswith("retireopd: WebShop data folder") and "\n" not in str(stop.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_plot_is_written_or_explained_without_matplotlib(tmp_path, monkeypatch, capsys):
    run_a, _, _ = run_cli(tmp_path, "a", "--env", "webshop", "--iterations", "3")
    run_b, _, _ = run_cli(tmp_path, "b", "--env", "webshop", "--algo", "grpo+opd")
    if importlib.util.find_spec("matplotlib") is not None:
        assert (run_a / "plot.png").stat().st_size > 10_000  # written at the end of the run
        out = R.main(["--compare", str(run_a), str(run_b)])
        assert out == run_a / "compare.png" and out.stat().st_size > 10_000
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert tools.plot_runs([run_a]) is None
    assert "pip install matplotlib" in capsys.readouterr().out


@pytest.mark.slow
def test_compare_is_titled_with_every_environment_and_lines_up_phase_two(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure
    run_a, _, _ = run_cli(tmp_path, "a", "--env", "webshop")  # phase 1 (3 iterations), then phase 2
    run_b, _, _ = run_cli(tmp_path, "b", "--env", "kitchen", "--algo", "grpo")  # phase 2 only
    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *args, **kwargs: figures.append(fig))
    tools.plot_runs([run_a, run_b])
    (figure,) = figures
    assert figure._suptitle.get_text() == "2 runs on kitchen and webshop"
    # the validation dots of each student start where phase 2 starts: after the longest phase 1 (the GRPO
    # run's validation before training one step before it)
    first_x = {line.get_label(): min(line.get_xdata()) for line in figure.axes[0].get_lines()
               if line.get_label().endswith("(phase 2)")}
    assert first_x == {"a, no skills (phase 2)": 3, "b, no skills (phase 2)": 2}


@pytest.mark.slow
def test_benchmark_runs_and_writes_its_report(tmp_path, capsys):
    R.main(["--model", "tiny", "--benchmark", "--env", "webshop", "--batch-tasks", "1", "--group-size", "2",
            "--max-response-tokens", "4", "--run-dir", str(tmp_path)])
    report = json.loads((tmp_path / "benchmark.json").read_text())
    # the tiny model's log-prob peaks are noise on a CPU (they were once printed as a ratio of -183105)
    assert report["logprob_memory_ratio"] is None and "too small to measure" in capsys.readouterr().out
    assert report["sequences"] == 2 and report["new_tokens"] == 4
    assert set(report["tokens_per_s"]) == {f"{who}_{stage}" for who in ("ours", "plain")
                                           for stage in ("generate", "update", "logprob")}
    # measured figures, not asserted targets; each ratio is ours / plain in tokens per second
    # (log-probs: both score the same tokens, so also plain time / ours)
    speed = report["tokens_per_s"]
    for stage, key in (("generate", "rollout_speed_ratio"), ("update", "update_speed_ratio"),
                       ("logprob", "logprob_speed_ratio")):
        assert report[key] == pytest.approx(speed[f"ours_{stage}"] / speed[f"plain_{stage}"], rel=1e-2, abs=1e-3), key


def _meta_model(alias):
    """The real architecture on the meta device: parameter counts and shapes, no memory."""
    shape = built_in_models.QWEN25_SHAPES[alias]
    with torch.device("meta"):
        return R.transformers.Qwen2ForCausalLM(R.transformers.Qwen2Config(**shape))


def test_memory_estimate_counts_the_prefill_and_the_optimizer_temporaries(tmp_path):
    model = _meta_model("Qwen2.5-1.5B")  # hidden 1536, intermediate 8960, 28 layers, 2 KV heads of 128
    cfg = R.parse_config({"model": "random:Qwen2.5-1.5B", "env": "webshop", "run_dir": str(tmp_path)})
    assert (cfg.batch_tasks * cfg.group_size, cfg.prefill_batch, cfg.max_prompt_tokens) == (128, 16, 4096)
    cuda = tools.estimate_memory_gb(model, cfg, n_frozen=1, skill_tokens=1024, device=torch.device("cuda"))
    # prefill: 16 rows x 5120 tokens x (12*1536 + 6*8960 + 5120 mask) B = 6,333,399,040 B = 5.90 GiB
    assert cuda["prefill"] == 5.9
    # all 128 rows at once: 8x the rows, 47.19 GiB
    one_shot = tools.estimate_memory_gb(model, R.dataclasses.replace(cfg, prefill_batch=0), 1, 1024, torch.device("cuda"))
    assert one_shot["prefill"] == 47.19
    # fused AdamW on CUDA: no temporaries; the CPU loop: sqrt(v) and its quotient for the
    # 151936 x 1536 embedding, 2 x 4 x 233,373,696 B = 1.74 GiB
    cpu = tools.estimate_memory_gb(model, cfg, 1, 1024, torch.device("cpu"))
    assert (cuda["optimizer_temporaries"], cpu["optimizer_temporaries"]) == (0, 1.74)
    # the stages never overlap: resident + the largest (here the rollout)
    rollout = cuda["kv_cache"] + cuda["prefill"] + cuda["sampling"]
    assert cuda["peak_stage"] == "rollout" and rollout > cuda["activations"] + cuda["logits"]
    assert cuda["total"] == round(cuda["policy_and_adam"] + cuda["frozen_models"] + rollout, 2)
    run = R.Run(R.dataclasses.replace(cfg, run_dir=str(tmp_path)))
    tools.print_memory_estimate(model, cfg, run, "phase 1", R.FrozenModels(reference=model), skill_tokens=1024)
    (event,) = R.read_jsonl(tmp_path / "events.jsonl")
    assert event["event"] == "memory_estimate" and event["gib"] == cpu
    text = tools.format_memory_estimate(cpu)
    assert f"{cpu['total']} GiB" in text and "prefill 5.9" in text and "optimizer_temporaries 1.74" in text


def test_adamw_is_fused_on_cuda_only(tiny):
    model, _ = tiny
    optimizer = R.build_adamw(model, small_cfg(lr=3e-4, weight_decay=0.5))
    group = optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"]) == (3e-4, 0.5) and not group["fused"]
    if torch.cuda.is_available():
        gpu = copy.deepcopy(model).cuda()
        assert R.build_adamw(gpu, small_cfg()).param_groups[0]["fused"] is True


# ==================================================================================================
# 12. The wiring: what reaches the update, which prompt each model sees, what is freed and when
# ==================================================================================================
# Each test here was written to fail on a specific plausible bug (a mutation of retireopd.py)
# that the tests above let through.


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
    # (mean <= max holds for any tensor; the values are checked by hand in the test below)
    assert "sample_logp_gap_mean" in metrics[0] and metrics[0]["sample_logp_gap_max"] < 1e-4


def test_pipeline_grpo_groups_are_tasks_not_episodes(tiny, tmp_path, monkeypatch):
    seen = []
    real = R.grpo_advantages
    monkeypatch.setattr(R, "grpo_advantages", lambda s, g, *a, **k: (seen.append(g.clone()), real(s, g, *a, **k))[1])
    _student_phase(tiny, tmp_path, None, batch_tasks=2)
    assert len(set(seen[0].tolist())) == 2   # B = 2 tasks -> 2 groups of G = 2 episodes each


def test_generate_left_pads_keeps_eos_flags_cut_and_records_each_tokens_logprob(tiny, monkeypatch):
    model, tok = tiny
    eos, pad = R.eos_token_ids(model)[0], tok.pad_token_id
    new_tokens = torch.tensor([[11, 12, eos, pad], [13, 14, 15, 16]])

    undone_steps = [0]

    def fake_generate(input_ids, attention_mask, generation_config, logits_processor, cache):
        assert input_ids[1].tolist() == [pad, 8, 9] and attention_mask[1].tolist() == [0, 1, 1]
        assert cache is None  # two prompts, prefill_batch 0: generate prefills them itself
        for k in range(4):  # step k: the sampled token's logit is k, the other 19 of 20 are 0
            scores = torch.zeros(2, 20).scatter(1, new_tokens[:, k, None], float(k))
            logits_processor(torch.cat([input_ids, new_tokens[:, :k]], 1), scores)
        if undone_steps[0]:  # a deferred stop check runs one more step, then drops its token
            logits_processor(torch.cat([input_ids, new_tokens], 1), torch.zeros(2, 20))
        return torch.cat([input_ids, new_tokens], 1)

    monkeypatch.setattr(model, "generate", fake_generate)
    # log p of the step-k token = k - log(e^k + 19): 0 - log 20, 1 - log(e + 19), ...
    expected = torch.tensor([k - math.log(math.exp(k) + 19) for k in range(4)])
    for undone_steps[0] in (0, 1):
        out = R.generate(model, tok, [[5, 6, 7], [8, 9]], 4, 1.0)
        assert [(r.ids, r.hit_cap) for r in out] == [([11, 12, eos], False), ([13, 14, 15, 16], True)]
        assert torch.allclose(out[0].logp, expected[:3]) and torch.allclose(out[1].logp, expected)


@pytest.mark.parametrize("numerics", ["fp32", "bf16-autocast"])
def test_old_logprobs_match_sampling_logits_for_mixed_prompt_lengths(tiny, monkeypatch, numerics):
    model, tok = tiny
    if numerics == "bf16-autocast":  # the GPU path, with CPU autocast standing in for CUDA's
        monkeypatch.setattr(R, "autocast", lambda device: torch.autocast("cpu", dtype=torch.bfloat16))
    prompts = [R.encode_prompt(tok, "short"), R.encode_prompt(tok, "a much longer prompt " * 5)]
    captured, original = {}, model.generate

    def spy(**kwargs):
        out = original(**kwargs, return_dict_in_generate=True, output_logits=True)
        captured["logits"] = out.logits
        return out.sequences

    monkeypatch.setattr(model, "generate", spy)
    head_dtypes = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, o: head_dtypes.append(o.dtype))
    torch.manual_seed(0)
    try:
        responses = R.generate(model, tok, prompts, 5, 1.0)
    finally:
        hook.remove()
    assert set(head_dtypes) == {torch.float32}  # sampled from fp32 logits, as they are scored
    # bf16 autocast: the cached decode and the full scoring forward round differently in the body
    atol = 1e-4 if numerics == "fp32" else 5e-3
    for b, (ids, *_) in enumerate(responses):
        expected = torch.stack([torch.log_softmax(step[b], -1)[t] for step, t in zip(captured["logits"], ids)])
        assert torch.allclose(R.sequence_logprobs(model, [prompts[b]], [ids], small_cfg()), expected, atol=atol)


def test_generate_uses_the_given_temperature(tiny):
    model, tok = tiny
    torch.manual_seed(0)
    cold = R.generate(model, tok, [R.encode_prompt(tok, "anything")] * 64, 1, 0.01)
    assert len({ids[0] for ids, *_ in cold}) <= 2


def test_prefill_in_sub_batches_samples_the_same_tokens_and_logprobs(tiny):
    """prefill_batch < B*G: prompt[:-1] prefilled a few rows at a time into one joined cache, then
    generate runs only the last prompt column. Same seed -> the same tokens exactly (measured on
    CPU fp32), and the recorded log-probs to rounding (measured: <= 5e-7)."""
    model, tok = tiny
    prompts = [R.encode_prompt(tok, "go " * k + "north") for k in (1, 9, 3, 17, 5)]  # left padding
    forwards = []  # (rows, columns) of every forward through the transformer body
    hook = model.model.register_forward_pre_hook(
        lambda module, args, kwargs: forwards.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        runs = {}
        for prefill_batch in (0, 2, 5):  # 0 and 5 (= all rows) are generate's own one-shot prefill
            forwards.clear()
            torch.manual_seed(7)
            runs[prefill_batch] = (R.generate(model, tok, prompts, 10, 1.0, prefill_batch=prefill_batch),
                                   list(forwards))
    finally:
        hook.remove()
    width = max(map(len, prompts))
    (one_shot, one_shot_forwards), (split, split_forwards) = runs[0], runs[2]
    assert one_shot_forwards[0] == (5, width) and runs[5][1][0] == (5, width)
    assert split_forwards[:4] == [(2, width - 1), (2, width - 1), (1, width - 1), (5, 1)]
    assert all(shape == (5, 1) for shape in split_forwards[3:])
    assert [r.ids for r in split] == [r.ids for r in one_shot] == [r.ids for r in runs[5][0]]
    assert sum(len(r.ids) for r in one_shot) > len(prompts)  # more than one token per answer compared
    for a, b in zip(split, one_shot):
        assert torch.allclose(a.logp, b.logp, atol=2e-6, rtol=0)


def test_recorded_logprobs_are_the_scoring_passes_at_temperature_one(tiny):
    """The log-prob each token had when it was sampled equals the old-policy log-prob of the scoring
    pass (CPU fp32: gap < 1e-4; measured ~5e-7), with a split prefill too. At another temperature
    the recorder still sees the temperature-1 scores: in transformers 5.24 the processors given to
    generate run before the temperature warper."""
    model, tok = tiny
    prompts = [R.encode_prompt(tok, "short"), R.encode_prompt(tok, "a much longer prompt " * 5)] * 2
    cfg = small_cfg()
    for temperature, prefill_batch in ((1.0, 0), (1.0, 1), (0.5, 0)):
        torch.manual_seed(3)
        responses = R.generate(model, tok, prompts, 8, temperature, prefill_batch=prefill_batch)
        samples = [R.TurnSample(0, b, p, r.ids, False, sample_logp=r.logp) for b, (p, r) in enumerate(zip(prompts, responses))]
        gap = R.sample_logp_gap(samples, R.response_logprobs(model, samples, cfg))
        assert sum(len(r.ids) for r in responses) > len(prompts)  # several tokens per answer compared
        assert gap["sample_logp_gap_max"] < 1e-4
    # hand-made: gaps 0.5 and 0.25 on one sample's two tokens, 0 on the other's
    made = [R.TurnSample(0, 0, [1], [2, 3], False, sample_logp=torch.tensor([-1.0, -2.0])),
            R.TurnSample(0, 1, [1], [4], False, sample_logp=torch.tensor([-3.0]))]
    assert R.sample_logp_gap(made, [torch.tensor([-1.5, -1.75]), torch.tensor([-3.0])]) == {
        "sample_logp_gap_mean": 0.25, "sample_logp_gap_max": 0.5}
    assert R.sample_logp_gap([R.TurnSample(0, 0, [1], [2], False)], [torch.tensor([-1.0])]) == {}


def _scripted(tok, answers):
    turn = [0]

    def generate(model, tokenizer, prompts, n, temperature, **_):
        text, cut = answers[min(turn[0], len(answers) - 1)]
        turn[0] += 1
        return [R.Sampled(tok(text)["input_ids"], cut)] * len(prompts)
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


def test_truncate_logs_drops_every_log_line_after_the_checkpoint(tmp_path):
    run = R.Run(small_cfg(run_dir=str(tmp_path)))
    for phase in ("teacher", "student"):
        for k in range(3):
            run.log("metrics.jsonl", {"phase": phase, "iteration": k})
            run.log("eval.jsonl", {"phase": phase, "iteration": k})
    for k in (0, 2):
        run.log("events.jsonl", {"event": "retirement", "decided_after_iteration": k})
    run.truncate_logs("student", 1)
    kept = [("teacher", 0), ("teacher", 1), ("teacher", 2), ("student", 0), ("student", 1)]
    for name in ("metrics.jsonl", "eval.jsonl"):
        assert [(r["phase"], r["iteration"]) for r in R.read_jsonl(tmp_path / name)] == kept, name
    assert [e["decided_after_iteration"] for e in R.read_jsonl(tmp_path / "events.jsonl")] == [0]


@pytest.mark.slow
def test_evaluation_does_not_change_the_training_trajectory(tmp_path):
    _, with_eval, _ = run_cli(tmp_path, "a", "--env", "webshop", "--algo", "grpo", "--window", "3", "--eval-every", "1")
    _, without, _ = run_cli(tmp_path, "b", "--env", "webshop", "--algo", "grpo", "--window", "3", "--eval-every", "2")
    assert [("val_success" in m) for m in without] == [False, True, True]  # every 2nd, and the last
    strip = lambda ms: [{k: v for k, v in m.items() if k != "val_success"} for m in comparable(ms)]  # noqa: E731
    assert strip(with_eval) == strip(without)


def _one_student_update(tiny, tmp_path, monkeypatch, **phase):
    """What reaches ppo_update in one phase-2 iteration whose first episode wins."""
    model, tok = tiny
    win = tok("<think>x</think><action>open box 1</action><|im_end|>")["input_ids"]
    bad = tok("garbage<|im_end|>")["input_ids"]
    monkeypatch.setattr(R, "generate", lambda m, t, prompts, n, temp, **_:
                        [R.Sampled(win, False)] + [R.Sampled(bad, False)] * (len(prompts) - 1))
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


@pytest.mark.slow
def test_zero_kl_coef_never_loads_the_reference_and_phase_two_with_a_teacher_has_none(tmp_path, monkeypatch):
    loads, real = [], R.load_policy
    monkeypatch.setattr(R, "load_policy", lambda name, *a, **k: (loads.append(Path(name).name), real(name, *a, **k))[1])
    run_cli(tmp_path, "nokl", "--env", "webshop", "--algo", "grpo", "--kl-coef", "0")
    assert loads == ["tiny"]          # the student only
    loads.clear()
    run_dir, metrics, _ = run_cli(tmp_path, "retire", "--env", "webshop")
    # phase 1: the policy and its KL reference; phase 2: the student and the teacher, no reference
    assert loads == ["tiny", "tiny", "tiny", "teacher"]
    assert all("kl_ref" in m for m in metrics if m["phase"] == "teacher")
    assert all("kl_ref" not in m and "t_reference" not in m for m in metrics if m["phase"] == "student")


@pytest.mark.slow
def test_skills_in_phase_one_prompts_and_evals_and_S_T_over_last_window(tmp_path, monkeypatch):
    # every rollout: (phase, inside an evaluation?, skills_in_prompt, with_teacher_prompts)
    seen, now = [], {"phase": None, "evaluating": False}
    real_rollout, real_evaluate, real_phase = R.rollout, R.evaluate, R.train_phase

    def rollout(*args, **kwargs):
        seen.append((now["phase"], now["evaluating"], kwargs["skills_in_prompt"], kwargs["with_teacher_prompts"]))
        return real_rollout(*args, **kwargs)

    def evaluate(*args, **kwargs):
        now["evaluating"] = True
        try:
            return real_evaluate(*args, **kwargs)
        finally:
            now["evaluating"] = False

    def train_phase(phase, *args, **kwargs):
        now["phase"] = phase
        validations = real_phase(phase, *args, **kwargs)
        # the teacher's validations as if it had learnt: S_T = mean of the last two = 0.75
        # (all three: 0.583; the last: 1.0; --teacher-success: 0.5)
        return [0.25, 0.5, 1.0] if phase == "teacher" else validations

    monkeypatch.setattr(R, "rollout", rollout)
    monkeypatch.setattr(R, "evaluate", evaluate)
    monkeypatch.setattr(R, "train_phase", train_phase)
    trained, real_update = [], R.ppo_update
    monkeypatch.setattr(R, "ppo_update", lambda model, opt, samples, *a, **k: (
        trained.append("Skills for this task" in built_in_models.build_tiny_tokenizer().decode(samples[0].prompt_ids)),
        real_update(model, opt, samples, *a, **k))[1])
    run_dir, _, _ = run_cli(tmp_path, "skills", "--env", "webshop", "--window", "2")
    assert trained == [True] * 3 + [False] * 3          # phase 1 trains on s_t^T, phase 2 on s_t
    # Skill-GRPO: the teacher plays with its skills; the student plays without them, and its
    # rollouts also build s_t^T for the teacher (active throughout: competence 0, never retired)
    assert [(phase, p, t) for phase, evaluating, p, t in seen if not evaluating] == (
        [("teacher", True, False)] * 3 + [("student", False, True)] * 3)
    evals = R.read_jsonl(run_dir / "eval.jsonl")
    # phase 1 validates before training and at every validation with skills (S_T reads these) and
    # without, as the authors do; its report is with skills; the student never sees them
    teacher_evals = [(e["iteration"], e["panel"], e["skills"]) for e in evals if e["phase"] == "teacher"]
    assert teacher_evals == [(k, "validation", skills) for k in (-1, 0, 1, 2) for skills in (True, False)] + [
        (2, "report", True)]
    assert {e["skills"] for e in evals if e["phase"] == "student"} == {False}
    assert json.loads((run_dir / "teacher" / "retireopd.json").read_text())["teacher_success"] == 0.75


def test_lm_head_sees_at_most_chunk_rows_and_only_response_positions(tiny):
    head, rows = torch.nn.Linear(16, 1000, bias=False), []
    head.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[0]))
    R.token_logprobs(torch.randn(37, 16), torch.randint(0, 1000, (37,)), head, chunk=5)
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
# 13. The offline demo: the kitchen, the warm start, and a run that learns
# ==================================================================================================


def test_kitchen_rules_one_step_at_a_time():
    dorl = 1 * 1000 + 3  # sorted dishes: brask, dorl, ...; dorl is salted, then chilled
    episode = R.KitchenEnv(dorl)
    observation, info = episode.reset()
    assert (info["task"], info["task_type"]) == ("cook a dorl", "dorl")
    assert sorted(info["admissible"]) == sorted(f"{i} the dorl" for i in R.KITCHEN_INGREDIENTS)
    assert R.KitchenEnv(dorl).reset()[1]["admissible"] == info["admissible"]  # one order per task
    assert any(R.KitchenEnv(1000 + v).reset()[1]["admissible"] != info["admissible"] for v in range(8))
    assert episode.step("eat the dorl")[:3] == ("Nothing happens.", 0.0, False)  # inadmissible: nothing
    observation, reward, done, info = episode.step("salt the dorl")
    assert (reward, done, observation) == (0.0, False, "The dorl is seasoned with salt.")
    assert sorted(info["admissible"]) == sorted(f"{m} the dorl" for m in R.KITCHEN_METHODS)
    observation, reward, done, info = episode.step("chill the dorl")
    assert (reward, done, info["won"], observation) == (1.0, True, True, "The dorl is ready!")
    assert episode.step("chill the dorl")[:3] == ("Nothing happens.", 0.0, True)  # served: nothing more
    for wrong in (("sugar the dorl", "chill the dorl"), ("salt the dorl", "fry the dorl")):
        ruined = R.KitchenEnv(dorl)
        ruined.reset()
        observation, reward, done, info = ruined.step(wrong[0])  # a wrong seasoning shows only when served
        assert (reward, done, observation) == (0.0, False, f"The dorl is seasoned with {wrong[0].split()[0]}.")
        observation, reward, done, info = ruined.step(wrong[1])
        assert (reward, done, info["won"], observation) == (0.0, True, False, "The dorl is ruined.")


def test_kitchen_notes_name_the_seasoning_only_and_the_student_prompt_says_nothing():
    assert len(set(R.KITCHEN_RECIPES.values())) == len(R.KITCHEN_RECIPES)  # ignoring the dish cannot win all
    for k, (dish, (ingredient, method)) in enumerate(sorted(R.KITCHEN_RECIPES.items())):
        skills = R.skill_text("kitchen", dish)
        assert f"{dish}: {ingredient.capitalize()} it" in skills  # the seasoning, as the recipe says
        assert not any(m in skills.lower() for m in R.KITCHEN_METHODS)  # never the way to cook it
        observation, info = R.KitchenEnv(k * 1000).reset()
        student = R.build_user_message("kitchen", info["task"], 0, [], observation, info["admissible"])
        assert ingredient.capitalize() not in student and method.capitalize() not in student


def test_kitchen_panels_cover_every_dish_and_are_not_trained_on():
    suite = R.TaskSuite(R.parse_config({"model": "tiny", "run_dir": "/tmp/unused"}))
    validation, report = R.KITCHEN_PANEL
    assert Counter(suite.task_type(t) for t in suite.validation_panel) == Counter({d: validation for d in R.KITCHEN_RECIPES})
    assert Counter(suite.task_type(t) for t in suite.report_panel) == Counter({d: report for d in R.KITCHEN_RECIPES})
    assert len(suite.validation_panel) >= 48  # one episode moves a validation by at most 0.021
    assert not set(suite.train) & set(suite.report_panel) and set(suite.validation_panel) <= set(suite.report_panel)


def test_warm_start_teaches_reading_and_other_dishes_never_the_demo_recipes():
    rng, hits = random.Random(0), Counter()
    known = set(built_in_models.WARM_START_RECIPES)
    assert not known & set(R.KITCHEN_RECIPES) and not known & set(built_in_models.WARM_START_UNKNOWN)
    for _ in range(4000):
        kind = rng.choice(("short", "skills", "known", "unknown"))
        message, answer = built_in_models.warm_start_example(rng, kind)
        action = R.action_from_answer(answer)
        if kind in ("short", "skills"):  # reading: the answer is what the recipe in the prompt says
            named = re.search(r"Recipe for a \w+: (\w+) it", message).group(1).lower()
            assert action.split()[0] == named
        if kind == "known":
            assert action.split()[0] in {*built_in_models.WARM_START_RECIPES[action.split()[-1]]}
        dish = action.split()[-1]
        if dish in R.KITCHEN_RECIPES:  # a demo dish: its true step comes up at chance
            assert kind != "known"
            hits[R.KITCHEN_RECIPES[dish][0] == action.split()[0] or R.KITCHEN_RECIPES[dish][1] == action.split()[0]] += 1
    assert 0.14 < hits[True] / sum(hits.values()) < 0.19  # 1 in 6, a seasoning or a way to cook
    known = list(built_in_models.WARM_START_RECIPES.values())  # the known dishes favour no seasoning and no way to cook
    assert Counter(i for i, _ in known) == Counter({i: 2 for i in R.KITCHEN_INGREDIENTS})
    assert Counter(m for _, m in known) == Counter({m: 2 for m in R.KITCHEN_METHODS})


def demo_episodes(model, tok, suite, tasks, cfg):
    _, episodes, _ = R.rollout(model, tok, suite, tasks, cfg, group_size=1, skills_in_prompt=False,
                               with_teacher_prompts=False, temperature=cfg.eval_temperature)
    return sum(e.won for e in episodes) / len(episodes)


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    """The demo's warm-started base model (RUN_DIR/tiny_base of `--model tiny`), built once."""
    cfg = R.parse_config({"model": "tiny", "run_dir": str(tmp_path_factory.mktemp("base") / "run")})
    return Path(built_in_models.warm_started_tiny_base(R.Run(cfg), torch.device("cpu"), cfg.warm_start))


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, tiny_base):
    """The README's demo, `python retireopd.py --model tiny` (seed 0), run once for the tests below,
    in a folder that already holds its base model (the warm start is deterministic: the same one)."""
    run_dir = tmp_path_factory.mktemp("demo") / "run"
    shutil.copytree(tiny_base, run_dir / "tiny_base")
    R.main(["--model", "tiny", "--run-dir", str(run_dir)])
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("sign", [1, -1], ids=["grpo", "grpo-with-the-advantage-sign-flipped"])
def test_grpo_learns_the_kitchen_and_fails_with_the_advantage_sign_flipped(tiny_base, tmp_path, monkeypatch, sign):
    # cleanRL's habit: the algorithm must learn. From the warm-started base, GRPO alone (no teacher)
    # on two dishes: validation success rises by a clear margin in 16 iterations. The same run with
    # the sign of every advantage flipped must not learn (the check that the test can fail).
    real = R.grpo_advantages
    monkeypatch.setattr(R, "grpo_advantages", lambda *a, **k: sign * real(*a, **k))
    cfg = R.parse_config({"model": "tiny", "run_dir": str(tmp_path), "iterations": 16, "eval_every": 2,
                          "save_every": 0})
    model, tok = R.load_policy(str(tiny_base), torch.device("cpu"), torch.float32)
    suite = R.TaskSuite(cfg)
    suite.train = [t for t in suite.train if t // 1000 in (0, 1)]  # brask and dorl
    suite.validation_panel = [d * 1000 + 500 + v for d in (0, 1) for v in range(8)]
    before = demo_episodes(model, tok, suite, suite.validation_panel, cfg)
    R.train_phase("student", model, tok, suite, cfg, R.Run(cfg), skills_in_prompt=False,
                  frozen=R.FrozenModels())
    after = demo_episodes(model, tok, suite, suite.validation_panel, cfg)
    print(f"GRPO on two dishes, advantage sign {sign:+d}: validation {before} -> {after}")
    if sign == 1:  # measured: MEASURED_GRPO
        assert after >= before + 0.25, (before, after)
    else:
        assert after <= before, (before, after)


@pytest.mark.slow
def test_demo_tells_the_story(demo_run):
    # what the kitchen's design makes hold on every seed (docs/labs.md and the README have the
    # counts over seeds): skills alone are not a teacher, phase 1 makes one, the student starts far
    # below it, the teacher is retired by the authors' rule, and the retired student ends above S_T
    evals = R.read_jsonl(demo_run / "eval.jsonl")
    before = {e["skills"]: e["overall"] for e in evals if e.get("before_training") and e["phase"] == "teacher"}
    teacher_val = [e["overall"] for e in evals if e["phase"] == "teacher" and e["panel"] == "validation"
                   and e["skills"] and not e.get("before_training")]
    student_val = [e["overall"] for e in evals if e["phase"] == "student" and e["panel"] == "validation"]
    report = {(e["phase"], e["skills"]): e for e in evals if e["panel"] == "report"}
    s_t = json.loads((demo_run / "teacher" / "retireopd.json").read_text())["teacher_success"]
    (retirement,) = [e for e in R.read_jsonl(demo_run / "events.jsonl") if e["event"] == "retirement"]
    assert before[True] <= 0.3 and before[False] <= 0.1     # 1. the base model: notes help a little
    assert s_t == sum(teacher_val[-2:]) / 2                  # 2. S_T, recorded
    assert s_t >= before[True] + 0.15                        #    phase 1 makes the teacher
    assert s_t <= 5 / 6                                      #    which ends imperfect (it is short)
    assert student_val[0] <= s_t / 2                         # 3. the student starts far below it
    assert retirement["rule"] == "adaptive" and retirement["criterion_valid"]  # 4. by the authors' rule
    assert retirement["progress"] <= 0 and retirement["competence"] >= 0.9 - R.ROUNDING
    metrics = R.read_jsonl(demo_run / "metrics.jsonl")
    after = [m for m in metrics if m["phase"] == "student" and m["iteration"] >= retirement["retired_at"]]
    assert after and all(not m["teacher_active"] and m["opd_coef"] == 0 for m in after)
    assert report[("student", False)]["overall"] > s_t      # 5. the retired student passes its teacher
    assert report[("student", False)]["overall"] > report[("teacher", True)]["overall"]


@pytest.mark.slow
def test_demo_retirement_is_the_rule_applied_to_the_logged_numbers(demo_run):
    # re-derive the decision from metrics.jsonl alone: blocks of W gaps, judged at validations
    cfg = json.loads((demo_run / "config.json").read_text())
    s_t = json.loads((demo_run / "teacher" / "retireopd.json").read_text())["teacher_success"]
    window, blocks, pending, judged, previous, decided = cfg["window"], [], [], 0, None, None
    for m in (m for m in R.read_jsonl(demo_run / "metrics.jsonl") if m["phase"] == "student" and "gap" in m):
        pending.append(m["gap"])
        if len(pending) == window:
            blocks.append(sum(pending) / window)
            pending = []
        if "val_success" in m and judged < len(blocks):
            if previous is not None:
                progress = (previous[0] - blocks[judged]) / previous[0]
                competence = (m["val_success"] + previous[1]) / (2 * s_t)
                assert m["progress"] == pytest.approx(progress) and m["competence"] == pytest.approx(competence)
                if decided is None and progress <= cfg["alignment_threshold"] and competence >= cfg["rho"] - 1e-9:
                    decided = m["iteration"]
            previous, judged = (blocks[judged], m["val_success"]), judged + 1
    (retirement,) = [e for e in R.read_jsonl(demo_run / "events.jsonl") if e["event"] == "retirement"]
    assert decided is not None and retirement["decided_after_iteration"] == decided
    assert retirement["retired_at"] == decided + 1


def test_run_summary_reads_S_T_the_retirement_and_the_report_panel(tmp_path):
    def write(name, records):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    write("events.jsonl", [{"event": "start"}, {"event": "teacher_ready", "teacher_success": 0.5},
                           {"event": "retirement", "rule": "adaptive", "retired_at": 11}, {"event": "done"}])
    write("eval.jsonl", [{"phase": "teacher", "panel": "validation", "skills": True, "overall": 0.1},
                         {"phase": "teacher", "panel": "report", "skills": True, "overall": 0.625},
                         {"phase": "student", "panel": "report", "skills": False, "overall": 0.75}])
    for phase, stored in (("teacher", 0.5), ("student", 0.6)):  # phase 2 ran with --teacher-success 0.6
        (tmp_path / phase).mkdir()
        (tmp_path / phase / "retireopd.json").write_text(json.dumps({"teacher_success": stored}))
    assert tools.run_summary(tmp_path) == ("S_T 0.600; teacher retired from student iteration 11 (adaptive rule); "
                                       "report panel: teacher with skills 0.62, student 0.75")
    write("events.jsonl", [{"event": "teacher_ready", "teacher_success": 0.5}])
    assert "teacher never retired" in tools.run_summary(tmp_path)


@pytest.mark.slow
def test_a_resume_into_phase_two_holds_no_trainer_state_of_phase_one(tmp_path, monkeypatch):
    # Interrupted after the teacher is saved, before the student's first checkpoint (as after an
    # S_T = 0 stop): the resume starts from phase 1's last checkpoint, whose trainer state carries
    # AdamW's moments (12 GB at 1.5B). Phase 2 must not keep them alive.
    class Interrupted(Exception):
        pass

    def interrupted(*args, **kwargs):
        raise Interrupted

    real = R.train_student
    monkeypatch.setattr(R, "train_student", interrupted)
    with pytest.raises(Interrupted):
        run_cli(tmp_path, "run", "--env", "webshop", "--iterations", "2")
    held = []

    real_phase = R.train_phase

    def counting(phase, *args, **kwargs):
        gc.collect()
        held.extend(o for o in gc.get_objects() if type(o) is dict and {"optimizer", "python_rng"} <= set(o))
        return real_phase(phase, *args, **kwargs)

    monkeypatch.setattr(R, "train_student", real)
    monkeypatch.setattr(R, "train_phase", counting)
    R.main(["--resume", str(tmp_path / "run")])
    assert held == [] and (tmp_path / "run" / "student" / "retireopd.json").is_file()


# ==================================================================================================
# 14. Several processes: torchrun with 2 processes, gloo on CPU, FSDP2-sharded tiny models
# ==================================================================================================

SHARDED_UPDATE = '''
"""One ppo_update (GRPO + OPD) of the tiny model on a fixed global batch of 7 turn-samples: in one
process (python), or sharded over the processes of torchrun, each holding its part of the batch."""
import random, sys
import torch
sys.path.insert(0, sys.argv[2])
import multigpu
import retireopd as R

torch.set_num_threads(1)
if multigpu.world_size() > 1:
    torch.distributed.init_process_group("gloo")
cfg = R.Config(model="tiny", env="webshop", token_budget=48, entropy_coef=0.001, kl_coef=0.0, ppo_epochs=2, lr=1e-3)
device = torch.device("cpu")
policy, _ = R.load_policy("tiny", device, torch.float32, seed=0)
teacher, _ = R.load_policy("tiny", device, torch.float32, seed=1)
teacher.requires_grad_(False)
rng = random.Random(7)  # the global batch: prompts and responses of different lengths
batch = [R.TurnSample(group=g, episode=g, prompt_ids=[rng.randrange(1000) for _ in range(rng.randrange(3, 20))],
                      response_ids=[rng.randrange(1000) for _ in range(rng.randrange(1, 9))], malformed=False)
         for g in range(7)]
for sample in batch:
    sample.teacher_prompt_ids = [5, 6] + sample.prompt_ids
advantages = [torch.full((len(s.response_ids),), a) for s, a in zip(batch, (1.0, -0.5, 0.3, -1.2, 0.8, 0.1, -0.4))]
mine = slice(0, 5) if multigpu.rank() == 0 else slice(5, 7)  # rank 0 holds 5 samples, rank 1 two
if multigpu.world_size() > 1:
    multigpu.shard(policy, device), multigpu.shard(teacher, device)
    batch, advantages = batch[mine], advantages[mine]
old_logp = R.response_logprobs(policy, batch, cfg)
teacher_logp = R.response_logprobs(teacher, batch, cfg, teacher_prompt=True)
optimizer = R.build_adamw(policy, cfg)
stats = R.ppo_update(policy, optimizer, batch, old_logp, advantages, cfg, mini_batch=3, teacher_logp=teacher_logp,
                     opd_coef=0.1, rng=random.Random(0))
weights = multigpu.full_state_dict(policy) or {k: v.detach() for k, v in policy.named_parameters()}
if multigpu.main_process():
    torch.save({"weights": weights, "stats": stats}, sys.argv[1])
multigpu.stop_processes()
'''


def torchrun(*args, processes=2, timeout=600, **kwargs):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", *args]
    return subprocess.run(command, cwd=Path(__file__).parent, capture_output=True, text=True, timeout=timeout,
                          **kwargs)


@pytest.mark.slow
def test_the_sharded_update_is_the_one_process_update(tmp_path):
    script = tmp_path / "sharded_update.py"
    script.write_text(SHARDED_UPDATE)
    here = str(Path(__file__).parent)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "one.pt"), here], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-8000:]
    done = torchrun(str(script), str(tmp_path / "two.pt"), here)
    assert done.returncode == 0, done.stderr[-8000:]
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    # 7 samples, mini-batches of 3 drawn from the global batch, 2 epochs: 6 optimizer steps on both
    assert one["stats"]["optimizer_steps"] == two["stats"]["optimizer_steps"] == 6
    for key in ("loss", "pg_loss", "opd_loss", "entropy", "grad_norm", "approx_kl_old", "trained_tokens"):
        assert two["stats"][key] == pytest.approx(one["stats"][key], rel=1e-5, abs=1e-7), key
    assert one["weights"].keys() == two["weights"].keys()
    start = R.load_policy("tiny", torch.device("cpu"), torch.float32, seed=0)[0].state_dict()
    assert max(float((w - start[k]).abs().max()) for k, w in one["weights"].items()) > 3e-3  # 6 steps of lr 1e-3
    for key, weight in one["weights"].items():  # the same update: equal up to the order of float sums
        assert torch.allclose(two["weights"][key], weight, atol=1e-5), key


@pytest.mark.slow
def test_the_sharded_update_is_the_one_process_update_with_the_authors_aggregation(tmp_path):
    # groups of 2 rows are cut from the global mini-batch's order, so 2 processes form the same ones as 1
    script = SHARDED_UPDATE.replace('lr=1e-3)', 'lr=1e-3, loss_agg="authors", micro_batch_rows=2)')
    assert script != SHARDED_UPDATE
    (tmp_path / "authors.py").write_text(script)
    here = str(Path(__file__).parent)
    done = subprocess.run([sys.executable, str(tmp_path / "authors.py"), str(tmp_path / "one.pt"), here],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-8000:]
    done = torchrun(str(tmp_path / "authors.py"), str(tmp_path / "two.pt"), here)
    assert done.returncode == 0, done.stderr[-8000:]
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    for key in ("loss", "pg_loss", "opd_loss", "entropy", "grad_norm", "trained_tokens"):
        assert two["stats"][key] == pytest.approx(one["stats"][key], rel=1e-5, abs=1e-7), key
    for key, weight in one["weights"].items():
        assert torch.allclose(two["weights"][key], weight, atol=1e-5), key
    (tmp_path / "exact.py").write_text(SHARDED_UPDATE)  # and the aggregation is not the exact one's
    done = subprocess.run([sys.executable, str(tmp_path / "exact.py"), str(tmp_path / "exact.pt"), here],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-8000:]
    assert abs(torch.load(tmp_path / "exact.pt")["stats"]["loss"] - one["stats"]["loss"]) > 1e-4


TORCHRUN_FLAGS = QUICK + ["--env", "webshop", "--batch-tasks", "2", "--mini-batch", "4", "--opd-mini-batch", "4",
                          "--eval-episodes", "5"]  # panels of 5, in chunks of B*G = 4: shares of 2+2, then 1+0


def metrics_without_times(run_dir):
    return [{k: v for k, v in m.items() if not k.startswith("t_") and "per_s" not in k and "ms_per" not in k
             and k != "peak_mem_gb"} for m in R.read_jsonl(run_dir / "metrics.jsonl")]


@pytest.mark.slow
def test_two_processes_run_retireopd_on_webshop(tmp_path):
    run_dir = tmp_path / "two"
    done = torchrun("retireopd.py", *TORCHRUN_FLAGS, "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr[-8000:]
    assert done.stdout.count("[retireopd] done in") == 1  # rank 0 alone prints
    metrics = R.read_jsonl(run_dir / "metrics.jsonl")
    assert phases(metrics) == [("teacher", k) for k in range(3)] + [("student", k) for k in range(3)]
    for m in metrics:  # the global count: B*G = 4 episodes of `turns` turns each, 2 on each process
        assert m["samples"] == round(m["turns"] * 2 * 2) and m["samples"] >= 4
    assert all(m["gap"] is not None for m in metrics if m["phase"] == "student")
    evaluations = R.read_jsonl(run_dir / "eval.jsonl")  # each of the whole panel: phase 1 before training and 3
    assert len(evaluations) == 2 * 4 + 1 + 3 + 1 and all(e["n"] == 5 for e in evaluations)  # times, with skills
    # and without; its report; phase 2's 3 validations; its report
    student = R.transformers.AutoModelForCausalLM.from_pretrained(run_dir / "student")
    assert type(student).__name__ == "Qwen2ForCausalLM"
    assert json.loads((run_dir / "student" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    (checkpoint,) = [c for c in sorted((run_dir / "checkpoints").iterdir()) if c.name.endswith("00002")][-1:]
    trainer = torch.load(checkpoint / "trainer.pt", weights_only=False)
    assert trainer["world_size"] == 2 and len(trainer["rng"]) == 2  # one sampling stream per process
    assert not torch.equal(trainer["rng"][0]["torch"], trainer["rng"][1]["torch"])
    assert set(trainer["optimizer"]["state"]) == {k for k, _ in student.named_parameters()}  # whole, by name


@pytest.mark.slow
def test_a_killed_two_process_run_resumes_as_if_never_stopped(tmp_path):
    flags = [*TORCHRUN_FLAGS, "--iterations", "5"]
    whole = tmp_path / "whole"
    assert torchrun("retireopd.py", *flags, "--run-dir", str(whole)).returncode == 0
    killed = tmp_path / "killed"
    process = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                "retireopd.py", *flags, "--run-dir", str(killed)], cwd=Path(__file__).parent,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "0-teacher-00001").is_dir() and time.time() < deadline:
        time.sleep(0.02)
    kill = subprocess.run(["pkill", "-9", "-f", f"run-dir {killed}"])  # the launcher and both workers at once
    assert kill.returncode == 0
    process.wait(timeout=60)
    assert not any(e["event"] == "done" for e in R.read_jsonl(killed / "events.jsonl"))
    one = subprocess.run([sys.executable, "retireopd.py", "--resume", str(killed)], cwd=Path(__file__).parent,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 1 and "written by 2 process(es)" in one.stderr.strip().splitlines()[-1]
    done = torchrun("retireopd.py", "--resume", str(killed))
    assert done.returncode == 0, done.stderr[-8000:]
    assert "resuming" in done.stdout
    assert metrics_without_times(killed) == metrics_without_times(whole)  # each process's RNG restored too


def test_memory_estimate_per_process_under_torchrun():
    model = _meta_model("Qwen2.5-1.5B")  # 1,543,714,304 parameters; the tied embedding 151936 x 1536
    cfg = R.parse_config({"model": "random:Qwen2.5-1.5B", "env": "webshop", "run_dir": "/tmp/unused"})
    one = tools.estimate_memory_gb(model, cfg, 1, 1024, torch.device("cuda"))
    four = tools.estimate_memory_gb(model, cfg, 1, 1024, torch.device("cuda"), processes=4)
    assert (one["processes"], one["sampling_copy"], one["gathered"]) == (1, 0, 0)  # one process: as before
    # weights, gradient and AdamW moments sharded: 16 B x 1,543,714,304 / 4 = 6,174,857,216 B = 5.75 GiB
    # (no bf16 weight copy: autocast's cache is off); the frozen model's 4 B/param / 4 = 1.44 GiB
    assert (four["policy_and_adam"], four["frozen_models"]) == (5.75, 1.44)
    # the sampling copy, whole on every rank: 2 B x 1,310,253,056 Linear weights + 4 B x 233,461,248 others
    # (embedding, norms) = 3,554,351,104 B = 3.31 GiB (4 B/param on CPU: 5.75)
    assert four["sampling_copy"] == 3.31
    assert tools.estimate_memory_gb(model, cfg, 1, 1024, torch.device("cpu"), processes=4)["sampling_copy"] == 5.75
    # gathered in a forward/backward, weights and gradients in fp32: 8 B x (2 layers x 46,797,824 + the root's
    # 233,375,232: embedding and final norm) = 2,615,767,040 B = 2.44 GiB
    assert four["gathered"] == 2.44
    # each rank plays 128 / 4 = 32 episodes: a quarter of the KV cache (7.48 GiB), the same 16-row prefill
    assert four["kv_cache"] == round(one["kv_cache"] / 4, 2) == 7.48 and four["prefill"] == one["prefill"]
    assert four["total"] == round(5.75 + 1.44 + 3.31 + four["kv_cache"] + four["prefill"] + four["sampling"], 2)
    assert "per process of 4" in tools.format_memory_estimate(four) and "sampling_copy 3.31" in tools.format_memory_estimate(four)


def test_one_process_helpers_change_nothing():
    assert (multigpu.world_size(), multigpu.rank(), multigpu.main_process()) == (1, 0, True)
    tasks = list(range(8))
    assert multigpu.share_of_tasks(tasks) == tasks
    samples = [R.TurnSample(0, 0, [1], [2, 3], False), R.TurnSample(0, 1, [1], [4], False)]
    assert multigpu.global_batch(samples) == (0, [2, 1])
    idle = []
    assert list(multigpu.in_lockstep([[0], [1]], lambda: idle.append(1))) == [[0], [1]] and idle == []
    assert multigpu.sum_over_ranks(1, 2.5) == [1, 2.5] and multigpu.max_over_ranks(3) == 3 and multigpu.all_ranks(True)
    assert torch.equal(multigpu.cat_over_ranks([torch.ones(2), torch.zeros(1)]), torch.tensor([1.0, 1.0, 0.0]))
    model, _ = R.load_policy("tiny", torch.device("cpu"), torch.float32)
    assert multigpu.sampling_model(model) is model and multigpu.full_state_dict(model) is None and not multigpu.sharded(model)


def test_batch_tasks_must_split_into_whole_groups_under_torchrun(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit, match="--batch-tasks 6: under torchrun each of the 4 processes"):
        R.parse_config({"model": "tiny", "batch_tasks": 6, "run_dir": str(tmp_path)})
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="--benchmark runs in one process"):
        R.main(["--model", "tiny", "--benchmark", "--run-dir", str(tmp_path / "b")])
