"""RetireOPD: Self-Retiring On-Policy Distillation for agentic RL (arXiv 2609.20784): the method in one file.

Phase 1 trains a teacher with GRPO while the task's skill notes sit in its prompt, then freezes it;
S_T is its validation success with skills. Phase 2 trains a fresh, skill-free student with GRPO plus
an on-policy distillation loss lambda * L_OPD: the teacher scores every token the student sampled.
The gap K between student and teacher is averaged over blocks of W iterations; a validation judges
a full block against the one judged before it. Once K stopped shrinking and the student's successes
at this and the previous judging validation average at least rho * S_T, the teacher is retired and
GRPO alone goes on.

Read it top to bottom beside the paper: 1 hyper-parameters and the --algo table, 2 skills and prompts, 3 the
math, 4 rollout, 5 update (with the scoring forward: how each log-prob is taken), 6 one iteration, a
phase, the two phases. There the method ends, at a banner that names what it calls from below
(evaluation, bookkeeping, loading, the command line). torchrun adds three `if ddp:` steps (multigpu.py).
Modules hold the rest, none importing this file: engine.py samples; environments.py drives
alfworld_env.py, webshop_env.py and kitchen_env.py; tiny.py builds the models made in code; run_outputs.py
writes a run's logs, models and checkpoints; settings.py, model_sources.py, run_folder.py and repairs.py
check flags, models and run folders; memory.py and dashboards.py measure and show a run; common.py holds
what they share; bench.py times the model calls. docs/choices.md gives every choice, with its reason.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import os
import random
import re
import shutil
import signal
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Optional

import huggingface_hub
import torch
import transformers
from tqdm.auto import tqdm

import alfworld_env  # ALFWorld on its real engine, and its skill notes
import dashboards  # the live dashboard (--report-to), the summary line, the plot
import kitchen_env  # the offline demo's kitchen, and its skill notes
import model_sources  # what cannot be loaded or cannot teach: --model (a folder, the hub), teachers, model folders
import multigpu  # what several processes add: the three `if ddp:` steps of the method
import repairs  # what keeps a damaged run folder resumable: checkpoints set aside, logs truncated, config restored
import run_folder  # the run folder's lock and which run it holds (run.json): one process per folder
import settings  # the flags resolved and checked in one line (a table of rules), a resume's settings, the data
import tiny  # the models built in code: the tiny model (its tokenizer, warm start, presets) and random: shapes
import webshop_env  # WebShop in pure Python, and its skill notes
from common import PHASES, fsync_tree, read_jsonl, remove_entry, rename_entry, resolve_model_name
from engine import autocast, generate, use_tf32_head  # sampling a batch of answers from the full distribution
from environments import EpisodeState, TaskSuite, close_episodes, start_episodes, step_episodes
from run_outputs import (INTERRUPTED, Run, Stopped, finished_phases, interrupt_once, non_finite_tensors,  # what a
                         phase_iterations, resumable_checkpoint, set_rng_state, stop_at_the_next_safe_point,  # run
                         stop_line)  # writes (logs, models, checkpoints), and how it stops


# ==================================================================================================
# 1. The hyper-parameters, and what each --algo runs
# ==================================================================================================


class Algorithm(NamedTuple):
    """What one --algo runs (README: The algorithm). Phase 1 (Skill-GRPO) trains the teacher with GRPO,
    skills in its prompt. Phase 2 trains a fresh, skill-free student; with a teacher, under the authors'
    phase-2 protocol (mini-batch 128, no KL), without one (--algo grpo) under phase 1's (phase_protocol)."""
    phase_1: bool  # the teacher is trained (or --teacher reuses a saved one)
    phase_2: bool  # the student is trained, with:
    student_grpo: bool  # the PPO-clip GRPO loss on environment reward
    student_opd: bool  # lambda * L_OPD toward the frozen teacher
    retirement: str  # "adaptive": the authors' rule ("fixed" with --retire-at N); "never": the teacher stays


ALGORITHMS = {  # the method; the RL baseline; the teacher alone; pure distillation; GRPO + OPD never retired
    "retireopd": Algorithm(phase_1=True, phase_2=True, student_grpo=True, student_opd=True, retirement="adaptive"),
    "grpo": Algorithm(phase_1=False, phase_2=True, student_grpo=True, student_opd=False, retirement="never"),
    "skill-grpo": Algorithm(phase_1=True, phase_2=False, student_grpo=False, student_opd=False, retirement="never"),
    "opd": Algorithm(phase_1=True, phase_2=True, student_grpo=False, student_opd=True, retirement="never"),
    "grpo+opd": Algorithm(phase_1=True, phase_2=True, student_grpo=True, student_opd=True, retirement="never"),
}
# Several processes: `torchrun --nproc_per_node N retireopd.py` sets WORLD_SIZE. The method's three `if ddp:`
# steps say where processes differ (helpers in multigpu.py); `python retireopd.py` runs none of them.
ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1


def arg(default, help: str):
    """A field of Hyperparameters or Config: its default, and the --help text of its flag (build_parser)."""
    return field(default=default, metadata={"help": help})


@dataclass
class Hyperparameters:
    """The method's knobs, the paper's hyper-parameters (the authors' defaults). Config (section 10) adds
    what only runs the run: data, devices and memory budgets, outputs; every field is a --flag."""
    model: str = arg("tiny", "tiny: the offline demo (tiny.py); an alias (Qwen2.5-1.5B/3B/7B: the paper's protocol, "
                     "the defaults below), hub id, local folder, or random:<alias>")
    algo: str = arg("retireopd", "retireopd | grpo | skill-grpo | opd | grpo+opd (README: The algorithm)")
    env: str = arg("alfworld", "alfworld | webshop | kitchen (the offline demo's; the `tiny` preset's default)")
    seed: int = arg(0, "seeds task sampling, rollouts and the tiny/random: model weights")
    # --- rollout ---
    iterations: int = arg(150, "training iterations per phase (the authors' protocol)")
    teacher_iterations: Optional[int] = arg(None, "phase 1's, if not --iterations (which alone sets both)")
    batch_tasks: int = arg(16, "B: tasks per iteration")
    group_size: int = arg(8, "G: rollouts per task; a GRPO group")
    max_turns: Optional[int] = arg(None, "None -> 50 (ALFWorld) / 15 (WebShop, the kitchen)")
    history: int = arg(2, "H: past (observation, action) pairs shown in the prompt")
    max_response_tokens: int = arg(512, "an answer cut here is malformed (and still steps the env)")
    max_prompt_tokens: Optional[int] = arg(None, "student budget; None -> 2048 (ALFWorld) / 4096 (WebShop, kitchen)")
    success_reward: float = arg(10.0, "R_i for a won episode")
    malformed_penalty: float = arg(0.1, "subtracted from a turn's score when its answer is malformed")
    # --- update ---
    lr: float = arg(1e-6, "AdamW learning rate (the authors' scripts)")
    lr_warmup_steps: int = arg(0, "linear lr warm-up over a phase's first N optimizer steps (the authors': none)")
    weight_decay: float = arg(0.01, "AdamW weight decay")
    grad_clip: float = arg(1.0, "gradient-norm clipping")
    clip_eps: float = arg(0.2, "PPO clip")
    dual_clip: float = arg(3.0, "dual-clip PPO: for A < 0 the loss is also capped at -c*A (verl's clip_ratio_c)")
    ppo_epochs: int = arg(1, "passes over each iteration's samples")
    mini_batch: Optional[int] = arg(None, "samples per optimizer step, phase 1 and grpo (None: ALFWorld 256, else 64)")
    opd_mini_batch: int = arg(128, "turn-samples per optimizer step in phase 2 with a teacher (both envs)")
    kl_coef: float = arg(0.01, "KL-to-reference (k3) coefficient, phase 1 and --algo grpo; 0: no reference model")
    opd_kl_coef: float = arg(0.0, "the same in phase 2 with a teacher (the authors': off, no reference model)")
    entropy_coef: float = arg(0.001, "entropy bonus; 0 skips computing it")
    opd_coef: float = arg(0.01, "lambda: weight of the OPD loss L_OPD (the authors' 0.01); 0 after retirement")
    loss_agg: str = arg("exact", "exact: the loss is one token-mean over each mini-batch | authors: the token-means "
                        "of groups of --micro-batch-rows samples, summed / the accumulation steps "
                        "(micro_batch_denominators)")
    micro_batch_rows: int = arg(8, "--loss-agg authors: turn-samples per group (their micro-batch per GPU)")
    # --- retirement ---
    window: int = arg(5, "W: the gap K is averaged over non-overlapping blocks of W iterations")
    alignment_threshold: float = arg(0.0, "\"stopped shrinking\": progress (K_prev - K)/K_prev <= this")
    rho: float = arg(0.9, "competence: the student's successes at this and the previous judging validation, "
                     "averaged, >= rho * S_T")
    teacher_success: Optional[float] = arg(None, "S_T; None: recorded at the end of phase 1 (teacher_success_rate)")
    retire_at: Optional[int] = arg(None, "fixed-schedule retirement at this phase-2 iteration (ablation)")
    # --- evaluation ---
    eval_every: int = arg(5, "validation every N iterations (1 <= N <= W) and at a phase's last iteration")
    eval_temperature: float = arg(0.4, "sampling temperature of validations and the end-of-phase reports")
    eval_episodes: Optional[int] = arg(None, "cap every panel, for quick checks (ALFWorld: round-robin over task "
                                       "types; WebShop: the first N goals); None = the whole panel")


# ==================================================================================================
# 2. Skills and prompts
# ==================================================================================================
# What the teacher sees beyond the student: its task type's skill block (skill_text), our short strategy notes
# per task type, kept beside each environment as data. --show-prompts prints a student's and a teacher's prompt.
SKILLS = {"alfworld": alfworld_env.ALFWORLD_SKILLS, "webshop": webshop_env.WEBSHOP_SKILLS,
          "kitchen": kitchen_env.KITCHEN_SKILLS}

FORMAT_INSTRUCTION = (
    "First reason briefly inside <think> </think>, then give exactly one admissible action inside "
    "<action> </action>."
)
# One line that says where the agent is; the prompt is a lone user message (no system turn of ours:
# a Qwen2.5-Instruct chat template then adds its own default system turn, as in the authors' runs).
ENV_INTRO = {
    "alfworld": "You are an agent in ALFWorld, a text-based household.",
    "webshop": "You are an agent shopping in WebShop, a text-based web store.",
    "kitchen": "You are a cook in a text-based kitchen.",
}


def skill_text(env_name: str, task_type: str) -> str:
    """The teacher's privileged skill block for one task: general rules + the task type's rules."""
    rules = SKILLS[env_name]["general"] + SKILLS[env_name].get(task_type, [])
    return "Skills for this task:\n" + "\n".join(f"- {rule}" for rule in rules)


def build_user_message(env_name: str, task: str, steps_taken: int, history: list[tuple[str, str]],
                       observation: str, admissible: list[str], skill_block: str = "") -> str:
    """The user message of s_t (student, no skill_block) or s_t^T (teacher, skill_block = skill_text's):
    the content of the authors' verl-agent prompts, in our words (task, steps taken, the last H
    (observation, action) pairs, observation, admissible actions, format). s_t^T = s_t + the skill block."""
    parts = [skill_block] if skill_block else []
    parts.append(f"{ENV_INTRO[env_name]} Your task: {task}")
    steps = f"You have taken {steps_taken} step(s)."
    parts.append(steps + f" Your last {len(history)} observation(s) and action(s):\n" + "\n".join(
        f"Observation: {obs}\nAction: {act}" for obs, act in history) if history else steps)
    parts.append(f"Current observation:\n{observation}")
    parts.append("Admissible actions: " + ", ".join(f"'{a}'" for a in admissible))
    parts.append(FORMAT_INSTRUCTION)
    return "\n\n".join(parts)


# The authors' range of "Chinese characters": CJK Unified Ideographs, U+4E00-U+9FFF. Kana, Hangul,
# Extension A and the compatibility ideographs are outside it (not malformed), as in theirs.
CJK_RE = re.compile(r"[\u4e00-\u9fff]")
# An answer without an <action> pair sends its last characters: the authors' 30 (ALFWorld), 20 (WebShop); ours 30
FALLBACK_CHARS = {"alfworld": 30, "webshop": 20, "kitchen": 30}


def project_action(answer: str, env_name: str, cut: bool = False) -> tuple[str, bool]:
    """(what the environment receives, whether the answer is well formed): the authors' projection
    (verl-agent's). The action: the lowercased text between the first `<action>` and the first `</action>`,
    stripped ("" if `</action>` comes first: well formed, as theirs); without both tags, the lowercased
    answer's last FALLBACK_CHARS characters, malformed. Also malformed: `<think>` or `</think>` missing (case-sensitive,
    as theirs), a CJK_RE character, or (ours) an answer `cut` at --max-response-tokens. Either way the
    string steps the environment and joins the history; malformed costs its turn -0.1 (turn_scores)."""
    text = answer.lower()
    start, end = text.find("<action>"), text.find("</action>")
    if start == -1 or end == -1:
        return text[-FALLBACK_CHARS[env_name]:], False
    action = text[start + len("<action>"):end].strip()
    return action, "<think>" in answer and "</think>" in answer and not CJK_RE.search(answer) and not cut


# ==================================================================================================
# 3. The math: one small pure function per equation
# ==================================================================================================
# Notation: episode i of group g (all G episodes of a group play the same task), turn t, response token
# k. r_{i,t} is the turn's score; l^old, l^T, l^theta are the log-probs of a sampled token under the
# rollout policy, the teacher (on the skill-augmented prompt s_t^T) and the policy being updated.


def turn_scores(won: bool, malformed: list, success_reward: float = 10.0, penalty: float = 0.1) -> list:
    """The score of every turn of one episode, what GRPO normalises.          (paper: the reward)

        R_i = success_reward [episode i won],   r_{i,t} = R_i - penalty [turn t was malformed]

    malformed: one flag per turn. Every turn shares the episode's outcome; a malformed answer costs
    its own turn only. Returns one float per turn."""
    episode_reward = success_reward if won else 0.0
    return [episode_reward - penalty * bool(flag) for flag in malformed]


def grpo_advantages(scores: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantage of every turn-sample, normalised within its group.      (paper: RL backbone)

        A_{i,t} = (r_{i,t} - mean_g) / (std_g + eps)

    scores: (N,) r_{i,t}; group_ids: (N,) each sample's group. Returns (N,) float32. Mean and
    unbiased std over *all turn-samples of the group* (verl-agent: each turn is one sample). A
    group of equal scores, or of one sample, carries no signal and gets exactly 0 (never NaN)."""
    advantages = torch.zeros_like(scores, dtype=torch.float64)
    for group in torch.unique(group_ids):
        members = group_ids == group
        group_scores = scores[members].double()
        if group_scores.max() > group_scores.min():  # (a group of one has max = min)
            advantages[members] = (group_scores - group_scores.mean()) / (group_scores.std() + eps)
    return advantages.float()


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, with_entropy: bool = False):
    """log pi of each sampled token, and the entropy, from the logits that predict it.  (paper: every l)

        l_k = z_k[y_k] - logsumexp(z_k)
        H_k = logsumexp(z_k) - sum_v softmax(z_k)_v z_{k,v}        (entropy, if asked)

    logits: (N, V) fp32 z_k, the output head at the position before token k (sequence_logprobs);
    tokens: (N,) the sampled ids y_k. Returns (N,) float32 log-probs (and (N,) entropies)."""
    log_norm = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - log_norm
    return (logp, log_norm - (torch.softmax(logits, dim=-1) * logits).sum(-1)) if with_entropy else logp


def k3(logp: torch.Tensor, other_logp: torch.Tensor, max_log_ratio: Optional[float] = None) -> torch.Tensor:
    """The k3 estimate of KL(pi || other) per token sampled from pi: unbiased and never negative, without
    the clamp (max_log_ratio, for OPD: a cap on exp that trades a little bias for bounded values).

        k3_k = exp(min(l^other_k - l_k, max_log_ratio)) - 1 + (l_k - l^other_k)      (..., T) -> (..., T)
    """
    log_ratio = other_logp - logp
    return torch.exp(log_ratio if max_log_ratio is None else torch.clamp(log_ratio, max=max_log_ratio)) - 1 - log_ratio


def teacher_student_gap(old_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: Optional[torch.Tensor] = None):
    """The retirement statistic K of one iteration, and its k3 companion.   (paper: Sec. retirement)

        K    = sum_k mask_k (l^old_k - l^T_k) / sum_k mask_k        (signed: the k1 estimate)
        K_k3 = sum_k mask_k k3(l^old_k, l^T_k) / sum_k mask_k       (never negative)

    Both estimate KL(student || teacher) over every response token of the iteration. The rule reads K,
    which can be negative (the authors' code logs -K as its gap_mean); K_k3 is a diagnostic. Returns two floats."""
    mask = torch.ones_like(old_logp) if mask is None else mask
    tokens = mask.sum().clamp(min=1)
    gap = float(((old_logp - teacher_logp) * mask).sum() / tokens)
    return gap, float((k3(old_logp, teacher_logp) * mask).sum() / tokens)


def token_mean(values: torch.Tensor, mask: torch.Tensor, num_tokens: Optional[float] = None,
               denominators: Optional[torch.Tensor] = None) -> torch.Tensor:
    """How every loss term is aggregated over (micro-)batch tokens; values, mask: (B, T) or flat.

        sum_k mask_k values_k / num_tokens     (num_tokens: default mask.sum(); the whole mini-batch's
                                                count, so micro-batch losses add up to its token-mean)
        sum_k mask_k values_k / D_k            (denominators D, like mask: --loss-agg authors)"""
    if denominators is not None:
        return (values * mask / denominators).sum()
    return (values * mask).sum() / max(float(mask.sum()) if num_tokens is None else float(num_tokens), 1.0)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip: float = 0.2, dual_clip: float = 3.0, ref_logp: Optional[torch.Tensor] = None,
                kl_coef: float = 0.0, entropy: Optional[torch.Tensor] = None, entropy_coef: float = 0.0,
                num_tokens: Optional[float] = None, denominators: Optional[torch.Tensor] = None):
    """PPO-clip surrogate, verl's dual clip, the reference KL, the entropy bonus. (paper: RL backbone)

        ratio_k = exp(clamp(l^theta_k - l^old_k, -20, 20))   (verl's clamp: never inf)
        L^clip_k = max(-ratio_k A_k, -clip(ratio_k, 1-eps, 1+eps) A_k)
        L^PG_k  = min(L^clip_k, -c A_k)  where A_k < 0  (dual clip: a huge ratio on a bad token
                  cannot blow the loss up),  L^clip_k elsewhere
        L = sum_k mask_k [L^PG_k + kl_coef min(k3(l^theta_k, l^ref_k), 10) - entropy_coef H_k] / num_tokens

    (B, T) tensors (any matching shape), advantages per token. The KL term is verl's low_var_kl: k3 with
    its log-ratio capped at 20 before exp (never inf), then clamped at 10.
    num_tokens, denominators: token_mean's; the stats (pg_loss, clip_frac, dual_clip_frac, kl_ref, entropy,
    approx_kl_old = mean l^old - l^theta) add up the same way. Returns (loss, stats)."""
    ratio = torch.exp(torch.clamp(logp - old_logp, -20.0, 20.0))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip, 1 + clip)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_cap = -advantages * dual_clip
    per_token = torch.where(advantages < 0, torch.minimum(clip_loss, dual_cap), clip_loss)
    mean = lambda values: float(token_mean(values.detach().float(), mask, num_tokens, denominators))  # noqa: E731
    stats = {"pg_loss": mean(per_token), "clip_frac": mean(clipped > unclipped),
             "dual_clip_frac": mean((clip_loss > dual_cap) & (advantages < 0)),
             "approx_kl_old": mean(old_logp - logp)}
    if kl_coef > 0 and ref_logp is not None:
        kl_ref = torch.clamp(k3(logp, ref_logp, max_log_ratio=20.0), max=10.0)
        per_token = per_token + kl_coef * kl_ref
        stats["kl_ref"] = mean(kl_ref)
    if entropy_coef > 0 and entropy is not None:
        per_token = per_token - entropy_coef * entropy
        stats["entropy"] = mean(entropy)
    return token_mean(per_token, mask, num_tokens, denominators), stats


def opd_loss(logp: torch.Tensor, old_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor,
             num_tokens: Optional[float] = None, denominators: Optional[torch.Tensor] = None):
    """The on-policy distillation loss, a term of its own outside the PPO clip.  (paper: OPD term)

        w_k    = exp(min(l^theta_k - l^old_k, 10))                     (importance weight)
        k3_k   = exp(min(l^T_k - l^theta_k, 20)) - 1 + (l^theta_k - l^T_k)
        L_OPD  = sum_k mask_k w_k k3_k / num_tokens,   total loss L = L_PPO + lambda L_OPD  (token_mean)

    (B, T) tensors; l^old and l^T are constants. d(w k3)/dl^theta = w (l^theta - l^T): the
    reverse-KL policy gradient with an unclipped, importance-weighted per-token advantage
    lambda (l^T - l^theta), pushing the student toward tokens the teacher finds likelier. (The naive
    mean(l^theta - l^T) has zero expected gradient: E_pi[grad log pi] = 0.) Returns (loss, stats)."""
    teacher_logp, old_logp = teacher_logp.detach(), old_logp.detach()
    weight = torch.exp(torch.clamp(logp - old_logp, max=10.0))
    k3_teacher = k3(logp, teacher_logp, max_log_ratio=20.0)
    loss = token_mean(weight * k3_teacher, mask, num_tokens, denominators)
    return loss, {"opd_loss": float(loss.detach())}


def combined_loss(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, *,
                  advantages: Optional[torch.Tensor] = None, teacher_logp: Optional[torch.Tensor] = None,
                  opd_coef: float = 0.0, num_tokens: Optional[float] = None,
                  denominators: Optional[torch.Tensor] = None, **ppo):
    """The loss minimised on one (micro-)batch.          (paper: the student's objective)

        L = L_PPO(A) + kl_coef KL_ref - entropy_coef H  +  lambda L_OPD

    advantages None (--algo opd): lambda L_OPD alone. teacher_logp None or lambda = 0 (phase 1, GRPO,
    after retirement): no OPD term. num_tokens, denominators: token_mean's. ppo: policy_loss's other
    arguments. Returns (loss, stats)."""
    loss, stats = logp.new_zeros(()), {}
    if advantages is not None:
        loss, stats = policy_loss(logp, old_logp, advantages, mask, num_tokens=num_tokens,
                                  denominators=denominators, **ppo)
    if teacher_logp is not None and opd_coef > 0:
        distill, distill_stats = opd_loss(logp, old_logp, teacher_logp, mask, num_tokens, denominators)
        loss, stats = loss + opd_coef * distill, {**stats, **distill_stats}
    return loss, stats


# ----- the retirement rule: the authors' state machine, as pure pieces and one latched state ------
# Each phase-2 iteration's K goes into a block of W iterations. A validation that finds a full block not
# yet judged judges it against the block judged before it (the first judged block only sets the
# baselines): a "judging validation". Since 1 <= eval_every <= W, at most one full block waits at a
# validation, and it is the newest; a validation with none waiting judges nothing.


def alignment_progress(previous_block: Optional[float], block: float, eps: float = 1e-8) -> Optional[float]:
    """How much the gap shrank from one block to the next.          (paper: retirement condition i)

        progress = (K_{m-1} - K_m) / K_{m-1}

    None (the criterion is invalid) without a previous block or when |K_{m-1}| <= eps. "Stopped
    shrinking": progress <= threshold (0.0), i.e. K_m / K_{m-1} >= 1: the gap kept its sign and its
    magnitude did not decrease (K is signed: a negative K growing more negative has stopped shrinking too)."""
    if previous_block is None or abs(previous_block) <= eps:
        return None
    return (previous_block - block) / previous_block


def competence(success: float, previous_success: float, teacher_success: float) -> float:
    """The student's competence relative to its teacher.            (paper: retirement condition ii)

        competence = (S_m + S_{m-1}) / (2 S_T)

    S_m, S_{m-1}: the student's validation successes at this and the previous judging validation;
    S_T > 0: the teacher's validation success with skills."""
    return (success + previous_success) / (2 * teacher_success)


ROUNDING = 1e-9  # a competence this close below rho counts as reaching it (a tie in exact arithmetic)


def should_retire(progress: Optional[float], competence_ratio: Optional[float], threshold: float = 0.0,
                  rho: float = 0.9) -> bool:
    """Both conditions: the criterion is valid, progress <= threshold and competence >= rho.

    Competence is a ratio of panel fractions, so its exact value can be rho itself: (8/12 + 10/12) /
    (2 * 10/12) is 0.9, but 0.8999999999999999 in floats. Such a tie retires here (competence >=
    rho - ROUNDING); the authors' plain >= does not (README: Ours vs the authors' code)."""
    return progress is not None and competence_ratio is not None and progress <= threshold \
        and competence_ratio >= rho - ROUNDING


def teacher_success_rate(validations: list) -> float:
    """S_T, the teacher's validation success with skills: the mean of its last two validations (one
    only: that one), as the student's side of the rule averages two. The authors type it in."""
    last_two = validations[-2:]
    return sum(last_two) / len(last_two)


@dataclass
class Retirement:
    """Phase 2's retirement state: K blocks, the judged baselines, the latch. mode "adaptive": the
    rule above; "fixed": --retire-at N (the teacher scores N iterations); "never": grpo+opd and opd
    (the numbers are still logged). Saved in every checkpoint: a resume decides as an uninterrupted run."""
    teacher_success: Optional[float]  # S_T (> 0 for the adaptive rule)
    mode: str = "adaptive"
    window: int = 5
    threshold: float = 0.0
    rho: float = 0.9
    retire_at: Optional[int] = None
    eps: float = 1e-8
    pending: list = field(default_factory=list)  # K of the block being filled
    blocks: list = field(default_factory=list)  # [last iteration, mean K] of each full block
    judged: int = 0  # blocks judged so far (all but possibly the newest: eval_every <= W)
    previous_block: Optional[float] = None  # K_{m-1}
    previous_success: Optional[float] = None  # S_{m-1}
    retired: bool = False
    retired_at: Optional[int] = None  # the first phase-2 iteration that runs without the teacher

    def observe_gap(self, iteration: int, gap: float) -> dict:
        """Buffer one iteration's K; returns {"gap_block": mean} when this iteration fills a block."""
        self.pending.append(gap)
        if len(self.pending) < self.window:
            return {}
        self.blocks.append([iteration, sum(self.pending) / self.window])
        self.pending = []
        return {"gap_block": self.blocks[-1][1]}

    def observe_validation(self, iteration: int, success: float) -> dict:
        """A judging validation, if a full block waits: the first block not yet judged (with eval_every <= W
        at most one waits), against the block judged before it, with this validation's success."""
        record = {"val_success": success, "progress": None, "competence": None, "criterion_valid": False}
        if self.judged == len(self.blocks):
            return record  # no full block since the last judgement: nothing to judge
        block = self.blocks[self.judged][1]
        record["judged_block"] = block
        if self.previous_block is not None and self.teacher_success:
            progress = alignment_progress(self.previous_block, block, self.eps)
            competence_ratio = competence(success, self.previous_success, self.teacher_success)
            record.update(progress=progress, competence=competence_ratio,
                          criterion_valid=progress is not None)
        self.previous_block, self.previous_success, self.judged = block, success, self.judged + 1
        if self.mode == "adaptive" and not self.retired and should_retire(
                record["progress"], record["competence"], self.threshold, self.rho):
            self.retired, self.retired_at = True, iteration + 1  # the latch: never re-enabled
        return record

    def observe_schedule(self, iteration: int) -> None:
        """--retire-at N: the teacher scores iterations 0..N-1."""
        if self.mode == "fixed" and not self.retired and iteration + 1 >= self.retire_at:
            self.retired, self.retired_at = True, iteration + 1


# ==================================================================================================
# 4. Rollout: B tasks x G episodes, played in lock-step
# ==================================================================================================
# Each turn, all active episodes' prompts are answered in one batched call (generate, engine.py: the full
# distribution, no top-k or top-p), then every environment is stepped; each turn is one training sample.
# The policy's prompt carries skills only in phase 1; in phase 2 the teacher's s_t^T is stored, to score.
ROLLOUT_TEMPERATURE = 1.0  # fixed: only at 1 are the sampled tokens' log-probs (l^old, K's) those of pi itself


@dataclass
class TurnSample:
    group: int  # g: which task of the iteration (all G episodes of a task share it)
    episode: int  # i: which episode
    prompt_ids: list  # the policy's prompt tokens (s_t; with skills in phase 1)
    response_ids: list  # y: the tokens the policy sampled (ending in EOS unless cut)
    malformed: bool  # project_action: no <action> pair, no <think> or </think>, CJK, or cut at the cap
    teacher_prompt_ids: Optional[list] = None  # s_t^T, when a teacher will score y
    score: float = 0.0  # r_{i,t} (turn_scores), set when the episode ends
    sample_logp: Optional[torch.Tensor] = None  # (len(y),) log-probs of y as the sampler saw them


def encode_prompt(tokenizer, user_message: str) -> list:
    messages = [{"role": "user", "content": user_message}]  # the template adds its default system turn
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def episode_prompts(tokenizer, episode: EpisodeState, cfg: Config, skill_block: str) -> tuple[list, list, bool]:
    """(s_t, s_t^T, truncated): the student's prompt ids for the episode's current turn, and the teacher's,
    the same content plus the skill block. A student prompt over --max-prompt-tokens is cut first
    (prompt_within_budget); the teacher's is never cut further."""
    student, history, observation, truncated = prompt_within_budget(tokenizer, episode, cfg)
    teacher = encode_prompt(tokenizer, build_user_message(
        cfg.env, episode.task, episode.turns, history, observation, episode.admissible, skill_block)) \
        if skill_block else student
    return student, teacher, truncated


def rollout(model, tokenizer, suite: TaskSuite, tasks: list, cfg: Config, *, group_size: int,
            skills_in_prompt: bool, with_teacher_prompts: bool, temperature: float, desc: str = "rollout"):
    """Play len(tasks) * group_size episodes in lock-step. Returns (samples, episodes, stats).
    skills_in_prompt: the policy's own prompt carries the skill block (phase 1, the teacher's
    evaluation). with_teacher_prompts: also store s_t^T of every turn, for a teacher to score."""
    meter = RolloutMeter(cfg.max_turns, desc)  # timers, counts and the progress bar (plumbing)
    episodes = [EpisodeState(suite.new_episode(task, group), group, index=group * group_size + member)
                for group, task in enumerate(tasks) for member in range(group_size)]
    with meter.env():
        start_episodes(episodes)
    samples: list[TurnSample] = []
    model.eval()
    for _turn in range(cfg.max_turns):
        active = [episode for episode in episodes if not episode.done]
        if not active:
            break
        prompts, teacher_prompts = [], []
        for episode in active:
            skill_block = skill_text(cfg.env, episode.task_type) if skills_in_prompt or with_teacher_prompts else ""
            student, teacher, truncated = episode_prompts(tokenizer, episode, cfg, skill_block)
            prompts.append(teacher if skills_in_prompt else student)
            teacher_prompts.append(teacher if with_teacher_prompts else None)
            meter.prompts_truncated += truncated
        with meter.generate():
            responses = generate(model, tokenizer, prompts, cfg.max_response_tokens, temperature,
                                 prefill_batch=cfg.prefill_batch, sampler=cfg.sampler)
        actions = []  # (episode, action): every answer steps its env, a malformed one too (project_action)
        for episode, prompt, teacher_prompt, response in zip(active, prompts, teacher_prompts, responses):
            action, well_formed = project_action(tokenizer.decode(response.ids, skip_special_tokens=True), cfg.env,
                                                 cut=response.hit_cap)
            episode.samples.append(TurnSample(episode.group, episode.index, prompt, response.ids, not well_formed,
                                              teacher_prompt, sample_logp=response.logp))
            episode.turns += 1
            actions.append((episode, action))
        with meter.env():
            step_episodes(actions, active, cfg.max_turns)
        meter.turn_done(responses, active, episodes)
        samples += [episode.samples[-1] for episode in active]
    with meter.env():
        close_episodes(episodes)
    for episode in episodes:  # r_{i,t}: every turn of an episode shares its outcome
        malformed = [sample.malformed for sample in episode.samples]
        scores = turn_scores(episode.won, malformed, cfg.success_reward, cfg.malformed_penalty)
        for sample, score in zip(episode.samples, scores):
            sample.score = score
    return samples, episodes, meter.stats(episodes, samples, cfg)


# ==================================================================================================
# 5. Update: log-probs of the sampled tokens, then the combined loss in mini-batches
# ==================================================================================================


def sequence_logprobs(model, prompts: list, responses: list, cfg: Config, with_entropy: bool = False):
    """Log-probs (and entropies) of each response's tokens given its prompt, in one forward pass.

    prompts, responses: lists of token-id lists; the *same* response ids are scored under whichever
    prompt is given (s_t or s_t^T), never re-tokenised text. Sequences are right padded (positions
    0..L-1 as in generation): under causal attention the padding after a sequence cannot reach its
    tokens, so no mask is needed (on a CPU: bit for bit the numbers with one, ~10% faster). The hidden
    state at position t predicts token t+1: only those that predict response tokens reach the head.
    Returns flat tensors over all response tokens, in input order (with gradients if enabled)."""
    device = next(model.parameters()).device
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    input_ids = torch.zeros(len(prompts), max(lengths), dtype=torch.long, device=device)
    rows, cols, targets = [], [], []
    for b, (prompt, response) in enumerate(zip(prompts, responses)):
        sequence = prompt + response
        input_ids[b, : len(sequence)] = torch.tensor(sequence, device=device)
        rows += [b] * len(response)
        cols += range(len(prompt) - 1, len(sequence) - 1)  # position t predicts token t+1
        targets += response
    picked = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    forward = getattr(model, "score_tokens", functools.partial(score_tokens, model))  # (sharded: its own, shard's)
    return forward(input_ids, picked, torch.tensor(targets, device=device), cfg.logprob_chunk, with_entropy)


def score_tokens(model, input_ids: torch.Tensor, picked: tuple, targets: torch.Tensor, chunk: int,
                 with_entropy: bool):
    """The scoring forward: the base model over the (batch, length) right-padded inputs (causal, no
    mask), then token_logprobs(lm_head(hidden), targets) at the hidden states `picked` (rows, columns),
    fp32, the head in chunks (head_logprobs, section 8: its memory). When sharded, this is a forward of
    the sharded model (shard registers it), so FSDP gathers the weights it uses."""
    with autocast(input_ids.device):
        hidden = model.base_model(input_ids=input_ids, use_cache=False).last_hidden_state
        return head_logprobs(hidden[picked], targets, model.get_output_embeddings(), chunk, with_entropy)


@torch.no_grad()
def response_logprobs(model, samples: list, cfg: Config, teacher_prompt: bool = False) -> list:
    """Each sample's response log-probs under `model`, no gradient: l^old (the rollout policy), l^T
    (the teacher; teacher_prompt=True scores y on s_t^T) or the reference's. One (len(y),) CPU
    tensor per sample, computed in token-budget micro-batches."""
    model.eval()
    prompts = [s.teacher_prompt_ids if teacher_prompt else s.prompt_ids for s in samples]
    lengths = [len(p) + len(s.response_ids) for p, s in zip(prompts, samples)]
    out: list = [None] * len(samples)
    for batch in micro_batches(model, lengths, cfg):  # (model: under torchrun, for the idle passes)
        flat = sequence_logprobs(model, [prompts[i] for i in batch], [samples[i].response_ids for i in batch], cfg)
        for i, logp in zip(batch, flat.split([len(samples[i].response_ids) for i in batch])):
            out[i] = logp.float().cpu()
    return out


def ppo_update(model, optimizer, samples: list, old_logp: list, advantages: Optional[list], cfg: Config, *,
               mini_batch: int, kl_coef: float = 0.0, ref_logp: Optional[list] = None,
               teacher_logp: Optional[list] = None, opd_coef: float = 0.0, rng: Optional[random.Random] = None) -> dict:
    """cfg.ppo_epochs passes over the turn-samples, one optimizer step per shuffled mini-batch of
    `mini_batch` of them, run in micro-batches of at most cfg.token_budget padded tokens (MiniBatches).
    combined_loss is the token-mean over the whole mini-batch (--loss-agg authors: theirs), however the
    micro-batches are cut. A NaN or infinite loss or gradient norm skips the step (step_is_finite).
    advantages[i]: (len(y_i),), None for pure OPD; teacher_logp: l^T, None for no OPD term."""
    rng = rng or random.Random(0)
    device = next(model.parameters()).device
    meter = UpdateMeter()  # sums of the loss terms, tokens, gradient norms: for metrics.jsonl (plumbing)
    batches = MiniBatches(model, samples, cfg, meter)  # response lengths; a mini-batch's micro-batches, denominators
    with_entropy = advantages is not None and cfg.entropy_coef > 0
    model.train()
    for _epoch in range(cfg.ppo_epochs):
        order = list(range(len(batches.response_lengths)))
        rng.shuffle(order)
        for start in range(0, len(order), mini_batch):
            mini = order[start:start + mini_batch]
            num_tokens = sum(batches.response_lengths[i] for i in mini)  # the mini-batch's token count
            denominators = batches.loss_denominators(mini, mini_batch)  # --loss-agg authors' D_i (exact: None)
            optimizer.zero_grad(set_to_none=True)
            finite = True
            for idx in batches.micro_batches(mini):
                scored = sequence_logprobs(model, [samples[i].prompt_ids for i in idx],
                                           [samples[i].response_ids for i in idx], cfg, with_entropy=with_entropy)
                logp, entropy = scored if with_entropy else (scored, None)
                cat = lambda per_sample: None if per_sample is None else (  # noqa: E731
                    torch.cat([per_sample[i] for i in idx]).to(device))
                loss, stats = combined_loss(
                    logp, cat(old_logp), torch.ones_like(logp), advantages=cat(advantages), clip=cfg.clip_eps,
                    dual_clip=cfg.dual_clip, ref_logp=cat(ref_logp), kl_coef=kl_coef, entropy=entropy,
                    entropy_coef=cfg.entropy_coef, teacher_logp=cat(teacher_logp), opd_coef=opd_coef,
                    num_tokens=num_tokens, denominators=cat(denominators))
                finite = finite and bool(torch.isfinite(loss))
                loss.backward()
                if finite:
                    meter.add(loss, stats)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)  # the norm before clipping
            if not step_is_finite(finite, grad_norm):  # a non-finite loss or gradient: no step
                meter.skipped += 1
                optimizer.zero_grad(set_to_none=True)
                continue
            set_warmup_lr(optimizer, cfg)  # linear warm-up over --lr-warmup-steps, then cfg.lr
            optimizer.step()
            meter.stepped(grad_norm)
            stop_if_weights_not_finite(model, optimizer)  # a diverged step is never trained on, nor saved
    optimizer.zero_grad(set_to_none=True)
    return meter.stats()


# ==================================================================================================
# 6. One iteration, a phase, the two phases
# ==================================================================================================


def phase_protocol(cfg: Config, distilling: bool) -> tuple[int, float]:
    """(turn-samples per optimizer step, KL-to-reference coefficient) of a phase, as the authors run
    them: phase 1 and --algo grpo 256 / 64 with KL 0.01; phase 2 with a teacher 128, no KL."""
    return (cfg.opd_mini_batch, cfg.opd_kl_coef) if distilling else (cfg.mini_batch, cfg.kl_coef)


def train_iteration(policy, optimizer, tokenizer, suite: TaskSuite, cfg: Config, tasks: list, *,
                    skills_in_prompt: bool, frozen: FrozenModels, grpo_loss: bool, mini_batch: int,
                    kl_coef: float, rng: random.Random, desc: str = "rollout") -> dict:
    """One iteration on `tasks`: rollout -> advantages -> log-probs -> update; returns its metrics.
    A teacher in `frozen` (phase 2, until retired) scores the sampled tokens on s_t^T: the gap K and
    the OPD term. grpo_loss=False (--algo opd) trains on lambda * L_OPD alone."""
    teacher = frozen.teacher
    sampler = multigpu.sampling_model(policy) if ddp else policy  # ddp: each rank samples with a whole copy
    samples, _, record = rollout(sampler, tokenizer, suite, tasks, cfg, group_size=cfg.group_size,
                                 skills_in_prompt=skills_in_prompt, with_teacher_prompts=teacher is not None,
                                 temperature=ROLLOUT_TEMPERATURE, desc=desc)
    refuse_a_broken_split(samples, tasks, cfg)  # (no episode started: the data is broken, not the run)
    # GRPO advantages: each turn's r_{i,t} normalised within its group, repeated over its tokens
    advantages = None
    if grpo_loss:
        group_advantages = grpo_advantages(torch.tensor([s.score for s in samples]),
                                           torch.tensor([s.group for s in samples]))
        advantages = [torch.full((len(s.response_ids),), float(a)) for s, a in zip(samples, group_advantages)]
    # log-probs of the sampled tokens: l^old (the rollout policy), l^T (the teacher, on s_t^T), the reference.
    # (`timed` adds each stage's seconds to the metrics; sampling_numerics compares l^old with the sampler's)
    with timed(record, "t_old_logp"):
        old_logp = response_logprobs(policy, samples, cfg)
    record.update(sampling_numerics(samples, old_logp))
    teacher_logp = ref_logp = None
    if teacher is not None:
        with timed(record, "t_teacher"):
            teacher_logp = response_logprobs(teacher, samples, cfg, teacher_prompt=True)
        every_token = multigpu.cat_over_ranks if ddp else torch.cat  # ddp: K over every rank's tokens
        record["gap"], record["gap_k3"] = teacher_student_gap(every_token(old_logp), every_token(teacher_logp))
    if frozen.reference is not None and kl_coef > 0:
        with timed(record, "t_reference"):
            ref_logp = response_logprobs(frozen.reference, samples, cfg)
    # the update: L = L_PPO + kl_coef KL_ref - entropy_coef H + lambda L_OPD (lambda = 0 without a teacher)
    record["opd_coef"] = cfg.opd_coef if teacher is not None else 0.0
    with timed(record, "t_update"):
        record.update(ppo_update(policy, optimizer, samples, old_logp, advantages, cfg, mini_batch=mini_batch,
                                 kl_coef=kl_coef, ref_logp=ref_logp, teacher_logp=teacher_logp,
                                 opd_coef=record["opd_coef"], rng=rng))
    return record


def train_phase(phase: str, policy, tokenizer, suite: TaskSuite, cfg: Config, run: Run, *,
                skills_in_prompt: bool, frozen: FrozenModels, grpo_loss: bool = True,
                retirement: Optional[Retirement] = None, resume: Optional[dict] = None) -> list:
    """One phase: its iterations, a validation every --eval-every, and (phase 2) the retirement rule
    fed with every K and validation; at retirement the teacher is released. Returns the validation
    successes. resume: a checkpoint's trainer state; training goes on after its iteration."""
    device = next(policy.parameters()).device
    optimizer = build_adamw(policy, cfg)
    rng = phase_rng(cfg.seed, phase)  # task sampling and mini-batches (and it seeds the rollouts' sampling)
    # a distilling phase keeps its protocol after retirement, and when a resume finds the teacher retired
    distilling = retirement is not None or frozen.teacher is not None
    mini_batch, kl_coef = phase_protocol(cfg, distilling)
    val_successes, start = restore_phase(resume, policy, optimizer, rng) if resume else ([], 0)  # (a resume)
    iterations = phase_iterations(cfg, phase)
    if resume is None and not distilling:  # the starting model, before any update, as the authors' phase-1
        validate(phase, -1, policy, tokenizer, suite, cfg, run, skills_in_prompt)  # and GRPO scripts do
    for iteration in run.measured_iterations(phase, start, iterations, device):  # (time, memory, a progress bar)
        tasks = [rng.choice(suite.train) for _ in range(cfg.batch_tasks)]
        if ddp:  # each rank plays its share: whole GRPO groups
            tasks = multigpu.share_of_tasks(tasks)
        teacher_active = frozen.teacher is not None
        record = {"phase": phase, "iteration": iteration, **train_iteration(
            policy, optimizer, tokenizer, suite, cfg, tasks, skills_in_prompt=skills_in_prompt, frozen=frozen,
            grpo_loss=grpo_loss, mini_batch=mini_batch, kl_coef=kl_coef, rng=rng, desc=f"{phase} {iteration} rollout")}
        rule_active = retirement is not None and teacher_active
        if rule_active:
            record.update(retirement.observe_gap(iteration, record["gap"]))
        if validation_due(cfg, iteration, iterations):  # the fixed panel: feeds S_T (phase 1) and the rule
            record.update(validate(phase, iteration, policy, tokenizer, suite, cfg, run, skills_in_prompt))
            val_successes.append(record["val_success"])
            if rule_active:
                record.update(retirement.observe_validation(iteration, record["val_success"]))
        if rule_active:
            retirement.observe_schedule(iteration)  # (--retire-at N)
        retired_now = rule_active and retirement.retired
        if retired_now:  # from the next iteration on: no OPD term, no teacher forward
            run.log_retirement(iteration, retirement, record)
            frozen.release_teacher()
        record.update(teacher_active=teacher_active, retired=bool(retirement and retirement.retired))
        run.end_iteration(record, policy, tokenizer, iterations, retired_now, optimizer=optimizer, rng=rng,
                          val_successes=val_successes, retirement=retirement)  # metrics.jsonl, a checkpoint
    return val_successes


def train_teacher(cfg: Config, suite: TaskSuite, run: Run, models: ModelLoader) -> None:
    """Phase 1, Skill-GRPO: the base model trained with GRPO while the task's skills sit in its
    prompt, then frozen and saved, with S_T (its validation success with skills) beside it."""
    policy, tokenizer, resume = models.policy("teacher")
    _, kl_coef = phase_protocol(cfg, distilling=False)
    frozen = FrozenModels(reference=models.frozen_copy(models.base) if kl_coef > 0 else None)
    run.log_memory_estimate(policy, "phase 1", frozen)
    validations = train_phase("teacher", policy, tokenizer, suite, cfg, run, skills_in_prompt=True, frozen=frozen,
                              resume=resume)
    report_teacher(policy, tokenizer, suite, cfg, run)  # the report panel, with skills (skill-grpo: without too)
    run.save_teacher(policy, tokenizer, teacher_success_rate(validations), validations)


def train_student(cfg: Config, suite: TaskSuite, run: Run, models: ModelLoader, teacher_success: Optional[float]):
    """Phase 2: a fresh, skill-free student from the base model, trained as ALGORITHMS[cfg.algo]
    says: GRPO, plus lambda * L_OPD toward the frozen teacher until it retires (or never)."""
    algorithm = ALGORITHMS[cfg.algo]
    policy, tokenizer, resume = models.policy("student")
    retirement = None
    if algorithm.student_opd:
        mode = "fixed" if cfg.retire_at is not None else algorithm.retirement
        retirement = Retirement(teacher_success, mode, cfg.window, cfg.alignment_threshold, cfg.rho, cfg.retire_at)
        if resume is not None and resume["retirement"] is not None:  # the rule's whole state, as it was saved
            retirement = Retirement(**resume["retirement"])
    _, kl_coef = phase_protocol(cfg, distilling=algorithm.student_opd)
    teacher_needed = retirement is not None and not retirement.retired  # (a resume may find it retired)
    frozen = FrozenModels(teacher=models.teacher(policy, tokenizer) if teacher_needed else None,
                          reference=models.frozen_copy(models.base) if kl_coef > 0 else None)
    run.log_memory_estimate(policy, "phase 2", frozen)
    train_phase("student", policy, tokenizer, suite, cfg, run, skills_in_prompt=False, frozen=frozen,
                grpo_loss=algorithm.student_grpo, retirement=retirement, resume=resume)
    run.log_report("student", evaluate(policy, tokenizer, suite, suite.report_panel, cfg, skills_in_prompt=False,
                                       desc="student report"))
    run.save_student(policy, tokenizer, teacher_success, retirement)


def train(cfg: Config, suite: TaskSuite, run: Run, models: ModelLoader) -> None:
    """The two phases, as ALGORITHMS[cfg.algo] says. A phase whose model is saved is not redone."""
    algorithm = ALGORITHMS[cfg.algo]
    if algorithm.phase_1 and not models.teacher_saved():
        train_teacher(cfg, suite, run, models)
        gc.collect()  # the teacher is saved; its training copy and optimizer leave memory
    if algorithm.phase_2 and "student" not in finished_phases(run.dir):
        teacher_success = recorded_teacher_success(cfg, models.teacher_dir) if algorithm.student_opd else None
        train_student(cfg, suite, run, models, teacher_success)


####################################################################################################
# The method ends here. Below: what one process needs to run it. The method calls these from below, each
# named for what it does (the equations are all above; what decides a step's inputs is said where it is called):
#   the models `ModelLoader` (`ModelLoader.policy`, `ModelLoader.teacher`, `ModelLoader.frozen_copy`,
#     `ModelLoader.teacher_saved`) and `FrozenModels` (`FrozenModels.release_teacher`)
#   evaluation `evaluate`, `validate`, `validation_due`, `report_teacher`, `recorded_teacher_success`
#   the prompt's budget `prompt_within_budget`; the phase's bookkeeping `phase_rng`, `restore_phase`,
#     `refuse_a_broken_split`
#   meters `RolloutMeter`, `UpdateMeter`, `timed`, `sampling_numerics`
#   the head in chunks `head_logprobs`; the update's `build_adamw`, `MiniBatches`, `micro_batches`,
#     `step_is_finite`, `set_warmup_lr`, `stop_if_weights_not_finite`
#   the run's settings `Config` (the hyper-parameters, and what only runs the run)
# and, from run_outputs.py, what the run writes into its folder: `Run` (`Run.measured_iterations`,
#   `Run.end_iteration`, `Run.log_retirement`, `Run.log_report`, `Run.log_memory_estimate`, `Run.save_teacher`,
#   `Run.save_student`), `phase_iterations`, `finished_phases`.
####################################################################################################


# ==================================================================================================
# 7. What the method calls: the rollout's meter, evaluation, the phase's bookkeeping, the models it holds
# ==================================================================================================


class RolloutMeter:
    """A rollout's timers and counts for metrics.jsonl, and its progress bar over turns (shown only
    in a terminal, not in log files)."""

    def __init__(self, max_turns: int, desc: str):
        self.timers = {"t_generate": 0.0, "t_env": 0.0}
        self.generated_tokens = self.generate_steps = self.prompts_truncated = 0
        self.bar = tqdm(total=max_turns, desc=desc, leave=False, dynamic_ncols=True,
                        disable=not sys.stderr.isatty() or not multigpu.main_process())

    def env(self):
        return timed(self.timers, "t_env")

    def generate(self):
        return timed(self.timers, "t_generate")

    def turn_done(self, responses: list, active: list, episodes: list) -> None:
        self.generated_tokens += sum(len(r.ids) for r in responses)
        self.generate_steps += max(len(r.ids) for r in responses)  # the batch decodes to its longest answer
        self.bar.update(1)
        self.bar.set_postfix(active=len(active), won=sum(e.won for e in episodes))

    def stats(self, episodes: list, samples: list, cfg: Config) -> dict:
        """Under torchrun: counts over every rank's episodes; times and decode steps the slowest rank's."""
        self.bar.close()
        won, n, turns, malformed, n_samples, errors, truncated, tokens = multigpu.sum_over_ranks(
            sum(e.won for e in episodes), len(episodes), sum(e.turns for e in episodes),
            sum(s.malformed for s in samples), len(samples), sum(e.error is not None for e in episodes),
            self.prompts_truncated, self.generated_tokens)
        timers = {key: multigpu.max_over_ranks(value) for key, value in self.timers.items()}
        steps = multigpu.max_over_ranks(self.generate_steps)
        n = max(n, 1)
        return {"success": won / n, "reward": cfg.success_reward * won / n, "turns": turns / n,
                "malformed_frac": malformed / max(n_samples, 1), "env_errors": errors,
                "prompts_truncated": truncated, "gen_tokens": tokens, "gen_steps": steps, "samples": n_samples,
                **timers, "gen_tokens_per_s": tokens / max(timers["t_generate"], 1e-9),
                "gen_ms_per_step": 1000 * timers["t_generate"] / max(steps, 1)}


def prompt_within_budget(tokenizer, episode: EpisodeState, cfg: Config) -> tuple[list, list, str, bool]:
    """(student prompt ids, the history and observation it shows, truncated): the last --history pairs and the
    observation, cut while the prompt is over --max-prompt-tokens: the oldest pair first, then the first half
    of a long observation (the admissible list alone may exceed the budget: it is kept, the budget is advisory)."""
    history, observation, truncated = episode.history[-cfg.history:] if cfg.history else [], \
        episode.observation, False
    while True:
        student = encode_prompt(tokenizer, build_user_message(
            cfg.env, episode.task, episode.turns, history, observation, episode.admissible))
        if len(student) <= cfg.max_prompt_tokens:
            return student, history, observation, truncated
        truncated = True
        if history:
            history = history[1:]
        elif len(observation) > 200:
            observation = "..." + observation[len(observation) // 2:]
        else:
            return student, history, observation, truncated


def evaluate(model, tokenizer, suite: TaskSuite, tasks: list, cfg: Config, skills_in_prompt: bool, desc: str) -> dict:
    """Success on a fixed panel (`tasks`) at the evaluation temperature, per task type and overall.

    The panels never change between runs (sorted games / the fixed validation goals); episodes
    are played in lock-step batches of --eval-batch (as few as that allows) with a fixed sampling seed
    (recorded), drawn from a forked RNG so that evaluating does not change the training run's random stream.
    """
    device = next(model.parameters()).device
    model, chunk = multigpu.sampling_model(model), cfg.eval_batch
    records = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(cfg.seed + 12345)
        for start in range(0, len(tasks), chunk):  # under torchrun: this rank's share of each (maybe none)
            batch = tasks[start:start + chunk][multigpu.rank()::multigpu.world_size()]
            _, episodes, _ = rollout(model, tokenizer, suite, batch, cfg, group_size=1,
                                     skills_in_prompt=skills_in_prompt, with_teacher_prompts=False,
                                     temperature=cfg.eval_temperature, desc=desc)
            records += [(e.task_type or suite.task_type(task), e.won, e.error) for e, task in zip(episodes, batch)]
    records = [record for part in multigpu.gather_objects(records) for record in part]
    played = [(task_type, won) for task_type, won, error in records if error is None or not error.startswith("reset")]
    if records and not played:  # every game of the panel is broken: its "0.0" would be read as a result
        raise SystemExit(f"retireopd: every episode of the {desc} ({len(records)} tasks) failed to start, the first "
                         f"with {records[0][2]}: the data is broken (check --alfworld-data / --webshop-data)")
    return {**success_by_task_type(played), "env_errors": len(records) - len(played), "skills": skills_in_prompt,
            "seed": cfg.seed + 12345, "temperature": cfg.eval_temperature}


def success_by_task_type(records):
    """Success rates from `(task_type, won)` pairs:
    {task_type: wins/episodes for each type seen, "overall": wins/episodes, "n": episodes}.
    With no records, overall is 0.0 and n is 0."""
    wins, counts = defaultdict(int), defaultdict(int)
    for task_type, won in records:
        counts[task_type] += 1
        wins[task_type] += int(bool(won))
    out = {t: wins[t] / counts[t] for t in sorted(counts)}
    n = sum(counts.values())
    out["overall"] = sum(wins.values()) / n if n else 0.0
    out["n"] = n
    return out


def steps_before_phases(cfg: Config) -> dict:
    """{phase: the iterations run before it}: both phases on one axis (a dashboard's steps, as the plot
    draws them); phase 2 starts at 0 without a phase 1 (--algo grpo)."""
    return {"teacher": 0, "student": phase_iterations(cfg, "teacher") if ALGORITHMS[cfg.algo].phase_1 else 0}


def validation_due(cfg: Config, iteration: int, iterations: int) -> bool:
    """Every eval_every iterations (1-based: 5, 10, ...), and at the phase's last iteration."""
    return (iteration + 1) % cfg.eval_every == 0 or iteration + 1 == iterations


def validate(phase: str, iteration: int, policy, tokenizer, suite: TaskSuite, cfg: Config, run: Run,
             skills_in_prompt: bool) -> dict:
    """A validation on the fixed panel, logged to eval.jsonl (iteration -1: before the phase's first
    update). With skills (phase 1, the teacher) it is played twice, as the authors do: with skills
    (what S_T reads) and without. Returns {"val_success": ...} (and "val_success_no_skills")."""
    out = {}
    for with_skills in (True, False) if skills_in_prompt else (False,):
        result = evaluate(policy, tokenizer, suite, suite.validation_panel, cfg, skills_in_prompt=with_skills,
                          desc=f"{phase} validation" + ("" if with_skills == skills_in_prompt else " (no skills)"))
        run.log("eval.jsonl", {"phase": phase, "iteration": iteration, "panel": "validation",
                               **({"before_training": True} if iteration < 0 else {}), **result})
        out["val_success" if with_skills == skills_in_prompt else "val_success_no_skills"] = result["overall"]
    if iteration < 0:
        tqdm.write(f"[retireopd] {phase} before training: validation {out['val_success']:.2f}"
                   + (f" with skills, {out['val_success_no_skills']:.2f} without" if skills_in_prompt else ""))
    return out


@contextlib.contextmanager
def timed(record: dict, key: str):
    """Add the seconds the block took to record[key] (the per-stage times of metrics.jsonl)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        record[key] = record.get(key, 0.0) + time.perf_counter() - start


def phase_rng(seed: int, phase: str) -> random.Random:
    """A phase's task-sampling and mini-batch RNG, from --seed and the phase. It also seeds torch's generator,
    which the rollouts sample from (under torchrun per rank: each plays other episodes)."""
    phase_seed = seed * 1000 + PHASES.index(phase)
    torch.manual_seed(phase_seed + (100_000 * multigpu.rank() if ddp else 0))
    return random.Random(phase_seed)


def refuse_a_broken_split(samples: list, tasks: list, cfg: Config) -> None:
    """An iteration none of whose episodes started (every game failed to load): the data is broken, not the run."""
    if not samples:
        raise SystemExit(f"retireopd: every episode of an iteration ({len(tasks)} tasks x {cfg.group_size}) failed to "
                         "start: the training split is broken (check --alfworld-data / --webshop-data)")


def report_teacher(policy, tokenizer, suite: TaskSuite, cfg: Config, run: Run) -> None:
    """Phase 1's end: the teacher on the report panel with skills (--algo skill-grpo: and without them)."""
    for with_skills in (True, False) if cfg.algo == "skill-grpo" else (True,):
        run.log_report("teacher", evaluate(policy, tokenizer, suite, suite.report_panel, cfg, with_skills,
                                           desc=f"teacher report ({'skills' if with_skills else 'no skills'})"))


def restore_phase(resume: dict, policy, optimizer, rng: random.Random) -> tuple[list, int]:
    """Continue a phase from a checkpoint's trainer state: AdamW's moments, the task-sampling and
    sampling RNGs. Returns (validation successes so far, the iteration to go on from)."""
    device = next(policy.parameters()).device
    multigpu.load_optimizer_state(policy, optimizer, resume.pop("optimizer"))  # pop: no second copy of the moments
    rng.setstate(resume["python_rng"])
    set_rng_state(resume["rng"], device)
    return list(resume["val_successes"]), resume["iteration"] + 1


def recorded_teacher_success(cfg: Config, teacher_dir: Path) -> float:
    """S_T for phase 2: recorded beside the teacher at the end of phase 1, or --teacher-success.
    S_T = 0 stops the run here for the adaptive rule: its competence test cannot be judged."""
    if problem := model_sources.teacher_folder_problem(teacher_dir, cfg.env):  # (damaged since the run started)
        raise SystemExit(f"retireopd: {problem}")
    stored = json.loads((teacher_dir / "retireopd.json").read_text(encoding="utf-8"))["teacher_success"]
    teacher_success = stored if cfg.teacher_success is None else cfg.teacher_success
    print(f"[retireopd] S_T = {teacher_success:.3f}: the teacher's validation success with skills"
          + (f" (--teacher-success; recorded {stored:.3f})" if cfg.teacher_success is not None else
             " (mean of its last two validations)"))
    if teacher_success <= 0 and ALGORITHMS[cfg.algo].retirement == "adaptive" and cfg.retire_at is None:
        raise SystemExit(f"retireopd: S_T = 0 (the teacher in {teacher_dir} never won a validation task), "
                         "so the competence test cannot be judged: set --teacher-success S, or retire on a "
                         "fixed schedule with --retire-at N")
    return teacher_success


@dataclass
class FrozenModels:
    """The frozen models a phase scores with: the teacher (phase 2, until it retires) and the base
    model as the KL reference (when its coefficient is > 0). This object holds their only
    references, so `release_teacher` frees the teacher's memory for good."""
    teacher: Optional[torch.nn.Module] = None
    reference: Optional[torch.nn.Module] = None

    def release_teacher(self) -> None:
        self.teacher = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def refuse_a_bad_teacher(cfg: Config, run: Run) -> None:
    """A teacher folder (--teacher, or the run's own teacher/) that is damaged, or the run's own holding another
    run's teacher, is refused in one line: at the start, before a resume changes anything in the folder."""
    teacher_dir = Path(cfg.teacher) if cfg.teacher else run.dir / "teacher"
    if teacher_dir.is_dir() and (problem := model_sources.teacher_folder_problem(teacher_dir, cfg.env)):
        raise SystemExit(f"retireopd: {problem}: restore that folder from a copy, or start a new run (a resume "
                         "never redoes phase 1 behind a student's checkpoints)")
    if not cfg.teacher and (problem := model_sources.foreign_teacher_problem(teacher_dir, run.run_id)):
        raise SystemExit(f"retireopd: {problem}")


class ModelLoader:
    """Loads a run's models: the base model (for the tiny demo, its warm-started copy, built once per
    run folder), a policy to train (the base model, or the checkpoint's when a resume continues that
    phase), and frozen copies for scoring (the teacher, the KL reference)."""

    def __init__(self, cfg: Config, run: Run, device: torch.device, checkpoint: Optional[Path] = None,
                 state: Optional[dict] = None):
        self.cfg, self.device, self.checkpoint, self.state = cfg, device, checkpoint, state
        self.base = cfg.model  # what both phases start from, and the KL reference
        if cfg.model == "tiny" and cfg.warm_start > 0:
            self.base = warm_started_tiny_base(run, device, cfg.warm_start)
        self.teacher_dir = Path(cfg.teacher) if cfg.teacher else run.dir / "teacher"  # (checked: refuse_a_bad_teacher)

    def teacher_saved(self) -> bool:
        return (self.teacher_dir / "retireopd.json").is_file()

    def policy(self, phase: str):
        """(model, tokenizer, the checkpoint's trainer state if this phase resumes, else None)."""
        resuming = self.state is not None and self.state["phase"] == phase
        model, tokenizer = load_policy(str(self.checkpoint) if resuming else self.base, self.device, torch.float32,
                                       self.cfg.seed)
        one_thread_if_small(model, self.device)
        if self.cfg.gradient_checkpointing and self.device.type == "cuda":
            model.activation_checkpointing_enable()
        if ddp:  # FSDP2: each rank holds a shard
            multigpu.shard(model, self.device, score_tokens)
        resume, self.state = (self.state if resuming else None), None  # handed over: held once
        return model, tokenizer, resume

    def teacher(self, student, tokenizer) -> torch.nn.Module:
        """The frozen teacher, once it is checked to score the student's tokens (teacher_fit_problem)."""
        teacher = self.frozen_copy(self.teacher_dir)
        if problem := model_sources.teacher_fit_problem(teacher, self.teacher_dir, student, tokenizer):
            raise SystemExit(f"retireopd: {problem}: a teacher must be trained from the student's base model "
                             f"(--model {self.cfg.model}), as phase 1 does")
        return teacher

    def frozen_copy(self, name) -> torch.nn.Module:
        """A frozen copy for scoring only (--frozen-dtype): the teacher, or the base model as reference."""
        dtype = torch.bfloat16 if self.cfg.frozen_dtype == "bfloat16" else torch.float32
        model, _ = load_policy(str(name), self.device, dtype, self.cfg.seed)
        model.requires_grad_(False).eval()
        return multigpu.shard(model, self.device, score_tokens) if ddp else model


# ==================================================================================================
# 8. Memory and the update's bookkeeping: the head in chunks, micro-batches, the step guard, AdamW
# ==================================================================================================
# How the scoring forward (section 5) fits in memory: the output head in chunks, the micro-batches it runs
# in; then what ppo_update keeps and checks around it (--loss-agg authors' denominators, the step guard).


def head_logprobs(hidden: torch.Tensor, tokens: torch.Tensor, lm_head: torch.nn.Module, chunk: int = 1024,
                  with_entropy: bool = False):
    """token_logprobs(lm_head(hidden), tokens), `chunk` rows at a time: with a 151,936-token vocabulary a
    (batch, seq, vocab) fp32 log-softmax takes gigabytes, so at most `chunk` rows of logits exist at once,
    recomputed in backward (checkpointed). The logits are fp32 even under bf16 autocast (a bf16 head's
    weights are cast up first; on a GPU the matmul runs in TF32: engine.use_tf32_head). hidden: (N, H) at
    the positions that predict the N response tokens. Returns (N,) float32 log-probs (and entropies)."""
    weight, bias = getattr(lm_head, "weight", None), getattr(lm_head, "bias", None)

    def one_chunk(h, y):
        with torch.autocast(h.device.type, enabled=False):
            bf16_head = weight is not None and weight.dtype != torch.float32
            logits = (torch.nn.functional.linear(h.float(), weight.float(), None if bias is None else bias.float())
                      if bf16_head else lm_head(h.float()).float())
        return token_logprobs(logits, y, with_entropy=True) if with_entropy else (token_logprobs(logits, y), None)

    chunks = [(hidden[start:start + chunk], tokens[start:start + chunk]) for start in range(0, len(hidden), chunk)]
    scored = [torch.utils.checkpoint.checkpoint(one_chunk, h, y, use_reentrant=False)
              if torch.is_grad_enabled() and h.requires_grad else one_chunk(h, y) for h, y in chunks]
    logp = torch.cat([logp for logp, _ in scored]) if scored else hidden.new_zeros(0, dtype=torch.float32)
    if not with_entropy:
        return logp
    return logp, torch.cat([entropy for _, entropy in scored]) if scored else torch.zeros_like(logp)


def micro_batch_denominators(lengths: list, rows: int = 8, mini_batch: Optional[int] = None) -> list:
    """--loss-agg authors: how their update averages a mini-batch's token losses l_{i,k}. (the update)

        exact (ours):  L = sum_i sum_k l_{i,k} / N,              N = sum_i n_i       (one token-mean)
        authors:       L = (1/S) sum_m [sum_{i in m} sum_k l_{i,k} / T_m],  i.e. D_i = S T_{m(i)}

    lengths: n_i, the response tokens of each turn-sample of the mini-batch, in its (shuffled) order,
    cut in that order into groups m of `rows` samples (their micro-batches: 8 rows per GPU), T_m the
    tokens of group m; S = ceil(mini_batch / rows), the accumulation steps of a full mini-batch (their
    loss / gradient_accumulation; mini_batch defaults to len(lengths)). Each group's token-mean counts
    alike, so a token of a short group weighs more; equal lengths, a full mini-batch of whole groups: D_i = N,
    and a shorter last mini-batch weighs less, as theirs would. Returns D_i, one per sample."""
    steps = -(-(mini_batch or len(lengths)) // rows)
    denominators = []
    for start in range(0, len(lengths), rows):
        group = lengths[start:start + rows]
        denominators += [steps * sum(group)] * len(group)
    return denominators


def make_micro_batches(lengths: list, token_budget: int) -> list:
    """Group sample indices into micro-batches of at most `token_budget` padded tokens.

    Samples are sorted by length first, so each micro-batch holds sequences of similar length
    and padding stays small. A sequence longer than the budget gets a micro-batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, current = [], []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and (len(current) + 1) * longest > token_budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def micro_batches(model, lengths: list, cfg: Config, backward: bool = False):
    """make_micro_batches(lengths, cfg.token_budget): the passes a scoring (and, with backward, an update)
    makes. Under torchrun each forward and backward of a sharded model is collective, so every rank
    then makes as many passes as the rank with the most, the others idle passes."""
    batches = make_micro_batches(lengths, cfg.token_budget)
    if ddp:
        return multigpu.in_lockstep(batches, lambda: idle_pass(model, cfg, backward))
    return batches


def idle_pass(model, cfg: Config, backward: bool = False) -> None:
    """One forward (and backward) that changes nothing: a one-token response, its loss times 0."""
    logp = sequence_logprobs(model, [[0]], [[0]], cfg)
    if backward:
        (logp.sum() * 0).backward()


def sampling_numerics(samples: list, old_logp: list) -> dict:
    """|l^sample - l^old| over every response token: the log-prob each token had when it was
    sampled (cached decode, TurnSample.sample_logp) against the scoring pass's (full forward).

    Both are pi_old at temperature 1, so the difference measures numerics only: ~1e-7 in fp32 on CPU;
    on a GPU under bf16 autocast, how far the PPO ratio starts from 1 (its metrics keys say "gap";
    not the gap K). Samples without a recorded log-prob (a scripted generate) are left out; no key at
    all when none has one.
    """
    pairs = [(s.sample_logp, old) for s, old in zip(samples, old_logp) if s.sample_logp is not None]
    differences = multigpu.cat_over_ranks([(sampled - old).abs() for sampled, old in pairs])
    if not len(differences):
        return {}
    return {"sample_logp_gap_mean": float(differences.mean()), "sample_logp_gap_max": float(differences.max())}


def optimizer_steps_taken(optimizer: torch.optim.Optimizer) -> int:
    """Steps this AdamW has taken (its per-parameter step count; restored with its state)."""
    state = optimizer.state.get(optimizer.param_groups[0]["params"][0], {})
    return int(state["step"]) if "step" in state else 0


def stop_if_weights_not_finite(model, optimizer) -> None:
    """After an optimizer step: weights that hold a NaN or an infinity end the run, in one line (every
    rank stops). The step cannot be undone, and the weights are not saved (the last checkpoint holds
    those before it)."""
    if multigpu.all_ranks(non_finite_tensors(model.parameters()) == 0):
        return
    lr = optimizer.param_groups[0]["lr"]
    raise SystemExit(f"retireopd: optimizer step {optimizer_steps_taken(optimizer)} (lr {lr:g}) left the weights with "
                     f"NaN or infinite values: the update diverged, and nothing of it was saved; the last checkpoint "
                     "holds the weights before it. Start again with a lower --lr (or a smaller --grad-clip)")


def build_adamw(model, cfg: Config) -> torch.optim.AdamW:
    """AdamW over the fp32 master weights; fused on CUDA: one kernel per step, and no temporary
    copy of the parameters (the default multi-tensor path allocates about one fp32 copy, ~6 GB
    at 1.5B). Plain on CPU."""
    on_cuda = next(model.parameters()).device.type == "cuda"
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                             fused=True if on_cuda else None)


class MiniBatches:
    """The turn-samples that ppo_update's mini-batches draw, and the micro-batches it runs them in.

    One process: `response_lengths` are its samples', and a mini-batch's samples are all its own.
    Under torchrun the mini-batches are drawn from the global batch (every rank's samples, in rank
    order) with the same seed on every rank, and each rank runs its own samples of each (indices
    into its own list), in lockstep with the others; a step is taken only if every rank's losses
    and the gradient norm (over every rank's shards) were finite.
    """

    def __init__(self, model, samples: list, cfg: Config, meter: UpdateMeter):
        self.model, self.samples, self.cfg, self.meter = model, samples, cfg, meter
        self.response_lengths = [len(s.response_ids) for s in samples]  # what the mini-batches draw from
        self.offset = 0  # where this process's samples start in the batch
        if ddp:  # every rank's lengths, and where this rank's samples start among them
            self.offset, self.response_lengths = multigpu.global_batch(samples)

    def own(self, mini: list) -> list:
        """This process's samples of the mini-batch `mini`, as indices into its own list."""
        return [i - self.offset for i in mini if 0 <= i - self.offset < len(self.samples)]

    def loss_denominators(self, mini: list, mini_batch: int) -> Optional[dict]:
        """--loss-agg authors: {own sample: its D_i (micro_batch_denominators) on each of its response
        tokens} for the mini-batch `mini`; None with --loss-agg exact (token_mean's count instead)."""
        if self.cfg.loss_agg == "exact":
            return None
        value_of = dict(zip(mini, micro_batch_denominators([self.response_lengths[i] for i in mini],
                                                           self.cfg.micro_batch_rows, mini_batch)))
        return {i: torch.full((self.response_lengths[self.offset + i],), float(value_of[self.offset + i]))
                for i in self.own(mini)}

    def micro_batches(self, mini: list):
        """The micro-batches (lists of own sample indices) of this process's part of `mini`, each counted
        in the meter's tokens trained and padded as it is run."""
        own = self.own(mini)
        lengths = [len(self.samples[i].prompt_ids) + len(self.samples[i].response_ids) for i in own]
        for batch in micro_batches(self.model, lengths, self.cfg, backward=True):
            self.meter.count_tokens([lengths[j] for j in batch])
            yield [own[j] for j in batch]


def step_is_finite(finite: bool, grad_norm: torch.Tensor) -> bool:
    """An optimizer step is taken only if the mini-batch's losses and the gradient norm were finite (under
    torchrun: every rank's losses, and the norm over every rank's shards)."""
    if ddp:
        finite = multigpu.all_ranks(finite)
    return finite and bool(torch.isfinite(multigpu.full_tensor(grad_norm)))


class UpdateMeter:
    """ppo_update's numbers for metrics.jsonl: the sums of each loss term and stat (token-means that add
    up over micro-batches; averaged over optimizer steps), tokens trained and padded, gradient norms,
    optimizer steps taken and skipped."""

    def __init__(self):
        self.totals, self.grad_norms = {}, []
        self.steps = self.skipped = self.trained_tokens = self.padded_tokens = 0

    def count_tokens(self, lengths: list) -> None:
        """The tokens of one micro-batch (its sequences' lengths): real, and padded."""
        self.padded_tokens += len(lengths) * max(lengths)
        self.trained_tokens += sum(lengths)

    def add(self, loss: torch.Tensor, stats: dict) -> None:
        for key, value in {**stats, "loss": float(loss.detach())}.items():
            self.totals[key] = self.totals.get(key, 0.0) + value

    def stepped(self, grad_norm: torch.Tensor) -> None:
        self.steps += 1
        self.grad_norms.append(float(multigpu.full_tensor(grad_norm)))

    def stats(self) -> dict:
        """Under torchrun the terms and token counts are summed over the ranks: each rank's terms are
        its part of the global token-mean. Steps and gradient norms are the same on every rank."""
        totals = defaultdict(float)  # (by key: a rank whose every loss was skipped as non-finite has none)
        for part in multigpu.gather_objects(self.totals):
            for key, value in part.items():
                totals[key] += value
        trained, padded = multigpu.sum_over_ranks(self.trained_tokens, self.padded_tokens)
        n = max(self.steps + self.skipped, 1)
        return {**{key: value / n for key, value in totals.items()}, "optimizer_steps": self.steps,
                "skipped_steps": self.skipped, "trained_tokens": trained,
                "grad_norm": sum(self.grad_norms) / max(len(self.grad_norms), 1),
                "padding_frac": 1 - trained / max(padded, 1)}


def set_warmup_lr(optimizer: torch.optim.Optimizer, cfg: Config) -> None:
    """Linear learning-rate warm-up over the first --lr-warmup-steps optimizer steps, then cfg.lr."""
    for group in optimizer.param_groups:
        group["lr"] = cfg.lr * min(1.0, (optimizer_steps_taken(optimizer) + 1) / max(cfg.lr_warmup_steps, 1))


# ==================================================================================================
# 9. Loading a model: Qwen2.5 checkpoints, aliases (common.py), the models built in code (tiny.py)
# ==================================================================================================


def load_policy(name: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """(model, tokenizer) for a hub id, local folder, alias, `random:<alias>` or `tiny`.

    The model's own generation config is replaced by a blank one: Qwen2.5-Instruct ships
    top_k=20, top_p=0.8, temperature=0.7, repetition_penalty=1.05, and RL needs samples from the
    full distribution (log-probs of the policy we actually train). rollout() passes its settings
    explicitly as well.
    """
    if name == "tiny" or name.startswith("random:"):
        tokenizer = tiny.build_tiny_tokenizer(prompt_format())
        model = tiny.build_model(name, dtype, seed, tokenizer)
    else:
        path = resolve_model_name(name)
        cached_only = model_sources.from_the_cache_only(path)
        try:  # never a pickle, never code from the model's folder (model_sources.saved_model_problem refuses auto_map)
            tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=cached_only,
                                                                   trust_remote_code=False)
            model, loaded = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, local_files_only=cached_only, use_safetensors=True, trust_remote_code=False,
                output_loading_info=True)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError, AttributeError) as error:
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
            raise SystemExit(f"retireopd: {name} does not load as a model and tokenizer ({type(error).__name__}: "
                             f"{reason})") from None
        if not_loaded := sorted(key for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")
                                for key in map(str, loaded.get(kind) or ())):  # (a model loads whole or not at all)
            raise SystemExit(f"retireopd: {name}: its weights are not the whole model its config.json describes "
                             f"({', '.join(not_loaded[:3])}{' ...' if len(not_loaded) > 3 else ''} missing, unexpected "
                             "or of another shape): transformers would have initialised them at random")
    if bad := non_finite_tensors(model.parameters()):
        raise SystemExit(f"retireopd: {name}: {bad} of the model's weight tensors hold NaN or infinite values: "
                         "not a usable model")
    if not tokenizer.chat_template:  # (an instruct model's: the prompts are built with it)
        raise SystemExit(f"retireopd: {name}: its tokenizer has no chat template: pass an instruct model's folder")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # generation continues at the right edge of every prompt
    eos = model.generation_config.eos_token_id or tokenizer.eos_token_id
    model.generation_config = transformers.GenerationConfig(eos_token_id=eos,
                                                            pad_token_id=tokenizer.pad_token_id)
    return model.to(device), tokenizer


def prompt_format() -> tiny.PromptFormat:
    """This file's prompts (section 2), for the models built in code: the tiny tokenizer's vocabulary is
    trained on them, and the warm start answers them."""
    return tiny.PromptFormat([*ENV_INTRO.values(), FORMAT_INSTRUCTION], SKILLS, build_user_message, encode_prompt)


SHIPPED_BASE = Path(__file__).resolve().parent / "tiny_base"  # the demo's base model, built by warm_start (tiny.py)


def warm_started_tiny_base(run: Run, device: torch.device, steps: int,
                           shipped: Optional[Path] = SHIPPED_BASE) -> str:
    """The offline demo's base model, RUN_DIR/tiny_base: the tiny model after `steps` warm-start steps
    (tiny.warm_start), once per run folder (a resume, or a folder that already has it, reuses it). It
    stands in for a pretrained checkpoint, so seed 0 whatever --seed says, and, as a checkpoint is
    downloaded, the project ships it (SHIPPED_BASE, 500 steps): copied when what it was built from is
    what this code would build it from (tiny.warm_start_key), built here otherwise (or with shipped=None)."""
    folder = run.dir / "tiny_base"
    if multigpu.main_process() and not (folder / "retireopd.json").is_file():
        model, tokenizer = load_policy("tiny", device, torch.float32, seed=0)
        key = tiny.warm_start_key(steps, 0, tokenizer, prompt_format())
        with contextlib.suppress(OSError, ValueError):
            if shipped is not None and json.loads((shipped / "retireopd.json").read_text(encoding="utf-8")).get("key") == key:
                remove_entry(run.dir / "tiny_base.tmp")
                shutil.copytree(shipped, run.dir / "tiny_base.tmp")
                fsync_tree(run.dir / "tiny_base.tmp")
                rename_entry(run.dir / "tiny_base.tmp", folder, run.dir)
                print(f"[retireopd] base model: {steps} warm-start steps, the project's tiny_base/ (built by this code)")
        if not (folder / "retireopd.json").is_file():
            one_thread_if_small(model, device)
            scoring = Config(model="tiny", env="kitchen", token_budget=1 << 30)  # (sequence_logprobs reads its chunk)
            report = tiny.warm_start(model, tokenizer, steps, seed=0, prompts=prompt_format(), answer_logprobs=(
                lambda model, prompts, answers: sequence_logprobs(model, prompts, answers, scoring)))
            print(f"[retireopd] warm start: {steps} behaviour-cloning steps (the answer format, reading a recipe's "
                  f"first step, other dishes' recipes; none of the demo's), loss {report['first_loss']:.2f} -> "
                  f"{report['last_loss']:.3f}")
            run.save_model(model, tokenizer, "tiny_base", {"warm_start": report, "key": key})
    multigpu.barrier()  # the other ranks load it from there
    return str(folder)


SMALL_MODEL_PARAMS = 20_000_000


def one_thread_if_small(model, device: torch.device) -> None:
    """On a CPU, a model below SMALL_MODEL_PARAMS runs on one torch thread: its matrices are too
    small to gain from threads, and on a busy 2-core machine two threads were measured 4-20x
    slower for the tiny model (spinning threads of competing processes). Bigger models keep
    torch's default (set OMP_NUM_THREADS to choose)."""
    if device.type == "cpu" and sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMS:
        torch.set_num_threads(1)


# ==================================================================================================
# 10. The run's settings (Config), the command line and main
# ==================================================================================================


@dataclass
class Config(Hyperparameters):
    """The run's settings: the method's hyper-parameters (section 1), then what only runs the run."""
    # --- data ---
    alfworld_data: Optional[str] = arg(None, "root with json_2.1.1/ (default $ALFWORLD_DATA, else ~/.cache/alfworld); "
                                       "\"fixtures\": our own tiny games (the tiny preset's default)")
    webshop_data: Optional[str] = arg(None, "the official WebShop files (default $WEBSHOP_DATA, else built in)")
    webshop_reward: str = arg("faithful", "faithful (the original's reward, its option bug kept) | fixed")
    teacher: Optional[str] = arg(None, "reuse a saved phase-1 teacher folder (skips phase 1)")
    warm_start: int = arg(0, "tiny only: behaviour-cloning steps that teach the answer format and reading a skill "
                          "block, on invented dishes (docs/running.md: the offline demo); 0: the random tiny model")
    # --- devices and memory budgets (how fast, never what is computed; but frozen_dtype bfloat16 rounds l^T) ---
    device: str = arg("auto", "auto | cuda | cuda:N | cpu")
    env_workers: int = arg(0, "ALFWorld: processes that step the games in parallel (0: in this process)")
    sampler: str = arg("eager", "eager: the reference decode loop | static: a static KV cache (bf16 on a GPU) whose "
                       "decode step is compiled into CUDA graphs on a GPU (engine.py; docs/cost.md) | auto: static on a "
                       "GPU, eager on CPU")
    prefill_batch: int = arg(16, "prompts prefilled per forward in a rollout turn (the prefill's memory grows with "
                             "it times the prompt width, not with B*G); 0: all of them in one forward")
    eval_batch: int = arg(256, "episodes per lock-step batch of a validation or report: a panel of n tasks is played "
                          "in ceil(n / this) batches (the memory estimate counts one)")
    token_budget: int = arg(16384, "padded tokens per micro-batch (forward/backward chunk)")
    logprob_chunk: int = arg(1024, "response positions per lm_head/log-softmax chunk")
    gradient_checkpointing: bool = arg(True, "recompute activations in backward (GPU only; saves memory)")
    frozen_dtype: str = arg("float32", "teacher/reference weights: float32 (the student's numerics, so identical "
                            "models give K = 0 exactly) or bfloat16 (half the memory, e.g. for 3B; docs/choices.md: "
                            "Precision)")
    # --- outputs ---
    run_dir: Optional[str] = arg(None, "output folder (default runs/<env>-<algo>-<time>)")
    save_every: int = arg(10, "resumable checkpoint every N iterations (also at phase ends, retirement; 0: only there)")
    keep_checkpoints: int = arg(2, "how many resumable checkpoints to keep, the newest (>= 1; older ones are deleted)")
    report_to: str = arg("none", "none | tensorboard (RUN_DIR/tensorboard) | wandb: a live dashboard of every metrics "
                         "line, evaluation and the retirement (docs/metrics.md); --resume may change it")


EXAMPLES = """examples:
  python retireopd.py                                     # the offline CPU demo (--model tiny, the kitchen), ~2 min
  python retireopd.py --algo grpo                         # the demo's GRPO baseline, to --compare
  python retireopd.py --env alfworld                      # the code paths on fixture ALFWorld games we write
  python retireopd.py --show-prompts --env webshop        # a student's and a teacher's first prompt, then exit
  python retireopd.py --model Qwen2.5-1.5B --alfworld-data ~/.cache/alfworld --env-workers 8
  python retireopd.py --model Qwen2.5-1.5B --env webshop --webshop-data DIR
  python retireopd.py --model random:Qwen2.5-1.5B --iterations 1   # real shapes, random weights
  torchrun --nproc_per_node 4 retireopd.py --model Qwen2.5-7B ...  # several GPUs: FSDP2 (multigpu.py)
  python retireopd.py --algo grpo | skill-grpo | opd | grpo+opd | retireopd --retire-at 40
  python retireopd.py --resume RUN_DIR | --plot RUN_DIR | --compare RUN_DIR RUN_DIR"""


def build_parser(actions: bool = True) -> argparse.ArgumentParser:
    """One flag per Config field, its help text from the field's metadata (arg), plus (actions) this
    script's own: --resume, --plot, --compare, --show-prompts (bench.py takes the fields' flags alone)."""
    parser = argparse.ArgumentParser(
        description="RetireOPD: self-retiring on-policy distillation for agentic RL (arXiv 2609.20784). Without "
        "--model, the offline demo (--model tiny); with a real model, the paper's protocol. A flag marked "
        "[default: X; tiny: Y] defaults to Y with --model tiny (tiny.TINY_PRESET), to X with any other model.",
        epilog=EXAMPLES if actions else None, formatter_class=argparse.RawDescriptionHelpFormatter)
    if actions:
        parser.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run from its last checkpoint")
        parser.add_argument("--plot", metavar="RUN_DIR", help="only draw RUN_DIR/plot.png and exit")
        parser.add_argument("--compare", metavar="RUN_DIR", nargs="+", help="only draw several runs on one figure")
        parser.add_argument("--benchmark", action="store_true", help=argparse.SUPPRESS)  # (now bench.py: a pointer)
        parser.add_argument("--show-prompts", action="store_true", help="print the student's and the teacher's "
                            "first-turn prompt of one task, as the model sees them, and exit")
    for f in dataclasses.fields(Config):
        preset = f"; tiny: {tiny.TINY_PRESET[f.name]}" if f.name in tiny.TINY_PRESET else ""  # --model tiny's
        text = f"{f.metadata['help']} [default: {f.default}{preset}]".replace("%", "%%")
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=text)
        else:
            kind = {"int": int, "float": float}.get(str(f.type).replace("Optional[", "").rstrip("]"), str)
            parser.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=text)
    return parser


def parse_config(given: dict) -> Config:
    """Flags given on the command line -> the resolved Config.

    Values the user did not give come from the `tiny` preset (for --model tiny) or the Config
    defaults, then the per-benchmark defaults (max turns, prompt budget, mini-batch) fill in.
    """
    values = dict(tiny.TINY_PRESET) if given.get("model", Config.model) == "tiny" else {}
    if values and given.get("env", values["env"]) != "kitchen":
        values.update(tiny.TINY_PRESET_ELSEWHERE)
    if "iterations" in given and "teacher_iterations" not in given:
        values.pop("teacher_iterations", None)  # --iterations N alone sets both phases
    values.update(given)
    cfg = Config(**values)
    if cfg.model == "tiny" and cfg.env != "kitchen" and "retire_at" not in given:
        cfg.retire_at = tiny.retire_halfway(cfg.iterations, cfg.algo, cfg.teacher_success)  # (it never wins there)
    alfworld = cfg.env == "alfworld"
    settings.resolve_data_folders(cfg)
    cfg.max_turns = (50 if alfworld else 15) if cfg.max_turns is None else cfg.max_turns  # (0 is refused below)
    cfg.max_prompt_tokens = (2048 if alfworld else 4096) if cfg.max_prompt_tokens is None else cfg.max_prompt_tokens
    cfg.mini_batch = (256 if alfworld else 64) if cfg.mini_batch is None else cfg.mini_batch
    if cfg.run_dir is None:
        cfg.run_dir = str(Path("runs") / f"{cfg.env}-{cfg.algo}-{time.strftime('%Y%m%d-%H%M%S')}")
    settings.validate_config(cfg, ALGORITHMS)
    return cfg


def resume_config(run_dir: str, given: dict) -> Config:
    """The Config of the run being resumed (settings.saved_settings: flags that contradict it are an error)."""
    cfg = Config(**settings.saved_settings(run_dir, given, {f.name: f.type for f in dataclasses.fields(Config)}))
    settings.validate_config(cfg, ALGORITHMS, notes=False)
    return cfg


def show_prompts(cfg: Config) -> None:
    """--show-prompts: the student's prompt s_t and the teacher's s_t^T at the first turn of the validation
    panel's first task, decoded from their token ids with the special tokens (the chat template), as the
    model reads them. Nothing is written to the run folder, and no model is loaded: only the tokenizer."""
    import tempfile
    with tempfile.TemporaryDirectory() as scratch:  # (ALFWorld's fixture games are written there)
        suite = settings.open_task_suite(dataclasses.replace(cfg, run_dir=scratch))
        task = suite.validation_panel[0]
        episode = EpisodeState(suite.new_episode(task), group=0)
        start_episodes([episode])
        if cfg.model == "tiny" or cfg.model.startswith("random:"):
            tokenizer = tiny.build_tiny_tokenizer(prompt_format())
        else:
            path = resolve_model_name(cfg.model)
            cached_only = model_sources.from_the_cache_only(path)
            tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=cached_only,
                                                                   trust_remote_code=False)
        student, teacher, _ = episode_prompts(tokenizer, episode, cfg, skill_text(cfg.env, episode.task_type))
        close_episodes([episode])
        suite.close()
    for who, ids in (("student (s_t)", student), ("teacher (s_t^T: the same, plus the skill block)", teacher)):
        print(f"===== {who}: {len(ids)} tokens, {cfg.model}, --env {cfg.env}, task {episode.task!r} =====")
        print(tokenizer.decode(ids))


def main(argv: Optional[list] = None) -> Optional[Path]:
    transformers.utils.logging.disable_progress_bar()  # its loading and shard-writing bars: the run's own say it
    huggingface_hub.utils.enable_progress_bars()  # (a model's download keeps its bar)
    args = vars(build_parser().parse_args(argv))
    if problem := settings.path_flag_problem(args):  # an empty path (an unset variable), a file to resume ...
        raise SystemExit(f"retireopd: {problem}")
    resume_dir, plot_dir, compare = args.pop("resume"), args.pop("plot"), args.pop("compare")
    if plot_dir or compare:
        try:
            out = dashboards.plot_runs([plot_dir] if plot_dir else compare)
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
            raise SystemExit(f"retireopd: cannot draw {', '.join([plot_dir] if plot_dir else compare)}: their logs are "
                             f"not a run's of this script ({type(error).__name__}: {error})") from None
        print(f"[retireopd] wrote {out}" if out else "")
        return out
    if args.pop("benchmark"):
        raise SystemExit("retireopd: the benchmark is a script of its own: python bench.py, with the same flags")
    prompts_only = args.pop("show_prompts")
    cfg = resume_config(resume_dir, args) if resume_dir else parse_config(args)
    if prompts_only:
        if problem := model_sources.model_source_problem(cfg.model):
            raise SystemExit(f"retireopd: {problem}")
        show_prompts(cfg)
        return None
    if resume_dir and any(e.get("event") == "done" for e in read_jsonl(Path(resume_dir) / "events.jsonl")):
        print(f"[retireopd] {resume_dir} already finished: nothing to resume (its outputs are there)")
        return Path(resume_dir)
    if problem := model_sources.model_source_problem(cfg.model):  # before the data and before anything is written
        raise SystemExit(f"retireopd: {problem}")
    if problem := dashboards.Tracker.problem(cfg.report_to):
        raise SystemExit(f"retireopd: {problem}")
    # one process per run folder: rank 0 locks it (under torchrun the other ranks wait in start_processes)
    created = run_folder.check_run_folder(cfg.run_dir, resuming=bool(resume_dir)) if multigpu.main_process() else []
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = multigpu.start_processes(cfg)  # the device; under torchrun also the process group
    use_tf32_head(device)  # (the fp32 output head on a GPU's tensor cores: engine.py)
    # data problems surface here, in one line, before any model is loaded
    suite = settings.open_task_suite(cfg, created)
    run = Run(cfg, run_folder.run_inputs(cfg, suite))
    # the newest whole checkpoint (the optimizer state moves to the GPU when it is loaded into AdamW);
    # none: interrupted before its first checkpoint, start over. What is redone leaves the logs first.
    checkpoint, state = resumable_checkpoint(run) if resume_dir else (None, None)
    if state is not None and state.get("world_size", 1) != multigpu.world_size():
        raise SystemExit(f"retireopd: {checkpoint} was written by {state.get('world_size', 1)} process(es): resume "
                         f"it with as many (torchrun --nproc_per_node {state.get('world_size', 1)}, or python for 1)")
    algorithm, last_iterations = ALGORITHMS[cfg.algo], {p: phase_iterations(cfg, p) - 1 for p in PHASES}
    if state and algorithm.student_opd and (problem := repairs.lost_teacher_problem(
            run.dir, checkpoint, state, Path(cfg.teacher) if cfg.teacher else run.dir / "teacher")):
        raise SystemExit(f"retireopd: {problem}")
    refuse_a_bad_teacher(cfg, run)  # (before a resume trims the logs: a refused command changes nothing)
    if resume_dir:
        if multigpu.main_process():  # (-2: nothing done; -1 is the validation before training)
            repairs.truncate_logs(run.dir, state["phase"] if state else PHASES[0], state["iteration"] if state else -2,
                                 finished_phases(run.dir), last_iterations)
            trained = tuple(p for p, runs in zip(PHASES, (algorithm.phase_1 and not cfg.teacher,
                                                          algorithm.phase_2)) if runs)
            if state and (hole := repairs.log_holes(run.dir, trained, state["phase"], state["iteration"],
                                                   last_iterations)):
                print(hole)
        run.log("events.jsonl", {"event": "resume", "checkpoint": checkpoint.name if checkpoint else None})
        print(f"[retireopd] resuming {run.dir} from checkpoint {checkpoint.name}" if checkpoint else
              f"[retireopd] {run.dir} has no checkpoint yet (the first is written after "
              f"{cfg.save_every or cfg.iterations} iterations): starting it over")
    print(f"[retireopd] {cfg.algo} on {cfg.env} ({len(suite.train)} training tasks, validation panel of "
          f"{len(suite.validation_panel)}, report panel of {len(suite.report_panel)}) with {cfg.model} on "
          f"{device}" + (f" and {multigpu.world_size() - 1} more process(es)" if ddp else "")
          + f"; run folder {run.dir}")

    if cfg.report_to != "none" and multigpu.main_process():  # the live dashboard (rank 0 reports)
        steps_before = steps_before_phases(cfg)
        redone = dashboards.tracker_step(steps_before, state["phase"], state["iteration"] + 1) if state else 0
        run.tracker = dashboards.Tracker(cfg, run.dir, run.run_id, steps_before,
                                         purge_step=redone if resume_dir else None)
    models = ModelLoader(cfg, run, device, checkpoint, state)
    run.lap("start and base model")
    del state  # ModelLoader holds the checkpoint's trainer state (AdamW's moments) alone, and hands it over once
    train(cfg, suite, run, models)
    suite.close()  # worker processes, if any (they are daemons: a crash takes them down too)
    run.log("events.jsonl", {"event": "done", "wall_s": round(time.time() - run.started, 1), "stages_s": run.laps})
    if run.tracker is not None:
        run.tracker.close()
    multigpu.stop_processes()
    if not multigpu.main_process():
        return run.dir
    run_folder.release_run_folders()
    plot = dashboards.plot_runs([run.dir])
    print(f"[retireopd] summary: {dashboards.run_summary(run.dir)}")
    split = ", ".join(f"{stage} {seconds:.0f}s" for stage, seconds in run.laps.items())
    print(f"[retireopd] done in {time.time() - run.started:.0f}s ({split}); outputs in {run.dir}"
          + (f"; plot {plot}" if plot else ""))
    return run.dir


if __name__ == "__main__":
    for name in ("SIGTERM", "SIGHUP", "SIGBREAK"):  # a scheduler's stop, a closed terminal, Windows' Ctrl-Break
        if hasattr(signal, name):  # (those this platform has): as Ctrl-C, but at the iteration's end, checkpointed
            signal.signal(getattr(signal, name), stop_at_the_next_safe_point)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # (not where the shell ignores Ctrl-C)
        signal.signal(signal.SIGINT, interrupt_once)
    try:
        main()
        multigpu.exit_at_once()  # (torchrun: without the interpreter's teardown, where gloo's threads may abort)
    except KeyboardInterrupt as interrupt:
        how = (f"stopped by {signal.Signals(interrupt.signum).name} {interrupt.where}"
               if isinstance(interrupt, Stopped) else "interrupted")
        print(stop_line(how), file=sys.stderr, flush=True)
        INTERRUPTED.append("said")
        sys.exit(128 + interrupt.signum if isinstance(interrupt, Stopped) else 1)
    except PermissionError as error:  # a file or folder of a shared disk that this user may not read or write
        sys.exit(f"retireopd: permission denied: {error.filename or error} (this user may not read or write it: "
                 "ask its owner, or choose another --run-dir / data folder)")
