"""RetireOPD: Self-Retiring On-Policy Distillation for agentic RL, in one file.

A minimal, readable reference implementation of *RetireOPD: Self-Retiring On-Policy Distillation
for Agentic Reinforcement Learning* (arXiv 2609.20784), following the authors' own code point by
point (README: "ours vs the authors' code"). Read it top to bottom beside the paper:

    1. config            every knob, with the authors' default, and what each --algo runs
    2. skills & prompts  the privileged skill texts the teacher sees, the prompt, action parsing
    3. environments      ALFWorld (real alfworld/TextWorld engine), WebShop (webshop_env.py), and
                         the offline demo's kitchen, whose recipes only the skills name
    4. models            Qwen2.5 checkpoints, random-weight `random:` shapes, and the offline `tiny`
                         with its behaviour-cloning warm start
    5. the math          small pure functions, one per equation (GRPO, log-probs, the gap K, dual-clip
                         PPO, the OPD loss, the retirement rule)
    6. rollout           lock-step, batched multi-turn episodes
    7. update            old/teacher/reference log-probs and the combined loss, in mini-batches
    8. phases            phase 1 Skill-GRPO teacher, phase 2 GRPO + OPD student with retirement
    9. main              run folder, metrics.jsonl, checkpoints, evaluation

The method. Phase 1 trains a *teacher* with GRPO while the task's skill notes sit in its prompt,
then freezes it; its success S_T is its validation success with skills. Phase 2 trains a
skill-free *student* with GRPO plus an on-policy distillation loss lambda * L_OPD: the teacher
scores every token the student sampled. Every W = 5 iterations, at the student's validation, the
mean gap K = mean(log p_student - log p_teacher) of a block of W iterations (the oldest not yet
judged) is compared with the block judged before: when it did not shrink at all and the
student's successes at this and the previous judging validation average at least rho * S_T, the
teacher is retired (deleted from memory) and training goes on with GRPO alone.

Commands
    python retireopd.py --model tiny                        # offline CPU demo (the kitchen), ~4 min
    python retireopd.py --model tiny --algo grpo            # the demo's GRPO baseline, to --compare
    python retireopd.py --model tiny --env alfworld         # same, on fixture ALFWorld games we write
    python retireopd.py --model Qwen2.5-1.5B --alfworld-data ~/.cache/alfworld --env-workers 8
    python retireopd.py --model Qwen2.5-1.5B --env webshop --webshop-data DIR
    python retireopd.py --model random:Qwen2.5-1.5B --iterations 1   # real shapes, random weights
    python retireopd.py --algo grpo | skill-grpo | opd | grpo+opd | retireopd --retire-at 40

Deliberate choices (README "choices and deviations" has the full list with reasons):
    - the validation panels are fixed (ALFWorld valid_seen, WebShop's first 128 validation goals),
      where the authors draw 128 random validation episodes; S_T is recorded, not typed in.
    - the teacher prompt is the student prompt plus the skill block, in both phases, never cut.
    - mini-batches are shuffled and the loss is the exact token mean over each mini-batch.
    - precision: fp32 master weights with bf16 autocast on GPU; the frozen teacher and reference
      in fp32 by default (--frozen-dtype bfloat16 to halve them); log-probs from fp32 logits.
    - sampling is the full distribution (temperature 1, top_k 0, top_p 1, no repetition
      penalty) whatever the checkpoint's own generation config says.
    - final teacher/ and student/ models are saved in bf16 (servable); checkpoints keep fp32.
    - the offline demo (--model tiny) runs its own preset (TINY_PRESET: lambda 0.1, lr 5e-4 with
      warm-up, no entropy bonus, small batches) on a warm-started tiny model.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import errno
import functools
import gc
import itertools
import json
import math
import multiprocessing
import os
import random
import re
import shlex
import shutil
import sys
import time
import warnings
import weakref
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch

# transformers and tqdm are imported at module level: the script cannot do anything without them.
import transformers
from tqdm.auto import tqdm

# ==================================================================================================
# 1. Config
# ==================================================================================================



class Algorithm(NamedTuple):
    """What one `--algo` runs. Phase 1 (Skill-GRPO) trains the teacher with GRPO while the skills
    sit in its prompt; phase 2 trains a fresh, skill-free student with the losses named here."""
    teacher_phase: bool  # run phase 1 (or reuse a teacher with --teacher)
    student_phase: bool  # run phase 2
    grpo_loss: bool  # phase 2 trains on the PPO-clip GRPO loss (environment reward)
    opd_loss: bool  # phase 2 adds lambda * L_OPD toward the frozen teacher
    retirement: Optional[str]  # "adaptive": the authors' rule (--retire-at N: a fixed schedule); None: never


ALGORITHMS = {
    "retireopd": Algorithm(teacher_phase=True, student_phase=True, grpo_loss=True, opd_loss=True,
                           retirement="adaptive"),
    "grpo": Algorithm(teacher_phase=False, student_phase=True, grpo_loss=True, opd_loss=False, retirement=None),
    "skill-grpo": Algorithm(teacher_phase=True, student_phase=False, grpo_loss=False, opd_loss=False,
                            retirement=None),
    "opd": Algorithm(teacher_phase=True, student_phase=True, grpo_loss=False, opd_loss=True, retirement=None),
    "grpo+opd": Algorithm(teacher_phase=True, student_phase=True, grpo_loss=True, opd_loss=True, retirement=None),
}
ALGOS = tuple(ALGORITHMS)
PHASES = ("teacher", "student")
ENVS = ("alfworld", "webshop", "kitchen")
MODEL_ALIASES = {
    "Qwen2.5-1.5B": "Qwen/Qwen2.5-1.5B-Instruct",
    "Qwen2.5-3B": "Qwen/Qwen2.5-3B-Instruct",
    "Qwen2.5-7B": "Qwen/Qwen2.5-7B-Instruct",
}


@dataclass
class Config:
    # --- what to run -----------------------------------------------------------------------------
    model: str = "Qwen2.5-1.5B"  # hub id, local folder, alias (Qwen2.5-1.5B/3B/7B), random:<alias>, tiny
    algo: str = "retireopd"  # retireopd | grpo | skill-grpo | opd | grpo+opd (README: Algorithms)
    env: str = "alfworld"  # alfworld | webshop | kitchen (the offline demo's; the `tiny` preset's default)
    alfworld_data: Optional[str] = None  # root with json_2.1.1/ (default $ALFWORLD_DATA, else
    #   ~/.cache/alfworld); "fixtures" writes and plays our own tiny games (the tiny preset's default)
    webshop_data: Optional[str] = None  # folder with the official WebShop files (default $WEBSHOP_DATA,
    #   else the built-in 12-product catalogue)
    webshop_reward: str = "faithful"  # faithful (the original's reward, its option bug kept) | fixed
    teacher: Optional[str] = None  # reuse a saved phase-1 teacher folder (skips phase 1)
    retire_at: Optional[int] = None  # fixed-schedule retirement at this phase-2 iteration (ablation)
    run_dir: Optional[str] = None  # output folder (default runs/<env>-<algo>-<time>)
    seed: int = 0  # seeds task sampling, rollouts and the tiny/random: model weights
    warm_start: int = 0  # tiny only: behaviour-cloning steps that teach the answer format and reading
    #   a skill block, on invented dishes (README: the offline demo); 0: the random tiny model
    device: str = "auto"  # auto | cuda | cuda:N | cpu
    # --- rollout -------------------------------------------------------------------------------
    iterations: int = 150  # training iterations per phase (the authors' protocol)
    teacher_iterations: Optional[int] = None  # phase 1's, if different (None, or --iterations given
    #   alone: the same as --iterations)
    batch_tasks: int = 16  # B: tasks per iteration
    group_size: int = 8  # G: rollouts per task; a GRPO group
    max_turns: Optional[int] = None  # None -> 50 (ALFWorld) / 15 (WebShop)
    history: int = 2  # H: past (observation, action) pairs shown in the prompt
    env_workers: int = 0  # ALFWorld: processes that step the games in parallel (0: in this process)
    max_response_tokens: int = 512  # an answer cut here is malformed
    max_prompt_tokens: Optional[int] = None  # student budget; None -> 2048 (ALFWorld) / 4096 (WebShop)
    prefill_batch: int = 16  # prompts prefilled per forward in a rollout turn (the prefill's memory grows
    #   with it times the prompt width, not with B*G); 0: all of them in one forward
    temperature: float = 1.0  # rollout temperature (full distribution: top_k=0, top_p=1)
    malformed_penalty: float = 0.1  # subtracted from a turn's score when its answer is malformed
    success_reward: float = 10.0  # R_i for a won episode
    # --- update ----------------------------------------------------------------------------------
    lr: float = 1e-6  # AdamW learning rate (the authors' scripts)
    lr_warmup_steps: int = 0  # linear learning-rate warm-up over a phase's first N optimizer steps (the
    #   authors': none)
    weight_decay: float = 0.01  # AdamW weight decay
    grad_clip: float = 1.0  # gradient-norm clipping
    clip_eps: float = 0.2  # PPO clip
    dual_clip: float = 3.0  # dual-clip PPO: for A < 0 the loss is also capped at -c*A (verl's clip_ratio_c)
    ppo_epochs: int = 1  # passes over each iteration's samples
    mini_batch: Optional[int] = None  # turn-samples per optimizer step in phase 1 and --algo grpo;
    #   None -> 256 (ALFWorld) / 64 (WebShop)
    opd_mini_batch: int = 128  # turn-samples per optimizer step in phase 2 with a teacher (both envs)
    token_budget: int = 16384  # padded tokens per micro-batch (forward/backward chunk)
    kl_coef: float = 0.01  # KL-to-reference (k3) coefficient in phase 1 and --algo grpo; 0 skips the
    #   reference model entirely
    opd_kl_coef: float = 0.0  # the same in phase 2 with a teacher (the authors': off, no reference model)
    entropy_coef: float = 0.001  # entropy bonus; 0 skips computing it
    opd_coef: float = 0.01  # lambda: weight of the OPD loss L_OPD (the authors' 0.01); 0 after retirement
    gradient_checkpointing: bool = True  # recompute activations in backward (GPU only; saves memory)
    logprob_chunk: int = 1024  # response positions per lm_head/log-softmax chunk
    # --- retirement (the authors' rule and defaults) -------------------------------------------------
    window: int = 5  # W: the gap K is averaged over non-overlapping blocks of W iterations
    alignment_threshold: float = 0.0  # "stopped shrinking": progress (K_prev - K)/K_prev <= this
    rho: float = 0.9  # competence: the student's successes at this and the previous judging validation, averaged, >= rho * S_T
    teacher_success: Optional[float] = None  # S_T; None: the mean of the teacher's last two
    #   validations with skills, recorded at the end of phase 1
    # --- evaluation & outputs --------------------------------------------------------------------
    eval_every: int = 5  # validation every N iterations (1 <= N <= W) and at a phase's last iteration
    eval_temperature: float = 0.4  # sampling temperature of validations and the end-of-phase reports
    eval_episodes: Optional[int] = None  # cap every panel, for quick checks (ALFWorld: round-robin
    #   over task types; WebShop: the first N goals); None = the whole panel
    save_every: int = 10  # resumable checkpoint every N iterations (also at phase ends, retirement; 0: only
    #   there)
    keep_checkpoints: int = 2  # how many resumable checkpoints to keep, the newest (>= 1; older ones are deleted)
    frozen_dtype: str = "float32"  # teacher/reference weights: float32 (the student's numerics, so
    #   identical models give K = 0 exactly) or bfloat16 (half the memory, e.g. for 3B; see README)


# `python retireopd.py --model tiny` must run teacher -> student -> retirement -> GRPO in minutes on
# a laptop CPU. These values replace the protocol defaults for the tiny model, unless a flag is given.
# On ALFWorld's fixture games and the built-in WebShop catalogue the tiny model only runs the code
# paths: small and quick, no warm start (it knows only the kitchen), and since it never wins (S_T =
# 0) the teacher retires on a fixed schedule halfway through phase 2, unless --teacher-success or
# --retire-at is given.
TINY_PRESET_ELSEWHERE = dict(warm_start=0, teacher_iterations=None, iterations=10, batch_tasks=2, group_size=4,
                             max_response_tokens=32, eval_episodes=4, lr=1e-4, lr_warmup_steps=0,
                             retire_at="half")
TINY_PRESET = dict(
    env="kitchen", alfworld_data="fixtures", warm_start=500, teacher_iterations=24, iterations=50, batch_tasks=8,
    group_size=8, max_turns=4, max_response_tokens=24, max_prompt_tokens=4096, mini_batch=16, opd_mini_batch=16,
    window=3, eval_every=3, lr=5e-4, lr_warmup_steps=30, entropy_coef=0.0, kl_coef=0.0, opd_coef=0.1,
)

# ==================================================================================================
# 2. Skills and prompts
# ==================================================================================================
# The privileged information of self-OPD: short strategy notes per task type. Only the teacher
# sees them (phase 1 while it trains, phase 2 when it scores the student's tokens). They are
# plain data so that a reader sees exactly what the teacher sees. Written by us.

ALFWORLD_SKILLS = {
    "general": [
        "Read the task sentence first: note the object, any required treatment (clean, heat, cool, "
        "look under a lamp) and the target receptacle.",
        "Only use commands from the admissible list, copied exactly, including the object numbers.",
        "Search systematically: visit each likely receptacle once; open closed ones (drawer, cabinet, "
        "fridge, microwave) before looking inside, and do not revisit places you already checked.",
        "You can carry one object at a time. Take the object with 'take X from Y' before moving.",
        "Finish with 'move X to Y' at the target receptacle; the task ends as soon as it is satisfied.",
    ],
    "pick_and_place_simple": [
        "Find the object (countertops, tables, shelves, drawers, cabinets), take it, go to the "
        "target receptacle, open it if needed, and move the object there.",
    ],
    "look_at_obj_in_light": [
        "Find and take the object first, then find a desklamp or floorlamp (usually on a desk, "
        "sidetable or dresser), go there and 'use' the lamp while holding the object.",
    ],
    "pick_clean_then_place_in_recep": [
        "Take the object, go to a sinkbasin, 'clean X with sinkbasin N', then carry it to the "
        "target receptacle and move it there.",
    ],
    "pick_heat_then_place_in_recep": [
        "Take the object, go to the microwave, 'heat X with microwave 1' (no need to open it), then "
        "carry it to the target receptacle and move it there.",
    ],
    "pick_cool_then_place_in_recep": [
        "Take the object, go to the fridge, 'cool X with fridge 1' (no need to open it), then carry "
        "it to the target receptacle and move it there.",
    ],
    "pick_two_obj_and_place": [
        "You need two objects of the same kind but can carry one: take the first, put it in the "
        "target receptacle, then search the places you have not checked for the second one.",
    ],
}

WEBSHOP_SKILLS = {
    "general": [
        "Search with the product type and its two or three most specific attributes; leave out the "
        "price, quantity words and filler.",
        "On the results page, open the item whose title matches the product type and most attributes "
        "and whose price is below the budget; use next > only if none fits.",
        "On the item page, click every option the instruction names (size, colour, flavour, count), "
        "choosing the value that matches exactly; options are not shown as selected, so click each once.",
        "Check the price against the budget, then click buy now. Do not buy a different product type.",
    ],
    "beauty": ["Match scent, size in ounces and 'paraben free'/'natural' style claims in the title."],
    "food": ["Match flavour, pack count and dietary words (gluten free, sugar free, keto) exactly."],
    "fashion": ["Match the exact size label (large vs x-large, 8 vs 8 wide) and the colour name."],
    "furniture": ["Match the material, colour and dimensions; a 'set of 2' must say so in the title."],
    "electronics": ["Match the device it is for, the capacity and the connector type in the title."],
}

# The offline demo's kitchen (--env kitchen): each dish has a recipe of its own, an ingredient and
# a way to cook it, and nothing in the task says which. The skills name it, so in this kitchen the
# skills are decisive by construction: a teacher that reads them can win from the first try, a
# student without them must learn every recipe from reward (or from the teacher).
KITCHEN_INGREDIENTS = ("salt", "sugar", "pepper", "honey")
KITCHEN_METHODS = ("boil", "bake", "fry", "chill")
KITCHEN_RECIPES = {"brask": ("honey", "fry"), "dorl": ("salt", "chill"), "fimble": ("pepper", "bake"),
                   "grue": ("sugar", "boil"), "nallow": ("salt", "bake"), "trisk": ("honey", "chill")}


def kitchen_recipe(dish: str, ingredient: str, method: str) -> str:
    return f"Recipe for a {dish}: {ingredient.capitalize()} it, then {method.capitalize()} it."


KITCHEN_SKILLS = {
    "general": ["First season the dish, then cook it, both as its recipe says; a wrong choice ruins the dish."],
    **{dish: [kitchen_recipe(dish, *recipe)] for dish, recipe in KITCHEN_RECIPES.items()},
}
SKILLS = {"alfworld": ALFWORLD_SKILLS, "webshop": WEBSHOP_SKILLS, "kitchen": KITCHEN_SKILLS}

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
                       observation: str, admissible: list[str], skills: str = "") -> str:
    """The user message of s_t (student, skills="") or s_t^T (teacher, skills=the skill block).

    The content of the verl-agent prompts the authors train with, in our words: the task, how
    many steps were already taken, the last H (observation, action) pairs, the current
    observation, the admissible actions, the answer format. One function builds both prompts,
    so the teacher's differs from the student's by exactly the skill block, which sits inside
    the user message before the task.
    """
    parts = [skills] if skills else []
    parts.append(f"{ENV_INTRO[env_name]} Your task: {task}")
    if history:
        parts.append(f"You have taken {steps_taken} step(s). Your last {len(history)} observation(s) and action(s):\n" + "\n".join(
            f"Observation: {obs}\nAction: {act}" for obs, act in history))
    else:
        parts.append(f"You have taken {steps_taken} step(s).")
    parts.append(f"Current observation:\n{observation}")
    parts.append("Admissible actions: " + ", ".join(f"'{a}'" for a in admissible))
    parts.append(FORMAT_INSTRUCTION)
    return "\n\n".join(parts)


CJK_RE = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")


def parse_action(response: str) -> Optional[str]:
    """The action in `<think>...</think><action>...</action>`, lowercased, or None if malformed.

    Malformed = a missing <think> or <action> tag pair, or any CJK character. The caller
    turns None into a no-op for the environment and a -0.1 turn penalty.
    """
    if CJK_RE.search(response):
        return None
    if not re.search(r"<think>.*?</think>", response, re.DOTALL):
        return None
    match = re.search(r"<action>(.*?)</action>", response, re.DOTALL)
    if match is None:
        return None
    action = match.group(1).strip().lower()
    return action or None

# ==================================================================================================
# 3. Environments
# ==================================================================================================
# Both benchmarks are driven through one small interface, so the rollout loop does not care which
# one it plays:  env.reset() -> (observation, info)   and   env.step(action) -> (observation,
# reward, done, info), where info carries "task", "task_type" (the skill key), "admissible" and
# "won". A malformed model answer is a no-op: the rollout loop does not call step at all.

# ----- ALFWorld through the real alfworld/TextWorld text engine ------------------------------------
# One `AlfWorldEnv` is one episode slot. It drives TextWorld's `PddlEnv` wrapped in alfworld's
# `AlfredDemangler(shuffle=False)` (object names such as "apple 1") and `AlfredInfos`, the same
# stack alfworld's `AlfredTWEnv` uses for its evaluation splits, but in-process and one game per
# object, so the training loop can step B*G episodes in lock-step.

ALFWORLD_TASK_TYPES = (  # alfworld's TASK_TYPES 1..6, in that order
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
ALFWORLD_SPLITS = ("train", "valid_seen", "valid_unseen")
ALFWORLD_WIN_REWARD = 10.0
ALFWORLD_DOWNLOAD_HINT = (
    "Get the games with `pip install alfworld==0.4.2 && alfworld-download`. It puts them in "
    "~/.cache/alfworld unless $ALFWORLD_DATA is set; point --alfworld-data (or $ALFWORLD_DATA) at "
    "the folder that holds json_2.1.1/."
)


class AlfWorldDataError(FileNotFoundError):
    """The ALFWorld game folder is missing or holds no playable game."""


# -----------------------------------------------------------------------------
# Game discovery
# -----------------------------------------------------------------------------

def alfworld_data_root(data_root=None):
    """The ALFWorld data root: `data_root` (--alfworld-data), else $ALFWORLD_DATA, else
    ~/.cache/alfworld (where `alfworld-download` puts the games). `~` and `$VARS` are expanded."""
    root = data_root or os.environ.get("ALFWORLD_DATA") or "~/.cache/alfworld"
    return Path(os.path.expanduser(os.path.expandvars(str(root))))


def _alfworld_task_type_or_none(path):
    """Task type from the nearest folder named `<task_type>-<Obj>-<MRecep>-<Recep>-<scene>`."""
    for part in reversed(Path(path).parts):
        head = part.split("-", 1)[0]
        if head in ALFWORLD_TASK_TYPES:
            return head
    return None


def alfworld_task_type(path):
    """Task type of a game (one of ALFWORLD_TASK_TYPES), read from its path, e.g.
    ".../pick_cool_then_place_in_recep-Apple-None-CounterTop-14/trial_T2019.../game.tw-pddl"."""
    task_type = _alfworld_task_type_or_none(path)
    if task_type is None:
        raise ValueError(f"no ALFWorld task type in the path {path!s}; expected a folder named "
                         f"'<task_type>-<Object>-<MRecep>-<Recep>-<scene>' with a task type in "
                         f"{ALFWORLD_TASK_TYPES}")
    return task_type


def _alfworld_game_is_solvable(game_path):
    try:
        with open(game_path) as f:
            return json.load(f).get("solvable") is True
    except (OSError, ValueError, AttributeError):
        return False


def discover_alfworld_games(data_root=None, split="train"):
    """Sorted list of playable `game.tw-pddl` paths under `<root>/json_2.1.1/<split>`.

    A trial folder (`<task-folder>/<trial>/`) is kept under the rules of alfworld 0.4.2's
    `AlfredTWEnv.collect_game_files`: it holds `traj_data.json`; its path (below the split
    folder) contains neither "movable" nor "Sliced"; its task type is one of the six; it holds
    `game.tw-pddl`, whose JSON has `"solvable": true` (a missing key or an unreadable file is
    skipped too). The task type is read from the folder name, not from `traj_data.json` (the same
    value in ALFRED's layout), so discovery never parses the large trajectory files.
    Raises AlfWorldDataError if the split folder is missing or holds no playable game.
    """
    root = alfworld_data_root(data_root)
    split_dir = root / "json_2.1.1" / split
    if not split_dir.is_dir():
        raise AlfWorldDataError(f"ALFWorld split folder not found: {split_dir}. "
                                f"{ALFWORLD_DOWNLOAD_HINT}")
    games = []
    for dirpath, dirnames, filenames in os.walk(split_dir):
        dirnames.sort()
        if "traj_data.json" not in filenames or "game.tw-pddl" not in filenames:
            continue
        rel = os.path.relpath(dirpath, split_dir)
        if "movable" in rel or "Sliced" in rel:
            continue
        if _alfworld_task_type_or_none(rel) is None:
            continue
        game_path = os.path.join(dirpath, "game.tw-pddl")
        if _alfworld_game_is_solvable(game_path):
            games.append(game_path)
    if not games:
        raise AlfWorldDataError(f"no playable ALFWorld game (solvable game.tw-pddl + "
                                f"traj_data.json) under {split_dir}. {ALFWORLD_DOWNLOAD_HINT}")
    return sorted(games)


# -----------------------------------------------------------------------------
# Engine plumbing: a pool of engines and memoised parsing
# -----------------------------------------------------------------------------
# Each TextWorld `PddlEnv` loads its own private copy of fast-downward's 33 MB shared library
# (its planner state is global C state, so two games cannot share one copy). Copying and
# loading it takes ~0.1 s, so finished slots hand their engine back to a pool for the next one.

_ALFWORLD_ENGINE_POOL = []
_ALFWORLD_ENGINE_POOL_MAX = 512


def _alfworld_new_engine():
    import textworld
    from textworld.envs import PddlEnv
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
    infos = textworld.EnvInfos(won=True, admissible_commands=True)
    return AlfredInfos(AlfredDemangler(PddlEnv(infos), shuffle=False))


def _alfworld_acquire_engine():
    return _ALFWORLD_ENGINE_POOL.pop() if _ALFWORLD_ENGINE_POOL else _alfworld_new_engine()


def _alfworld_release_engine(engine, reusable=True):
    """Return an engine to the pool. An engine that raised is dropped instead; its library copy
    stays mapped (unloading it with fast_downward.close_lib makes Python segfault at exit)."""
    if reusable and len(_ALFWORLD_ENGINE_POOL) < _ALFWORLD_ENGINE_POOL_MAX:
        _ALFWORLD_ENGINE_POOL.append(engine)


class _AlfWorldParseMemo:
    """Memo tables for the pure, text-in/objects-out parsing steps TextWorld repeats.

    Measured on the 24 real games (2-core CPU): `fast_downward.pddl2sas` (PDDL -> SAS
    translation) is ~85 % of `reset()` and runs twice per state build, and a state is built at
    `load()` *and* at every `reset()`; `GameLogic` re-parses the grammar at every `load()`; every
    `step()` re-parses the same ~30 command/feedback templates and ~20 grammar conditions with a
    tatsu parser. Memoising them changes no output (a test checks identical text and admissible
    lists), makes load+reset of a cached game ~10x faster and steps ~2x faster. Translations,
    GameLogic objects and condition rules are shared read-only between engines; template parses
    are deep-copied because the caller attaches game state to them.
    """

    def __init__(self, max_games=64, max_templates=4096):
        self.max_games = max_games
        self.max_templates = max_templates
        self.sas = OrderedDict()      # (optimize, domain, problem) -> (task, sas)
        self.logic = OrderedDict()    # (domain, grammar) -> GameLogic
        self.templates = {}           # parser args -> parsed symbols (copied on use)
        self.conditions = {}          # grammar condition text -> textworld.logic.Rule
        self.stats = defaultdict(int)

    def _lru(self, table, key, build, limit, name):
        if key in table:
            table.move_to_end(key)
            self.stats[name + "_hits"] += 1
            return table[key]
        self.stats[name + "_misses"] += 1
        value = table[key] = build()
        while len(table) > limit:
            table.popitem(last=False)
        return value

    def clear(self):
        for table in (self.sas, self.logic, self.templates, self.conditions, self.stats):
            table.clear()


_ALFWORLD_MEMO = _AlfWorldParseMemo()
_ALFWORLD_PATCH_DEPTH = [0]


@contextlib.contextmanager
def _alfworld_engine_calls(memoise=True):
    """Context for every call into the engine. Always restores `sys.argv`, which fast-downward's
    translator overwrites. With `memoise`, routes the four parsing steps through _ALFWORLD_MEMO
    for the duration of the call only (TextWorld looks them up as module attributes)."""
    saved_argv = sys.argv
    if not memoise or _ALFWORLD_PATCH_DEPTH[0] > 0:
        try:
            yield
        finally:
            sys.argv = saved_argv
        return
    import fast_downward
    import textworld.envs.pddl.logic as pddl_logic
    import textworld.envs.pddl.textgen as textgen
    orig_sas, orig_logic, orig_parse, orig_rule = (fast_downward.pddl2sas, pddl_logic.GameLogic,
                                                   textgen._parse_and_convert, textgen.Rule)
    memo = _ALFWORLD_MEMO

    def pddl2sas(domain, problem, verbose=False, optimize=False):
        return memo._lru(memo.sas, (bool(optimize), domain, problem),
                         lambda: orig_sas(domain, problem, verbose=verbose, optimize=optimize),
                         2 * memo.max_games, "sas")

    def game_logic(domain, grammar):
        return memo._lru(memo.logic, (domain, grammar),
                         lambda: orig_logic(domain=domain, grammar=grammar),
                         memo.max_games, "logic")

    def parse_and_convert(*args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        parsed = memo.templates.get(key)
        if parsed is None:
            parsed = orig_parse(*args, **kwargs)
            if len(memo.templates) >= memo.max_templates:
                return parsed
            memo.templates[key] = parsed
        return copy.deepcopy(parsed)  # the caller attaches engine state to what it gets

    class MemoRule:  # stands in for textworld.logic.Rule, which textgen uses only for this
        @staticmethod
        def parse_conjunctive_query(expr):
            rule = memo.conditions.get(expr)
            if rule is None:
                rule = orig_rule.parse_conjunctive_query(expr)
                if len(memo.conditions) < memo.max_templates:
                    memo.conditions[expr] = rule
            return rule

    _ALFWORLD_PATCH_DEPTH[0] += 1
    fast_downward.pddl2sas, pddl_logic.GameLogic = pddl2sas, game_logic
    textgen._parse_and_convert, textgen.Rule = parse_and_convert, MemoRule
    try:
        yield
    finally:
        fast_downward.pddl2sas, pddl_logic.GameLogic = orig_sas, orig_logic
        textgen._parse_and_convert, textgen.Rule = orig_parse, orig_rule
        _ALFWORLD_PATCH_DEPTH[0] -= 1
        sys.argv = saved_argv


# -----------------------------------------------------------------------------
# The environment adapter
# -----------------------------------------------------------------------------

class AlfWorldEnv:
    """One ALFWorld episode slot on the real text engine.

        env = AlfWorldEnv(gamefile, max_turns=50)
        obs, info = env.reset()                      # intro text with "Your task is to: ..."
        obs, reward, done, info = env.step(action)   # action: str, or None (malformed answer)

    - `info`: {"task": the task sentence (after "Your task is to: "), "task_type",
      "admissible": sorted admissible commands without "help", "won", "turn", "error",
      "gamefile"}. `error` is None unless the engine raised.
    - `reward` is ALFWORLD_WIN_REWARD (10.0) on the step that wins, else 0.0. `done` when won or
      when `max_turns` turns were taken.
    - `action=None` is a no-op: the engine is not stepped, the last observation is returned
      again, and the turn counts. A well-formed but inadmissible command goes to the engine,
      which answers "Nothing happens." and changes nothing.
    - An engine exception (at load, reset or step) never propagates: the episode ends as a
      failure (done, won=False, reward 0) with the error text in `info["error"]`.
    - Steps after `done` change nothing and return reward 0.
    - `memoise` (default on) shares parsed games between slots; see _AlfWorldParseMemo.
    - `close()` (also called on garbage collection) hands the engine back to a pool.
    """

    def __init__(self, gamefile, max_turns=50, memoise=True):
        self.gamefile = str(gamefile)
        self.task_type = alfworld_task_type(self.gamefile)
        self.max_turns = int(max_turns)
        self.memoise = memoise
        self._engine = None
        self._loaded = False
        self.task = ""
        self.obs = ""
        self.admissible = []
        self.won = False
        self.done = True   # until reset()
        self.turn = 0
        self.error = None

    def _info(self):
        return {"task": self.task, "task_type": self.task_type, "admissible": list(self.admissible),
                "won": self.won, "turn": self.turn, "error": self.error,
                "gamefile": self.gamefile}

    def _read_state(self, state):
        self.obs = state.feedback
        self.admissible = [c for c in state["admissible_commands"] if c != "help"]
        self.won = bool(state["won"])

    def _fail(self, exc):
        self.error = f"{type(exc).__name__}: {exc}"
        self.won, self.done = False, True
        if self._engine is not None:  # its state is unknown: do not reuse it
            engine, self._engine, self._loaded = self._engine, None, False
            _alfworld_release_engine(engine, reusable=False)

    def reset(self):
        """Start (or restart) the episode. Returns (obs, info)."""
        self.turn, self.won, self.done, self.error = 0, False, False, None
        try:
            if self._engine is None:
                self._engine, self._loaded = _alfworld_acquire_engine(), False
            with _alfworld_engine_calls(self.memoise):
                if not self._loaded:
                    self._engine.load(self.gamefile)
                    self._loaded = True
                state = self._engine.reset()
            self._read_state(state)
        except Exception as exc:  # a broken game file must not stop the training loop
            self.obs, self.admissible, self.task = "", [], ""
            self._fail(exc)
            return self.obs, self._info()
        marker = "Your task is to: "
        self.task = self.obs.split(marker, 1)[1].strip() if marker in self.obs else ""
        return self.obs, self._info()

    def step(self, action):
        """One turn. Returns (obs, reward, done, info)."""
        if self.done:
            return self.obs, 0.0, True, self._info()
        self.turn += 1
        if action is not None:
            try:
                with _alfworld_engine_calls(self.memoise):
                    state, _, _ = self._engine.step(str(action))
                self._read_state(state)
            except Exception as exc:
                self._fail(exc)
                return self.obs, 0.0, True, self._info()
        if self.won or self.turn >= self.max_turns:
            self.done = True
        return self.obs, (ALFWORLD_WIN_REWARD if self.won else 0.0), self.done, self._info()

    def close(self):
        """Hand the engine back to the pool (the env can be reset again afterwards)."""
        engine, self._engine, self._loaded = self._engine, None, False
        if engine is not None:
            _alfworld_release_engine(engine)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# -----------------------------------------------------------------------------
# Stepping many episodes: in this process, or in worker processes (--env-workers N)
# -----------------------------------------------------------------------------
# TextWorld is pure Python, so threads would take turns on the GIL: parallel stepping needs
# processes. Each worker owns the AlfWorldEnv of the episodes pinned to it and answers a batch
# of calls at a time. The rollout pins a task's G episodes to one worker, so that worker's memo
# parses the game once.

def _alfworld_worker(conn):
    """A worker process's loop: [(env_id, (gamefile, max_turns), method, args)] -> [results]."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    envs = {}
    while True:
        try:
            batch = conn.recv()
        except EOFError:  # the main process is gone
            return
        if batch is None:
            return
        replies = []
        for env_id, spec, method, args in batch:
            try:
                if method == "close":
                    env = envs.pop(env_id, None)
                    reply = env.close() if env is not None else None
                else:
                    env = envs.get(env_id) or envs.setdefault(env_id, AlfWorldEnv(*spec))
                    reply = getattr(env, method)(*args)
            except Exception as exc:  # sent back as a value: the caller decides what it means
                reply = RuntimeError(f"{type(exc).__name__}: {exc}")
            replies.append(reply)
        conn.send(replies)


class AlfWorldWorkers:
    """N worker processes (started with "spawn": safe after CUDA, no forked engine state)."""

    def __init__(self, n: int):
        context = multiprocessing.get_context("spawn")
        self.conns, self.processes = [], []
        for _ in range(n):
            parent, child = context.Pipe()
            process = context.Process(target=_alfworld_worker, args=(child,), daemon=True)
            process.start()
            child.close()
            self.conns.append(parent)
            self.processes.append(process)
        self.ids = itertools.count()
        self.broken = None  # why the pipes can no longer be trusted, once they cannot
        self.close = weakref.finalize(self, AlfWorldWorkers._shut_down, self.conns, self.processes)

    def run(self, calls: list) -> list:
        """[(worker, env_id, spec, method, args)] -> results in order: one message per worker,
        sent to all of them before any answer is read, so they work in parallel."""
        if self.broken:
            raise RuntimeError(f"ALFWorld workers unusable: {self.broken}")
        by_worker = defaultdict(list)
        for k, (worker, *call) in enumerate(calls):
            by_worker[worker].append((k, tuple(call)))
        results, worker = [None] * len(calls), None
        try:
            for worker, items in by_worker.items():
                self.conns[worker].send([call for _, call in items])
            for worker, items in by_worker.items():
                replies = self.conns[worker].recv()
                if len(replies) != len(items):
                    raise EOFError
                for (k, _), reply in zip(items, replies):
                    results[k] = reply
        except (EOFError, OSError):  # a worker died (a crash in the engine's C code, a kill)
            self.processes[worker].join(timeout=1)
            self.broken = (f"ALFWorld worker {worker} died (exit code "
                           f"{self.processes[worker].exitcode}); continue the run with --resume RUN_DIR")
            raise RuntimeError(self.broken) from None
        except BaseException:  # e.g. Ctrl-C between a send and its answer: replies are now stale
            self.broken = "a batch of calls was interrupted"
            raise
        return results

    @staticmethod
    def _shut_down(conns, processes):
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for conn, process in zip(conns, processes):
            process.join(timeout=2)
            if process.is_alive():
                process.terminate()
            conn.close()


class RemoteAlfWorldEnv:
    """An AlfWorldEnv that lives in a worker process: the same reset/step/close, one call at a
    time; env_calls batches the calls of many of them."""

    def __init__(self, workers: AlfWorldWorkers, worker: int, gamefile, max_turns: int):
        self.workers, self.worker = workers, worker
        self.env_id, self.spec = next(workers.ids), (str(gamefile), max_turns)

    def call(self, method: str, *args):
        result = self.workers.run([(self.worker, self.env_id, self.spec, method, args)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def reset(self):
        return self.call("reset")

    def step(self, action):
        return self.call("step", action)

    def close(self):
        return self.call("close")


def env_calls(calls: list) -> list:
    """[(env, method, args)] -> their results, in order; an exception is returned in place of its
    result, not raised. Envs in worker processes run in parallel; the others one by one."""
    results, remote, local = [None] * len(calls), defaultdict(list), []
    for k, (env, method, args) in enumerate(calls):
        if isinstance(env, RemoteAlfWorldEnv):
            remote[env.workers].append((k, (env.worker, env.env_id, env.spec, method, args)))
        else:
            local.append(k)
    for workers, batch in remote.items():
        for (k, _), result in zip(batch, workers.run([call for _, call in batch])):
            results[k] = result
    for k in local:
        env, method, args = calls[k]
        try:
            results[k] = getattr(env, method)(*args)
        except Exception as exc:
            results[k] = exc
    return results

# -----------------------------------------------------------------------------
# Evaluation panel and per-task-type success
# -----------------------------------------------------------------------------

def alfworld_eval_panel(data_root=None, splits=("valid_seen", "valid_unseen"), max_episodes=None):
    """The fixed evaluation panel: the games of `splits`, sorted by path (so valid_seen before
    valid_unseen). A missing split is skipped with a warning if another split has games; if none
    has, AlfWorldDataError.

    Capped (`max_episodes`), it takes the games round-robin over the task types (each type's
    games in sorted order), so that a small panel still covers every type; the first N in
    sorted order would all be `look_at_obj_in_light`. The chosen games are returned sorted.
    """
    games, problems = [], []
    for split in splits:
        try:
            games += discover_alfworld_games(data_root, split)
        except AlfWorldDataError as exc:
            problems.append(str(exc))
    if not games:
        raise AlfWorldDataError("no ALFWorld evaluation games: " + " | ".join(problems))
    for problem in problems:
        warnings.warn(f"skipping an ALFWorld evaluation split: {problem}")
    games = sorted(games)
    if max_episodes is None or max_episodes >= len(games):
        return games
    by_type = defaultdict(list)
    for game in games:
        by_type[alfworld_task_type(game)].append(game)
    queues = [by_type[t] for t in sorted(by_type)]
    chosen = []
    for rank in range(max(len(q) for q in queues)):
        chosen += [q[rank] for q in queues if rank < len(q)]
    return sorted(chosen[:max_episodes])


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


# -----------------------------------------------------------------------------
# Fixture games written by the project (tests, demo, `--model tiny`)
# -----------------------------------------------------------------------------
# Tiny one-room games in ALFWorld's own format, played by the same engine: our PDDL problems,
# alfworld's domain (alfred.pddl) and grammar (alfred.twl2) from the installed wheel.
# Each row: (split, task_type, object, where the object lies, target receptacle).
# The task's helper receptacle: clean -> SinkBasin, heat -> Microwave, cool -> Fridge,
# look -> a SideTable with a DeskLamp (the target), two -> a Drawer holding the second object.

ALFWORLD_FIXTURE_GAMES = (
    ("train", "pick_and_place_simple", "Mug", "CounterTop", "SideTable"),
    ("train", "look_at_obj_in_light", "CD", "Shelf", "DeskLamp"),
    ("train", "pick_clean_then_place_in_recep", "Cloth", "CounterTop", "Cabinet"),
    ("train", "pick_heat_then_place_in_recep", "Egg", "Fridge", "DiningTable"),
    ("train", "pick_cool_then_place_in_recep", "Apple", "Cabinet", "CounterTop"),
    ("train", "pick_two_obj_and_place", "Pencil", "Shelf", "Desk"),
    ("valid_seen", "pick_and_place_simple", "Book", "Shelf", "Desk"),
    ("valid_seen", "pick_clean_then_place_in_recep", "Plate", "DiningTable", "Cabinet"),
    ("valid_seen", "pick_cool_then_place_in_recep", "Tomato", "CounterTop", "DiningTable"),
)
_ALFWORLD_OPENABLE = {"Cabinet", "Drawer", "Fridge", "Microwave"}
_ALFWORLD_HELPER = {  # task type -> (helper receptacle, verb, ability fact, goal fact)
    "pick_clean_then_place_in_recep": ("SinkBasin", "clean", "cleanable", "isClean"),
    "pick_heat_then_place_in_recep": ("Microwave", "heat", "heatable", "isHot"),
    "pick_cool_then_place_in_recep": ("Fridge", "cool", "coolable", "isCool")}
_ALFWORLD_SENTENCE = {"pick_and_place_simple": "put a {o} in {r}",
                      "look_at_obj_in_light": "look at {o} under the {r}",
                      "pick_clean_then_place_in_recep": "put a clean {o} in {r}",
                      "pick_heat_then_place_in_recep": "put a hot {o} in {r}",
                      "pick_cool_then_place_in_recep": "put a cool {o} in {r}",
                      "pick_two_obj_and_place": "put two {o} in {r}"}
# types the domain names as constants (they must be declared objects of every problem)
_ALFWORLD_CONST_TYPES = ("SinkBasinType - rtype", "MicrowaveType - rtype", "FridgeType - rtype",
                         "KnifeType - otype", "ButterKnifeType - otype", "DeskLampType - otype")


def _alfworld_receptacle_id(name):
    # ALFRED ids are "<Name>|x|y|z"; the demangler turns "Sink|..|SinkBasin" into "sinkbasin N"
    return "Sink_bar_1_bar_SinkBasin" if name == "SinkBasin" else f"{name}_bar_1"


def alfworld_fixture_problem(task_type, obj, source, target):
    """PDDL problem, task sentence and winning action list of one fixture game."""
    o, src, tgt = obj.lower(), source.lower(), target.lower()
    helper = _ALFWORLD_HELPER.get(task_type)
    recs = [source, target]
    if helper:
        recs.insert(1, helper[0])
    if task_type == "look_at_obj_in_light":
        recs[1] = "SideTable"              # the lamp is an object standing on a side table
    if task_type == "pick_two_obj_and_place":
        recs.insert(1, "Drawer")
    # objects: (id, type, receptacle); the demangler numbers same-name ids in reverse sort
    # order, so Pencil_bar_2 becomes "pencil 1" and Pencil_bar_1 "pencil 2".
    objs = [(f"{obj}_bar_2" if task_type == "pick_two_obj_and_place" else f"{obj}_bar_1",
             obj, source)]
    if task_type == "pick_two_obj_and_place":
        objs.append((f"{obj}_bar_1", obj, "Drawer"))
    if task_type == "look_at_obj_in_light":
        objs.append(("DeskLamp_bar_1", "DeskLamp", "SideTable"))
    loc = {r: f"loc_bar_{i + 1}_bar_0_bar_0_bar_0" for i, r in enumerate(recs)}
    decl = ["agent1 - agent", "loc_bar_0_bar_0_bar_0_bar_0 - location"]
    decl += [f"{loc[r]} - location" for r in recs]
    decl += [f"{_alfworld_receptacle_id(r)} - receptacle" for r in recs]
    decl += [f"{i} - object" for i, _, _ in objs]
    decl += sorted({f"{r}Type - rtype" for r in recs} | {f"{t}Type - otype" for _, t, _ in objs}
                   | set(_ALFWORLD_CONST_TYPES))
    init = ["(atLocation agent1 loc_bar_0_bar_0_bar_0_bar_0)"]
    for r in recs:
        rid = _alfworld_receptacle_id(r)
        init += [f"(receptacleType {rid} {r}Type)", f"(receptacleAtLocation {rid} {loc[r]})"]
        init += [f"(openable {rid})"] if r in _ALFWORLD_OPENABLE else []
        init += [f"(canContain {r}Type {obj}Type)"]
    for i, t, r in objs:
        init += [f"(objectType {i} {t}Type)", f"(inReceptacle {i} {_alfworld_receptacle_id(r)})",
                 f"(objectAtLocation {i} {loc[r]})"]
        init += ["(toggleable DeskLamp_bar_1)"] if t == "DeskLamp" else [f"(pickupable {i})"]
        init += [f"({helper[2]} {i})"] if helper else []
    typed = f"(objectType ?o {obj}Type) (receptacleType ?r {target}Type)"
    if task_type == "look_at_obj_in_light":
        goal = ("(and (exists (?ot - object ?r - receptacle ?a - agent ?l - location) (and "
                "(objectType ?ot DeskLampType) (toggleable ?ot) (isToggled ?ot) "
                "(receptacleAtLocation ?r ?l) (atLocation ?a ?l) (inReceptacle ?ot ?r))) "
                f"(exists (?o - object ?a - agent) (and (objectType ?o {obj}Type) (holds ?a ?o))))")
    elif task_type == "pick_two_obj_and_place":
        goal = ("(exists (?r - receptacle ?o - object ?o2 - object) (and (not (= ?o ?o2)) "
                f"{typed} (objectType ?o2 {obj}Type) (inReceptacle ?o ?r) (inReceptacle ?o2 ?r)))")
    else:
        extra = f" ({helper[2]} ?o) ({helper[3]} ?o)" if helper else ""
        goal = f"(exists (?r - receptacle ?o - object) (and (inReceptacle ?o ?r) {typed}{extra}))"
    problem = "(define (problem fixture)\n(:domain alfred)\n(:objects\n  {}\n)\n(:init\n  {}\n)\n" \
              "(:goal {})\n)\n".format("\n  ".join(decl), "\n  ".join(init), goal)

    def go(r, opened=()):
        openable = r in {x.lower() for x in _ALFWORLD_OPENABLE} and r not in opened
        return [f"go to {r} 1"] + ([f"open {r} 1"] if openable else [])

    actions = go(src) + [f"take {o} 1 from {src} 1"]
    if helper:
        actions += go(helper[0].lower(), opened=(helper[0].lower(),)) + \
            [f"{helper[1]} {o} 1 with {helper[0].lower()} 1"]
    if task_type == "look_at_obj_in_light":
        actions += ["go to sidetable 1", "use desklamp 1"]
    else:
        actions += go(tgt, opened=(src,)) + [f"move {o} 1 to {tgt} 1"]
    if task_type == "pick_two_obj_and_place":
        actions += go("drawer") + [f"take {o} 2 from drawer 1"]
        actions += go(tgt) + [f"move {o} 2 to {tgt} 1"]
    sentence = _ALFWORLD_SENTENCE[task_type].format(o=o, r=tgt)
    return problem, sentence, actions


def _alfworld_wheel_data():
    """alfworld's domain (alfred.pddl) and grammar (alfred.twl2), read from the installed wheel
    without importing alfworld (whose import creates ~/.cache/alfworld)."""
    import importlib.util
    spec = importlib.util.find_spec("alfworld")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the ALFWorld fixture games need the alfworld package: "
                          "pip install alfworld==0.4.2")
    data = Path(list(spec.submodule_search_locations)[0]) / "data"
    return (data / "alfred.pddl").read_text(), (data / "alfred.twl2").read_text()


def write_fixture_alfworld_games(out_root):
    """Write ALFWORLD_FIXTURE_GAMES as an $ALFWORLD_DATA-style tree under `out_root`:
    json_2.1.1/<split>/<task_type>-<Obj>-None-<Recep>-<n>/trial_fixture/{game.tw-pddl,
    traj_data.json}. The winning action list is the game's "walkthrough". Returns out_root."""
    domain, grammar = _alfworld_wheel_data()
    out_root = Path(out_root)
    for n, (split, task_type, obj, source, target) in enumerate(ALFWORLD_FIXTURE_GAMES):
        problem, sentence, actions = alfworld_fixture_problem(task_type, obj, source, target)
        trial = (out_root / "json_2.1.1" / split / f"{task_type}-{obj}-None-{target}-{900 + n}"
                 / "trial_fixture")
        trial.mkdir(parents=True, exist_ok=True)
        game = {"pddl_domain": domain, "grammar": grammar.replace("UNKNOWN GOAL", sentence),
                "pddl_problem": problem, "solvable": True, "walkthrough": actions}
        (trial / "game.tw-pddl").write_text(json.dumps(game))
        annotation = sentence[0].upper() + sentence[1:] + "."
        traj = {"task_type": task_type,
                "pddl_params": {"object_target": obj, "parent_target": target,
                                "toggle_target": target if target == "DeskLamp" else "",
                                "mrecep_target": "", "object_sliced": False},
                "turk_annotations": {"anns": [{"task_desc": annotation}]}}
        (trial / "traj_data.json").write_text(json.dumps(traj))
    return out_root


class WebShopEpisode:
    """One WebShop episode on a shared catalogue (webshop_env.py), in the interface above.

    The prompt shows webshop_env's compact observation (the page after the instruction, each
    segment quoted) and its admissible actions. Won = the purchase scored exactly 1.0.
    """

    def __init__(self, shop, goal_index: int, success_reward: float):
        import webshop_env
        self.env = webshop_env.WebShopEnv(shop)
        self.goal_index = goal_index
        self.success_reward = success_reward

    def _info(self, info: dict, won: bool = False) -> dict:
        return {"task": self.instruction, "task_type": self.category, "admissible": info["admissible"],
                "won": won, **{k: info[k] for k in ("score", "valid") if k in info}}

    def reset(self):
        _, info = self.env.reset(self.goal_index)
        self.instruction, self.category = info["instruction"], info["category"]
        return info["compact_obs"], self._info(info)

    def step(self, action: str):
        _, _, done, info = self.env.step(action)
        won = bool(info.get("won", False))
        return info["compact_obs"], (self.success_reward if won else 0.0), done, self._info(info, won)


# ----- The kitchen: the offline demo's environment --------------------------------------------------
# A task is `dish index * 1000 + variant`; the variant only shuffles the order of the admissible
# actions, so that their position says nothing. Training variants 0-99, panels 500 onwards.
class KitchenEpisode:
    """One dish in the kitchen, in the interface above: two decisions, an ingredient ("honey the
    brask") and a way to cook it ("fry the brask"). The right one moves on,
    a wrong admissible one ruins the dish (the episode ends, lost), an inadmissible command
    changes nothing. Won: both right, reward `success_reward`. The commands name the dish just
    before the choice, as ALFWorld's commands name their objects."""

    def __init__(self, task: int, success_reward: float, recipes: Optional[dict] = None):
        self.recipes = recipes or KITCHEN_RECIPES
        self.task, self.dish = task, sorted(self.recipes)[task // 1000]
        self.success_reward = success_reward

    def _info(self, won: bool = False) -> dict:
        return {"task": f"cook a {self.dish}", "task_type": self.dish, "admissible": list(self.admissible),
                "won": won}

    def _offer(self, actions: list) -> None:
        self.admissible = list(actions)
        self.order.shuffle(self.admissible)

    def reset(self):
        self.step_index, self.done = 0, False
        self.order = random.Random(self.task)  # the admissible order of this task's two steps
        self._offer([f"{ingredient} the {self.dish}" for ingredient in KITCHEN_INGREDIENTS])
        return "You stand at the stove. The pot is empty.", self._info()

    def step(self, action: str):
        ingredient, method = self.recipes[self.dish]
        right = f"{ingredient} the {self.dish}" if self.step_index == 0 else f"{method} the {self.dish}"
        if self.done or action not in self.admissible:
            return "Nothing happens.", 0.0, self.done, self._info()
        if action != right:
            self.done, self.admissible = True, []
            return f"The {self.dish} is ruined.", 0.0, True, self._info()
        if self.step_index == 0:
            self.step_index = 1
            self._offer([f"{m} the {self.dish}" for m in KITCHEN_METHODS])
            return f"The {self.dish} is seasoned with {ingredient}.", 0.0, False, self._info()
        self.done, self.admissible = True, []
        return f"The {self.dish} is ready!", self.success_reward, True, self._info(won=True)


class TaskSuite:
    """The tasks of one benchmark: a training pool, two fixed panels, an episode factory.

    validation_panel: what the retirement rule and S_T read, every --eval-every iterations (the
    in-distribution split: ALFWorld's 140 valid_seen games; WebShop's first 128 validation
    goals). report_panel: the full evaluation at the end of each phase (ALFWorld valid_seen +
    valid_unseen; WebShop all validation goals). ALFWorld tasks are game files, WebShop tasks goal
    indices (the seed-233 split of webshop_env). --eval-episodes caps both panels.
    """

    def __init__(self, cfg: Config):
        self.cfg, self.workers = cfg, None
        cap = cfg.eval_episodes
        if cfg.env == "alfworld":
            root = alfworld_data_root(cfg.alfworld_data)
            splits = ("valid_seen", "valid_unseen")
            if cfg.alfworld_data == "fixtures":  # our own tiny games, written into the run folder
                root = write_fixture_alfworld_games(Path(cfg.run_dir) / "alfworld_fixtures")
                splits = ("valid_seen",)  # the fixtures have no valid_unseen split
            self.train = discover_alfworld_games(root, "train")
            self.validation_panel = alfworld_eval_panel(root, ("valid_seen",), max_episodes=cap)
            self.report_panel = alfworld_eval_panel(root, splits, max_episodes=cap)
            if cfg.env_workers > 0:
                self.workers = AlfWorldWorkers(cfg.env_workers)
        elif cfg.env == "kitchen":
            dishes = range(len(KITCHEN_RECIPES))
            self.train = [d * 1000 + v for d in dishes for v in range(100)]
            self.validation_panel = [d * 1000 + 500 + v for v in range(2) for d in dishes][:cap]
            self.report_panel = [d * 1000 + 500 + v for v in range(4) for d in dishes][:cap]
        else:
            import webshop_env
            self.shop = webshop_env.WebShop(data_dir=cfg.webshop_data, reward_mode=cfg.webshop_reward)
            self.train = list(self.shop.train_goal_indices)
            validation_goals = list(self.shop.valid_goal_indices)
            self.validation_panel = validation_goals[:128][:cap]
            self.report_panel = validation_goals[:cap]

    def task_type(self, task) -> str:
        if self.cfg.env == "alfworld":
            return alfworld_task_type(task)
        if self.cfg.env == "kitchen":
            return sorted(KITCHEN_RECIPES)[task // 1000]
        import webshop_env  # WebShop's raw categories (grocery, garden, ...) -> our skill blocks
        category = self.shop.goals[task]["category"]
        return webshop_env.SKILL_CATEGORY.get(category, category)

    def new_episode(self, task, slot: int = 0):
        """A fresh episode of `task`. With --env-workers, `slot` (the rollout passes the task's
        group) picks the worker process that will own it."""
        if self.cfg.env == "webshop":
            return WebShopEpisode(self.shop, task, self.cfg.success_reward)
        if self.cfg.env == "kitchen":
            return KitchenEpisode(task, self.cfg.success_reward)
        if self.workers is not None:
            worker = slot % len(self.workers.processes)
            return RemoteAlfWorldEnv(self.workers, worker, task, self.cfg.max_turns)
        return AlfWorldEnv(task, max_turns=self.cfg.max_turns)

    def close(self):
        if self.workers is not None:
            self.workers.close()

# ==================================================================================================
# 4. Models
# ==================================================================================================
# Real checkpoints come from the hub or a local folder. `random:<alias>` builds the real
# architecture with random weights (sizes memory and speed before any download). `tiny` is a
# 0.17M-parameter Qwen2 model (2 layers, a 1,024-token byte-level BPE vocabulary trained in code):
# offline on a CPU it runs every code path, and after its warm start it learns the kitchen demo.

# Architectures of the Qwen2.5-Instruct checkpoints (their config.json), for `random:` shapes.
QWEN25_SHAPES = {
    "Qwen2.5-1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True),
    "Qwen2.5-3B": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
                       tie_word_embeddings=True),
    "Qwen2.5-7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       tie_word_embeddings=False),
}
# a small shape with the real 151,936-token vocabulary: the log-prob memory problem at CPU size
QWEN25_SHAPES["small-vocab151k"] = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         vocab_size=151936, tie_word_embeddings=True)
# two layers of 16 small heads: reading a skill block (finding the one capitalised ingredient among
# ~130 tokens) was learned within the warm start by this shape, not by 4 layers of 4 heads (measured)
TINY_SHAPE = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=16,
                  num_key_value_heads=16, tie_word_embeddings=True)
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# ----- The tiny model's warm start: what a pretrained LLM already brings, and nothing more --------
# A randomly initialised model cannot write `<think>...</think><action>...</action>` nor read a
# skill block, and RL cannot find either from scratch in CPU minutes. --warm-start N teaches, by
# behaviour cloning on kitchen prompts, what a pretrained LLM brings to the kitchen: the answer
# format; reading the *first* step (the ingredient) of a recipe in a skill block (short prompts and
# full teacher prompts, random recipes); the recipes of twelve dishes it "knows" (invented ones);
# and, for dishes it has never heard of, guessing (random targets). The demo's six dishes appear
# only with random recipes (in reading examples and as unknown dishes), so the warm-started model
# knows none of their recipes: without skills it is at chance (1/16 per dish), and with skills it
# reads the ingredient but guesses the way to cook it (1/4). Everything above that is learned by
# RL (the teacher's reading of the second step in phase 1) and by RL and OPD (the student).
WARM_START_DISHES = ("brindle", "clomp", "drubble", "fennick", "gorse", "hoplin", "jibber", "krell",
                     "lummox", "nubbin", "pordle", "quorn")
_known = random.Random(12345)  # the recipes the warm-started model "knows": other dishes than the demo's
WARM_START_UNKNOWN = ("arbel", "bosk", "cwill", "dimp", "eskar", "flon", "gwint", "harl", "irple",
                      "jusk", "kemp", "loam")
WARM_START_RECIPES = {dish: (_known.choice(KITCHEN_INGREDIENTS), _known.choice(KITCHEN_METHODS))
                      for dish in WARM_START_DISHES}
WARM_START_ANSWER = "<think>the next step</think><action>{}</action>"


def warm_start_example(rng: random.Random, kind: str) -> tuple[str, str]:
    """(user message, answer) of one warm-start example.

    kind "short": a random recipe's line and the first step's admissible actions; "skills": the
    full teacher prompt with a random recipe, at the first step (reading). "known": a full prompt
    without skills for one of WARM_START_DISHES, answered by its fixed recipe, at either step;
    "unknown": the same for an unknown dish or one of the demo's, answered by a random step
    (nothing to know: the model stays uncertain there, and so explores).
    """
    if kind == "known":  # a dish the model knows, with its known recipe
        dish = rng.choice(WARM_START_DISHES)
        ingredient, method = WARM_START_RECIPES[dish]
    elif kind == "unknown":  # a dish it has never heard of, the demo's among them: it guesses
        dish = rng.choice(WARM_START_UNKNOWN + tuple(KITCHEN_RECIPES))
        ingredient, method = rng.choice(KITCHEN_INGREDIENTS), rng.choice(KITCHEN_METHODS)
    else:  # reading: a random recipe for any dish, the demo's included (it says nothing of theirs)
        dish = rng.choice(WARM_START_DISHES + tuple(KITCHEN_RECIPES))
        ingredient, method = rng.choice(KITCHEN_INGREDIENTS), rng.choice(KITCHEN_METHODS)
    recipes = {dish: (ingredient, method)}
    episode = KitchenEpisode(rng.randrange(1000), 0.0, recipes)  # dish index 0: the invented dish
    observation, info = episode.reset()
    history, right = [], f"{ingredient} the {dish}"
    if kind not in ("short", "skills") and rng.random() < 0.5:  # the second step (reading: first only)
        history = [(observation, right)]
        observation, _, _, info = episode.step(right)
        right = f"{method} the {dish}"
    recipe = "- " + kitchen_recipe(dish, ingredient, method)
    if kind == "short":
        message = recipe + "\n\nAdmissible actions: " + ", ".join(f"'{a}'" for a in info["admissible"])
    else:
        skills = f"Skills for this task:\n- {KITCHEN_SKILLS['general'][0]}\n{recipe}" if kind == "skills" else ""
        message = build_user_message("kitchen", info["task"], len(history), history, observation,
                                     info["admissible"], skills)
    return message, WARM_START_ANSWER.format(right)


def warm_start(model, tokenizer, steps: int, seed: int, batch: int = 32, lr: float = 3e-3) -> dict:
    """Behaviour cloning of `steps` AdamW steps on warm_start_example answers (token mean of
    -log p over the answer tokens). Deterministic per seed. Returns the first and last losses."""
    rng = random.Random(seed)
    cfg = Config(model="tiny", env="kitchen", token_budget=1 << 30)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for step in tqdm(range(steps), desc="warm start", leave=False, disable=not sys.stderr.isatty()):
            examples = [warm_start_example(rng, rng.choice(("short", "skills", "known", "unknown")))
                        for _ in range(batch)]
            prompts = [encode_prompt(tokenizer, message) for message, _ in examples]
            answers = [tokenizer(answer + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
                       for _, answer in examples]
            loss = -response_logprobs(model, prompts, answers, cfg).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(float(loss.detach()))
    return {"steps": steps, "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None}


def build_tiny_tokenizer(vocab_size: int = 1024):
    """A Qwen2 tokenizer (byte-level BPE, Qwen's pre-tokenizer, ChatML) with a vocabulary trained
    in code on our own prompt text: deterministic, no download, and it saves and reloads as the
    same Qwen2Tokenizer. Byte-level: any text round-trips, CJK included.
    """
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
    corpus = [*ENV_INTRO.values(), FORMAT_INSTRUCTION, "<think></think><action></action> search[ click[ ] [SEP]"]
    for skills in SKILLS.values():
        corpus += [rule for rules in skills.values() for rule in rules]
    rng = random.Random(0)  # kitchen prompts and answers, so that their words are single tokens
    corpus += [text for _ in range(60) for text in warm_start_example(rng, "skills")]
    corpus += 20 * [f"cook a {dish}" for dish in KITCHEN_RECIPES] + 20 * ["<|im_start|>user\n", "assistant"]
    corpus += 20 * [": " + ", ".join(word.capitalize() for word in KITCHEN_INGREDIENTS + KITCHEN_METHODS)]
    corpus += ["The pot holds salt. The grue is ruined. The dorl is ready! Nothing happens."]
    corpus += ["You arrive at countertop 1. On the countertop 1, you see a apple 1, a mug 2.",
               "Nothing happens. go to take from move to open close clean heat cool use examine "
               "inventory look Your task is to: put a clean cloth in cabinet.",
               "Back to Search Next > < Prev Buy Now Description Features Reviews Attributes "
               "Instruction: i need a pack of 2 navy blue x-large shirts, and price lower than 40.00 dollars"]
    trainer_model = Tokenizer(models.BPE())
    trainer_model.normalizer = normalizers.NFC()  # the same pipeline as Qwen2Tokenizer's
    trainer_model.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    trainer_model.train_from_iterator(corpus * 4, trainer)
    learned = json.loads(trainer_model.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tokenizer = transformers.Qwen2Tokenizer(vocab=learned["vocab"], merges=merges, eos_token="<|im_end|>",
                                            pad_token="<|endoftext|>", unk_token=None)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def resolve_model_name(name: str) -> str:
    """Alias -> hub id; `random:<alias>` and `tiny` are handled by load_policy."""
    return MODEL_ALIASES.get(name, name)


HUB_TIMEOUT_S = 5  # the one question asked of the hub before loading: answered or given up quickly, no retries
OFFLINE_MODELS = "tiny or random:<alias> (no download needed)"


def hub_model_cached(repo_id: str) -> bool:
    """Whether the Hugging Face cache holds repo_id's config and weights (loadable without network)."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError
    try:
        cached = [isinstance(try_to_load_from_cache(repo_id, name), str)
                  for name in ("config.json", "model.safetensors", "model.safetensors.index.json")]
    except HFValidationError:  # not a hub id at all
        return False
    return cached[0] and (cached[1] or cached[2])


@functools.lru_cache(maxsize=None)
def hub_answer(repo_id: str) -> str:
    """What the Hugging Face hub says about repo_id, asked once per process with a short timeout and
    no retries: "found", "missing", "offline" (HF_HUB_OFFLINE is set) or "unreachable: <why>"."""
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return "offline"
    try:
        huggingface_hub.HfApi().model_info(repo_id, timeout=HUB_TIMEOUT_S)
    except RepositoryNotFoundError:  # (also a private or gated one without the right login)
        return "missing"
    except HfHubHTTPError:  # another answer (a server error, a mirror without this API): loading will tell
        return "found"
    except Exception as error:  # no network, no name resolution, a refused or timed-out connection, a proxy
        return "unreachable: " + (str(error).strip().splitlines() or [type(error).__name__])[0]
    return "found"


def model_source_problem(name: str) -> Optional[str]:
    """Why --model `name` cannot be loaded, in one line that says what to do, or None. Decided in
    seconds and before anything is written: a local folder must hold a config.json, a hub id must
    be in the Hugging Face cache or known to the hub (asked once, HUB_TIMEOUT_S). With network
    nothing else changes: from_pretrained downloads as usual."""
    from huggingface_hub import constants
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id
    if name == "tiny" or name.startswith("random:"):
        return None
    source = resolve_model_name(name)
    folder = Path(source).expanduser()
    if folder.is_dir():
        return None if (folder / "config.json").is_file() else (
            f"--model {name}: {folder} has no config.json, so it is not a Hugging Face model folder (a run's "
            "teacher/ or student/ is one)")
    if folder.exists():
        return f"--model {name}: {folder} is a file; pass the folder that holds the model and its config.json"
    if source.startswith((".", "/", "~")) or source.count("/") > 1:  # written as a path, not as org/name
        return (f"--model {name}: no such folder; pass a folder that holds a Hugging Face model (config.json), "
                f"a hub id (org/name), or use {OFFLINE_MODELS}")
    try:
        validate_repo_id(source)
    except HFValidationError:
        return f"--model {name}: neither a local folder nor a hub id (org/name); or use {OFFLINE_MODELS}"
    if hub_model_cached(source):
        return None
    answer, cache = hub_answer(source), constants.HF_HUB_CACHE
    if answer == "missing":
        return (f"--model {name}: no local folder {source} and no model {source} on the Hugging Face hub: check "
                f"the name (org/name) or the folder's path (a private or gated model needs `hf auth login`)")
    if answer == "offline":
        return (f"--model {name}: {source} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set: "
                f"download it once with network, pass a local model folder, or use {OFFLINE_MODELS}")
    if answer.startswith("unreachable"):
        return (f"--model {name}: cannot reach the Hugging Face hub at {constants.ENDPOINT} ({answer[13:]}) and "
                f"{source} is not in its cache ({cache}): connect to the network, pass a local model folder, or use "
                f"{OFFLINE_MODELS}; HF_HUB_OFFLINE=1 loads cached models without asking the hub")
    return None


def load_policy(name: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """(model, tokenizer) for a hub id, local folder, alias, `random:<alias>` or `tiny`.

    The model's own generation config is replaced by a blank one: Qwen2.5-Instruct ships
    top_k=20, top_p=0.8, temperature=0.7, repetition_penalty=1.05, and RL needs samples from the
    full distribution (log-probs of the policy we actually train). rollout() passes its settings
    explicitly as well.
    """
    if name == "tiny" or name.startswith("random:"):
        tokenizer = build_tiny_tokenizer()
        shape = TINY_SHAPE if name == "tiny" else QWEN25_SHAPES[name.split(":", 1)[1]]
        shape = {"vocab_size": len(tokenizer), **shape}
        config = transformers.Qwen2Config(max_position_embeddings=32768, rope_theta=1e6,
                                          rms_norm_eps=1e-6, bos_token_id=None,
                                          eos_token_id=tokenizer.eos_token_id,
                                          pad_token_id=tokenizer.pad_token_id, **shape)
        with torch.random.fork_rng(devices=[]):  # same seed -> same weights; the global RNG is untouched
            torch.manual_seed(seed)
            model = transformers.Qwen2ForCausalLM(config).to(dtype)
    else:
        path = resolve_model_name(name)
        # a cached hub model while the hub cannot be reached: straight from the cache (asking the hub
        # first would retry for minutes)
        cached_only = (not Path(path).is_dir() and hub_model_cached(path)
                       and hub_answer(path).startswith("unreachable"))
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=cached_only)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=cached_only)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # generation continues at the right edge of every prompt
    eos = model.generation_config.eos_token_id or tokenizer.eos_token_id
    model.generation_config = transformers.GenerationConfig(eos_token_id=eos,
                                                            pad_token_id=tokenizer.pad_token_id)
    return model.to(device), tokenizer


def eos_token_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def estimate_memory_gb(model, cfg: Config, n_frozen: int, skill_tokens: int = 0,
                       device: Optional[torch.device] = None) -> dict:
    """Rough start-up estimate of a phase's peak accelerator memory, printed before it runs (GiB).

    Always resident: the trained policy's fp32 master weights + fp32 gradient + two fp32 AdamW
    moments (16 B/param), plus autocast's bf16 copy of the weights (2 B/param); the frozen
    teacher/reference, 4 or 2 B/param (--frozen-dtype). On top of that, the largest of three
    stages that never overlap (each frees its tensors before the next begins):
      rollout: the KV cache of the lock-step batch at full length (keys fp32 under autocast,
        values bf16; plus one layer, the copy each decode step's concatenation makes); the
        prefill's temporaries, for prefill_batch rows (all B*G when 0) of the widest prompt:
        one layer's working set per token (fp32 residual stream, its norm and the attention
        output, 12 B per hidden unit; three bf16 MLP tensors, 6 B per intermediate unit) and
        the boolean attention mask (width^2 B per row); sampling: three fp32 (B*G, vocab)
        tensors per decode step (generate's logits and softmax, our log-softmax).
      forward/backward: with gradient checkpointing one fp32 hidden state per layer per token
        of a micro-batch plus one layer's working set; log-probs: one chunk of
        vocabulary-sized fp32 logits and their softmax.
      optimizer step: AdamW's temporaries: none when fused (CUDA), about one fp32 copy of the
        parameters for the multi-tensor path (not used), two of the largest parameter's size for
        the CPU loop.
    device: where the run trains (default: the model's), which decides the AdamW path.
    """
    device = device or next(model.parameters()).device
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    shape = model.config
    hidden, intermediate, layers = shape.hidden_size, shape.intermediate_size, shape.num_hidden_layers
    frozen_bytes = 2 if cfg.frozen_dtype == "bfloat16" else 4
    per_layer_token = hidden * 4 * (1 if cfg.gradient_checkpointing else 24)
    activations = cfg.token_budget * (per_layer_token * layers + 6 * intermediate * 2)
    sequences = cfg.batch_tasks * cfg.group_size
    head_dim = hidden // shape.num_attention_heads
    prompt_width = cfg.max_prompt_tokens + skill_tokens
    kv_cache = (sequences * (prompt_width + cfg.max_response_tokens) * (layers + 1)
                * shape.num_key_value_heads * head_dim * (4 + 2))
    prefill_rows = min(cfg.prefill_batch or sequences, sequences)
    prefill = prefill_rows * prompt_width * (12 * hidden + 6 * intermediate + prompt_width)
    if device.type == "cuda":  # build_adamw: fused on CUDA
        optimizer_temporaries = 0
    else:  # torch's per-parameter loop on CPU: sqrt(v) and its quotient, for the largest parameter
        optimizer_temporaries = 2 * 4 * max(p.numel() for p in params)
    parts = dict(policy_and_adam=18 * n_params, frozen_models=frozen_bytes * n_params * n_frozen,
                 kv_cache=kv_cache, prefill=prefill, sampling=3 * sequences * shape.vocab_size * 4,
                 activations=activations, logits=cfg.logprob_chunk * shape.vocab_size * 12,
                 optimizer_temporaries=optimizer_temporaries)
    gib = {k: round(v / 2**30, 2) for k, v in parts.items()}
    stages = {"rollout": gib["kv_cache"] + gib["prefill"] + gib["sampling"],
              "forward_backward": gib["activations"] + gib["logits"],
              "optimizer_step": gib["optimizer_temporaries"]}
    gib["peak_stage"] = max(stages, key=stages.get)
    gib["total"] = round(gib["policy_and_adam"] + gib["frozen_models"] + stages[gib["peak_stage"]], 2)
    gib["params_millions"] = round(n_params / 1e6, 2)
    return gib


# ==================================================================================================
# 5. The math: one small pure function per equation
# ==================================================================================================
# Notation: episode i of group g (all G episodes of a group play the same task), turn
# t, response token k. r_{i,t} = R_i - 0.1 [turn t malformed] is the turn's score; l^old, l^T,
# l^theta are the log-probs of a sampled token under the rollout policy, the teacher (on the
# skill-augmented prompt s_t^T) and the policy being updated.


def grpo_advantages(scores: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantage of every turn-sample, normalised within its group.      (paper: RL backbone)

        A_{i,t} = (r_{i,t} - mean_g) / (std_g + eps)

    scores: (N,) one score per turn-sample; group_ids: (N,) integer group of each sample.
    Returns (N,) float32. Mean and unbiased std are over *all turn-samples of the group* (the
    verl-agent convention: each turn is one sample). A group whose scores are all equal, or
    that holds one sample, carries no signal and gets exactly 0 (never NaN).
    """
    scores = scores.double()
    _, group = torch.unique(group_ids, return_inverse=True)
    n_groups = int(group.max()) + 1 if group.numel() else 0
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, torch.ones_like(scores))
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, scores) / count
    sq_dev = (scores - mean[group]) ** 2
    var = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, sq_dev) / (count - 1).clamp(min=1)
    low = torch.full((n_groups,), math.inf, dtype=torch.float64).scatter_reduce(0, group, scores, "amin")
    high = torch.full((n_groups,), -math.inf, dtype=torch.float64).scatter_reduce(0, group, scores, "amax")
    no_signal = (count < 2) | (low == high)
    advantages = (scores - mean[group]) / (var.sqrt()[group] + eps)
    return torch.where(no_signal[group], torch.zeros_like(advantages), advantages).float()


def token_logprobs(hidden: torch.Tensor, tokens: torch.Tensor, lm_head: torch.nn.Module,
                   chunk: int = 1024, with_entropy: bool = False):
    """log pi(token) at response positions only, in chunks of rows.         (paper: every l above)

        l_k = z_k[y_k] - logsumexp(z_k),   z_k = lm_head(h_k)
        H_k = logsumexp(z_k) - sum_v softmax(z_k)_v z_{k,v}        (entropy, if asked)

    hidden: (N, H) final hidden states at the N positions that *predict* response tokens;
    tokens: (N,) the sampled ids. Returns (N,) float32 log-probs (and (N,) entropies).
    With a 151,936-token vocabulary the full (batch, seq, vocab) float32 log-softmax would take
    gigabytes; here at most `chunk` rows of logits exist at once. When gradients are on, each
    chunk is checkpointed so its logits are recomputed in backward instead of kept. For logits
    you already have, pass lm_head=torch.nn.Identity() and the logits as `hidden`.
    """
    weight, bias = getattr(lm_head, "weight", None), getattr(lm_head, "bias", None)

    def one_chunk(h, y):
        with torch.autocast(h.device.type, enabled=False):  # fp32 logits even under bf16 autocast
            if weight is not None and weight.dtype != torch.float32:  # a bf16 frozen model: its
                logits = torch.nn.functional.linear(h.float(), weight.float(),  # weights, fp32 sums
                                                    None if bias is None else bias.float())
            else:
                logits = lm_head(h.float()).float()
        log_norm = torch.logsumexp(logits, dim=-1)
        logp = logits.gather(-1, y.unsqueeze(-1)).squeeze(-1) - log_norm
        if not with_entropy:
            return logp, torch.zeros_like(logp)
        return logp, log_norm - (torch.softmax(logits, dim=-1) * logits).sum(-1)

    logps, entropies = [], []
    for start in range(0, hidden.shape[0], chunk):
        h, y = hidden[start:start + chunk], tokens[start:start + chunk]
        if torch.is_grad_enabled() and h.requires_grad:
            logp, entropy = torch.utils.checkpoint.checkpoint(one_chunk, h, y, use_reentrant=False)
        else:
            logp, entropy = one_chunk(h, y)
        logps.append(logp)
        entropies.append(entropy)
    logp = torch.cat(logps) if logps else hidden.new_zeros(0, dtype=torch.float32)
    entropy = torch.cat(entropies) if entropies else torch.zeros_like(logp)
    return (logp, entropy) if with_entropy else logp


def k3(logp: torch.Tensor, other_logp: torch.Tensor) -> torch.Tensor:
    """The k3 estimate of KL(pi || other) per token, for tokens sampled from pi.

        k3_k = exp(l^other_k - l_k) - 1 + (l_k - l^other_k)   >= 0, exactly 0 where l = l^other

    (..., T) -> (..., T). Unbiased, never negative, low variance (Schulman's "approximating KL").
    """
    log_ratio = other_logp - logp
    return torch.exp(log_ratio) - 1 - log_ratio


def teacher_student_gap(old_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor):
    """The retirement statistic K of one iteration, and its k3 companion.   (paper: Sec. retirement)

        K    = sum_k mask_k (l^old_k - l^T_k) / sum_k mask_k        (signed: the k1 estimate)
        K_k3 = sum_k mask_k k3(l^old_k, l^T_k) / sum_k mask_k       (never negative)

    Both estimate KL(student || teacher) on the student's own samples, over all response tokens of
    all turn-samples of the iteration. K is what the rule reads (the authors' K = -gap_mean); it
    can be negative on a batch where the teacher likes the sampled tokens more than the student
    does. K_k3 is a diagnostic: the discrepancy a plot should show beside K. Returns two floats.
    """
    tokens = mask.sum().clamp(min=1)
    gap = float(((old_logp - teacher_logp) * mask).sum() / tokens)
    return gap, float((k3(old_logp, teacher_logp) * mask).sum() / tokens)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, clip: float = 0.2, dual_clip: float = 3.0,
                ref_logp: Optional[torch.Tensor] = None, kl_coef: float = 0.0,
                entropy: Optional[torch.Tensor] = None, entropy_coef: float = 0.0,
                num_tokens: Optional[float] = None):
    """PPO-clip surrogate with verl's dual clip, plus the reference KL and the entropy bonus.
                                                                     (paper: the RL backbone)
        ratio_k = exp(clamp(l^theta_k - l^old_k, -20, 20))   (verl's clamp: never inf)
        L^clip_k = max(-ratio_k A_k, -clip(ratio_k, 1-eps, 1+eps) A_k)
        L^PG_k  = min(L^clip_k, -c A_k)  where A_k < 0  (dual clip: a huge ratio on a bad token
                  cannot blow the loss up),  L^clip_k elsewhere
        L = sum_k mask_k [L^PG_k + kl_coef min(k3(l^theta_k, l^ref_k), 10) - entropy_coef H_k] / num_tokens

    All tensors (B, T) (or any matching shape); `advantages` per token (a turn-sample's GRPO
    advantage repeated over its tokens). The KL term (phase 1 and --algo grpo) is clamped at 10 as
    verl's low_var_kl is. num_tokens is the token count of the whole mini-batch (default:
    mask.sum()), so the losses of micro-batches add up to the mini-batch's token-mean. Returns
    (loss, stats); stats are sums over tokens divided by num_tokens too, so they add up across
    micro-batches the same way: clip_frac (the clipped term was the larger), dual_clip_frac (the
    dual clip was active), approx_kl_old (mean l^old - l^theta), kl_ref, entropy.
    """
    num_tokens = max(float(mask.sum()) if num_tokens is None else float(num_tokens), 1.0)
    ratio = torch.exp(torch.clamp(logp - old_logp, -20.0, 20.0))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip, 1 + clip)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_cap = -advantages * dual_clip
    per_token = torch.where(advantages < 0, torch.minimum(clip_loss, dual_cap), clip_loss)
    mean = lambda values: float((values.detach().float() * mask).sum() / num_tokens)  # noqa: E731
    stats = {"pg_loss": mean(per_token), "clip_frac": mean(clipped > unclipped),
             "dual_clip_frac": mean((clip_loss > dual_cap) & (advantages < 0)),
             "approx_kl_old": mean(old_logp - logp)}
    if kl_coef > 0 and ref_logp is not None:
        kl_ref = torch.clamp(k3(logp, ref_logp), max=10.0)
        per_token = per_token + kl_coef * kl_ref
        stats["kl_ref"] = mean(kl_ref)
    if entropy_coef > 0 and entropy is not None:
        per_token = per_token - entropy_coef * entropy
        stats["entropy"] = mean(entropy)
    return (per_token * mask).sum() / num_tokens, stats


def opd_loss(logp: torch.Tensor, old_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor,
             num_tokens: Optional[float] = None):
    """The on-policy distillation loss, a term of its own outside the PPO clip.  (paper: OPD term)

        rho_k  = exp(min(l^theta_k - l^old_k, 10))                     (importance weight)
        k3_k   = exp(min(l^T_k - l^theta_k, 20)) - 1 + (l^theta_k - l^T_k)
        L_OPD  = sum_k mask_k rho_k k3_k / num_tokens,   total loss L = L_PPO + lambda L_OPD

    (B, T) tensors; l^old and l^T are constants, the gradient flows through l^theta in both
    factors: d(rho k3)/dl^theta = rho (l^theta - l^T) (the clamps cut it where they bind). That is
    the reverse-KL policy gradient with an unclipped, importance-weighted per-token advantage
    lambda (l^T - l^theta): the student is pushed toward tokens the teacher finds likelier than
    it does. (Differentiating mean(l^theta - l^T) instead has zero expected gradient, because
    E_pi[grad log pi] = 0; test_retireopd shows both facts.) Returns (loss, {"opd_loss": ...}).
    """
    num_tokens = max(float(mask.sum()) if num_tokens is None else float(num_tokens), 1.0)
    teacher_logp, old_logp = teacher_logp.detach(), old_logp.detach()
    weight = torch.exp(torch.clamp(logp - old_logp, max=10.0))
    k3_teacher = torch.exp(torch.clamp(teacher_logp - logp, max=20.0)) - 1 + (logp - teacher_logp)
    loss = (weight * k3_teacher * mask).sum() / num_tokens
    return loss, {"opd_loss": float(loss.detach())}


# ----- the retirement rule: the authors' state machine, as three pure pieces and one latch -------
# Each phase-2 iteration's gap K goes into a block of W iterations; a full block's mean is kept.
# At every validation the oldest full block not yet judged is judged against the previous judged
# one: the first only sets the baselines, so with W = 5 = eval_every the earliest decision is at
# the validation after iteration 10 (1-based) and the teacher is gone from iteration 11.


def alignment_progress(previous_block: Optional[float], block: float, eps: float = 1e-8) -> Optional[float]:
    """How much the gap shrank from one block to the next.          (paper: retirement condition i)

        progress = (K_{m-1} - K_m) / K_{m-1}

    None (the criterion is invalid) when there is no previous block or |K_{m-1}| <= eps.
    "Stopped shrinking" is progress <= threshold (0.0): the gap did not decrease at all.
    """
    if previous_block is None or abs(previous_block) <= eps:
        return None
    return (previous_block - block) / previous_block


def competence(success: float, previous_success: float, teacher_success: float) -> float:
    """The student's competence relative to its teacher.            (paper: retirement condition ii)

        competence = (S_m + S_{m-1}) / (2 S_T)

    S_m, S_{m-1}: the student's validation successes at this judging validation and the previous
    one; S_T > 0: the teacher's validation success with skills.
    """
    return (success + previous_success) / (2 * teacher_success)


def should_retire(progress: Optional[float], competence_ratio: Optional[float], threshold: float = 0.0,
                  rho: float = 0.9) -> bool:
    """Both conditions: the criterion is valid, progress <= threshold and competence >= rho."""
    return progress is not None and competence_ratio is not None and progress <= threshold \
        and competence_ratio >= rho


@dataclass
class Retirement:
    """Phase 2's retirement state: K blocks, the judged baselines, and the latch.

    mode "adaptive": the rule above; "fixed": --retire-at N (the teacher scores N iterations);
    "never": grpo+opd and opd (the rule's numbers are still logged). The whole state is saved in
    every checkpoint, so a resumed run decides exactly as an uninterrupted one.
    """
    teacher_success: Optional[float]  # S_T (> 0 for the adaptive rule)
    mode: str = "adaptive"
    window: int = 5
    threshold: float = 0.0
    rho: float = 0.9
    retire_at: Optional[int] = None
    eps: float = 1e-8
    pending: list = field(default_factory=list)  # K of the block being filled
    blocks: list = field(default_factory=list)  # [last iteration, mean K] of each full block
    judged: int = 0  # blocks judged so far (FIFO)
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
        """Judge the oldest unjudged full block, if any, with this validation's success."""
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
# 6. Rollout: B tasks x G episodes, played in lock-step
# ==================================================================================================
# At every turn the prompts of all still-active episodes are generated in one batched call
# (left padding, KV cache), then every environment is stepped. Each turn becomes one training
# sample (TurnSample). The policy's prompt carries the skill block only in phase 1 (the teacher
# trains with its skills); in phase 2 the student's prompt is skill-free and the teacher prompt
# s_t^T of the same turn is stored beside it for scoring.


@dataclass
class TurnSample:
    group: int  # g: which task of the iteration (all G episodes of a task share it)
    episode: int  # i: which episode
    prompt_ids: list  # the policy's prompt tokens (s_t; with skills in phase 1)
    response_ids: list  # y: the tokens the policy sampled (ending in EOS unless cut)
    malformed: bool  # no <think>/<action> pair, CJK, or cut at max_response_tokens
    teacher_prompt_ids: Optional[list] = None  # s_t^T, when a teacher will score y
    score: float = 0.0  # r_{i,t} = R_i - 0.1 [malformed], set when the episode ends
    sample_logp: Optional[torch.Tensor] = None  # (len(y),) log-probs of y as the sampler saw them


@dataclass
class Episode:
    env: Any
    group: int
    task: str = ""
    task_type: str = ""
    observation: str = ""
    admissible: list = field(default_factory=list)
    history: list = field(default_factory=list)  # (observation, action) pairs
    turns: int = 0
    won: bool = False
    done: bool = False
    error: Optional[str] = None


def autocast(device: torch.device):
    """bf16 compute on GPU over fp32 master weights (see the Config notes); plain fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    import contextlib
    return contextlib.nullcontext()


def encode_prompt(tokenizer, user_message: str) -> list:
    messages = [{"role": "user", "content": user_message}]  # the template adds its default system turn
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def episode_prompts(tokenizer, episode: Episode, cfg: Config, skills: str) -> tuple[list, list, bool]:
    """(student prompt ids, teacher prompt ids, truncated) for the episode's current turn.

    When the student prompt exceeds max_prompt_tokens we drop history pairs, then keep the tail
    of the observation. The teacher prompt is built from exactly the same content plus the skill
    block: it is never cut (its budget is the student's plus the skill block).
    """
    history, observation, truncated = episode.history[-cfg.history:] if cfg.history else [], \
        episode.observation, False
    while True:
        student = encode_prompt(tokenizer, build_user_message(
            cfg.env, episode.task, episode.turns, history, observation, episode.admissible))
        if len(student) <= cfg.max_prompt_tokens:
            break
        truncated = True
        if history:
            history = history[1:]
        elif len(observation) > 200:
            observation = "..." + observation[len(observation) // 2:]
        else:
            break  # the admissible list alone is too long: keep it, the budget is advisory here
    teacher = encode_prompt(tokenizer, build_user_message(
        cfg.env, episode.task, episode.turns, history, observation, episode.admissible, skills)) \
        if skills else student
    return student, teacher, truncated


@contextlib.contextmanager
def fp32_output_head(model):
    """Run the output head outside autocast: under bf16 autocast Hugging Face's generate would
    sample from bf16-rounded logits, while the log-probs we train on come from fp32 logits
    (token_logprobs). Only the last position goes through the head, so this costs nothing."""
    head = model.get_output_embeddings()

    def forward(hidden):
        with torch.autocast(hidden.device.type, enabled=False):
            return type(head).forward(head, hidden.to(head.weight.dtype)).float()

    head.forward = forward  # an instance attribute shadows the class's forward until deleted
    try:
        yield
    finally:
        del head.forward


class SampledTokenLogprobs(transformers.LogitsProcessor):
    """Records log pi(y_k | s, y_<k) of every token that generate samples, keeping only the
    previous step's (batch, vocab) log-softmax, never the (steps, batch, vocab) scores.

    At step k generate calls it with the fp32 scores of token k while input_ids end with token
    k-1: it gathers token k-1 from the log-softmax kept at step k-1, then keeps step k's; `finish`
    gathers the last token once generate has returned. Cost: one (batch, vocab) log-softmax and
    gather per step, beside generate's own softmax of the same scores.

    Position in the processor list (transformers 5.24, `_get_logits_processor`): the processors
    passed to generate come after the built-in logits processors (none is active with our
    settings: no repetition penalty, no bad words, no minimum length) and *before* the sampling
    warpers (temperature, top-k, top-p). The scores seen here are therefore the temperature-1
    distribution, which is the one sampled from in every training rollout (temperature 1 is
    enforced); at another temperature (evaluation) they are not the sampled distribution's.
    """

    def __init__(self):
        self.previous: Optional[torch.Tensor] = None  # (batch, vocab) log-softmax of the last step
        self.picked: list = []  # per step k: (batch,) log-prob of token k

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.previous is not None:
            self.picked.append(self.previous.gather(1, input_ids[:, -1:]).squeeze(1))
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        return scores  # the distribution is left untouched

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """(batch, steps) log-probs of new_tokens, the (batch, steps) ids generate appended. A
        step generate ran and then undid (its deferred stop check) is dropped."""
        steps = new_tokens.shape[1]
        if len(self.picked) < steps:  # the last step's token is only known now
            self.picked.append(self.previous.gather(1, new_tokens[:, len(self.picked), None]).squeeze(1))
        self.previous = None
        if len(self.picked) < steps:
            raise RuntimeError(f"generate made {steps} steps but showed the scores of {len(self.picked)}")
        return torch.stack(self.picked[:steps], dim=1)


def prefill_cache(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows_per_forward: int):
    """KV cache of input_ids[:, :-1] (all prompt columns but the last), built rows_per_forward
    rows at a time, so that the prefill's temporaries (one layer's activations for every prompt
    token in the forward) grow with rows_per_forward x width instead of B*G x width.

    input_ids, attention_mask: (batch, width), left padded. Positions are numbered as generate
    numbers them (count of real tokens before, 0 on padding). The sub-batch caches are joined
    along the batch dimension one layer at a time, each part freed as it is copied, so the join
    costs one layer's cache on top of the cache itself. model.generate, given the full input_ids
    and this cache, then runs only the last prompt column for all rows, and decodes on.
    """
    positions = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    parts = []
    for start in range(0, input_ids.shape[0], rows_per_forward):
        rows = slice(start, start + rows_per_forward)
        out = model.base_model(input_ids=input_ids[rows, :-1], attention_mask=attention_mask[rows, :-1],
                               position_ids=positions[rows, :-1], use_cache=True,
                               cache=transformers.DynamicCache(config=model.config))
        parts.append(out.cache)
        del out  # its last_hidden_state is not needed: generate recomputes the last column

    def joined_layers():
        for layer in range(len(parts[0].layers)):
            keys = torch.cat([part.layers[layer].keys for part in parts])
            values = torch.cat([part.layers[layer].values for part in parts])
            for part in parts:
                part.layers[layer].keys = part.layers[layer].values = None
            yield keys, values

    return transformers.DynamicCache(joined_layers(), config=model.config)


class Sampled(NamedTuple):
    ids: list  # the response's token ids, ending in EOS unless cut
    hit_cap: bool  # cut at max_new_tokens without EOS
    logp: Optional[torch.Tensor] = None  # (len(ids),) fp32, CPU: log-prob of each token at sampling time


@torch.no_grad()
def generate(model, tokenizer, prompts: list, max_new_tokens: int, temperature: float,
             prefill_batch: int = 0) -> list:
    """Sample one response per prompt in one batched call. Returns [Sampled] in prompt order.

    The sampling settings are passed in full (temperature, top_k=0, top_p=1, no repetition
    penalty) and the logits are fp32: the log-probs we train on are those of the distribution
    pi(.|s) we sampled from. Each response carries the temperature-1 log-prob of its tokens as
    the sampler saw them (SampledTokenLogprobs), to compare with the scoring pass.
    prefill_batch: prompts prefilled per forward (prefill_cache) when fewer than len(prompts);
    0 prefills all of them in generate's own single forward.
    """
    pad = tokenizer.pad_token_id
    width = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    eos = eos_token_ids(model)
    sampling = transformers.GenerationConfig(
        do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
        top_k=0 if temperature > 0 else None, top_p=1.0 if temperature > 0 else None,
        repetition_penalty=1.0, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad)
    recorder = SampledTokenLogprobs()
    with autocast(device), fp32_output_head(model):
        split = 0 < prefill_batch < len(prompts) and width > 1
        cache = prefill_cache(model, input_ids, attention_mask, prefill_batch) if split else None
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=sampling,
                             logits_processor=transformers.LogitsProcessorList([recorder]), cache=cache)
    new_tokens = out[:, width:]
    logps = recorder.finish(new_tokens).float().cpu()
    responses = []
    for row, logp in zip(new_tokens.tolist(), logps):
        end = next((k for k, tok in enumerate(row) if tok in eos), None)
        n, cut = (end + 1, False) if end is not None else (len(row), True)
        responses.append(Sampled(row[:n], cut, logp[:n]))
    return responses


def rollout(model, tokenizer, suite: TaskSuite, tasks: list, cfg: Config, *, group_size: int,
            policy_skills: bool, teacher_skills: bool, temperature: float, desc: str = "rollout"):
    """Play len(tasks) * group_size episodes in lock-step. Returns (samples, episodes, stats).

    policy_skills: the policy's own prompt carries the skill block (phase 1, teacher evaluation).
    teacher_skills: also store s_t^T for every turn so a teacher can score it (phase 2 with OPD).
    """
    timers = {"t_generate": 0.0, "t_env": 0.0}
    start = time.perf_counter()
    episodes = []
    for group, task in enumerate(tasks):
        for _ in range(group_size):
            episodes.append(Episode(env=suite.new_episode(task, group), group=group))
    resets = env_calls([(episode.env, "reset", ()) for episode in episodes])
    for episode, result in zip(episodes, resets):
        if isinstance(result, Exception):  # a broken task ends as a failure; the run goes on
            episode.done, episode.error = True, f"reset: {result!r}"
            continue
        episode.observation, info = result
        episode.task, episode.task_type = info["task"], info["task_type"]
        episode.admissible = info["admissible"]
    timers["t_env"] += time.perf_counter() - start
    samples: list[TurnSample] = []
    by_episode: dict[int, list[TurnSample]] = {}
    generated_tokens, truncated_prompts, generate_steps = 0, 0, 0
    model.eval()
    bar = tqdm(total=cfg.max_turns, desc=desc, leave=False, dynamic_ncols=True,
               disable=not sys.stderr.isatty())  # inner bars only in a terminal, not in log files
    for _turn in range(cfg.max_turns):
        active = [i for i, e in enumerate(episodes) if not e.done]
        if not active:
            break
        prompts, teacher_prompts = [], []
        for i in active:
            skills = skill_text(cfg.env, episodes[i].task_type)
            student, teacher, truncated = episode_prompts(tokenizer, episodes[i], cfg, skills)
            prompts.append(teacher if policy_skills else student)
            teacher_prompts.append(teacher if teacher_skills else None)
            truncated_prompts += truncated
        t0 = time.perf_counter()
        responses = generate(model, tokenizer, prompts, cfg.max_response_tokens, temperature,
                             prefill_batch=cfg.prefill_batch)
        timers["t_generate"] += time.perf_counter() - t0
        generate_steps += max(len(r.ids) for r in responses)  # the batch decodes to its longest answer
        t0 = time.perf_counter()
        stepping = []  # (episode, action); malformed answers are no-ops: the env is not stepped
        for i, prompt, teacher_prompt, response in zip(active, prompts, teacher_prompts, responses):
            episode = episodes[i]
            generated_tokens += len(response.ids)
            action = None if response.hit_cap else parse_action(
                tokenizer.decode(response.ids, skip_special_tokens=True))
            sample = TurnSample(episode.group, i, prompt, response.ids, action is None, teacher_prompt,
                                sample_logp=response.logp)
            samples.append(sample)
            by_episode.setdefault(i, []).append(sample)
            episode.turns += 1
            if action is not None:
                stepping.append((episode, action))
        results = env_calls([(episode.env, "step", (action,)) for episode, action in stepping])
        for (episode, action), result in zip(stepping, results):
            if isinstance(result, Exception):
                episode.done, episode.error = True, f"step: {result!r}"
                continue
            observation, _, env_done, info = result
            episode.history.append((episode.observation, action))
            episode.observation, episode.admissible = observation, info["admissible"]
            episode.won, episode.done = bool(info["won"]), bool(env_done or info["won"])
            if info.get("error"):
                episode.error = info["error"]
        for i in active:
            if episodes[i].turns >= cfg.max_turns:
                episodes[i].done = True
        timers["t_env"] += time.perf_counter() - t0
        bar.update(1)
        bar.set_postfix(active=len(active), won=sum(e.won for e in episodes))
    bar.close()
    t0 = time.perf_counter()  # hand engines back (to this process's pool, or the worker's)
    env_calls([(episode.env, "close", ()) for episode in episodes if hasattr(episode.env, "close")])
    timers["t_env"] += time.perf_counter() - t0
    for i, episode in enumerate(episodes):  # r_{i,t} = R_i - penalty [turn t malformed]
        episode_reward = cfg.success_reward if episode.won else 0.0
        for sample in by_episode.get(i, []):
            sample.score = episode_reward - cfg.malformed_penalty * sample.malformed
    stats = {"success": sum(e.won for e in episodes) / max(len(episodes), 1),
             "reward": sum(cfg.success_reward * e.won for e in episodes) / max(len(episodes), 1),
             "turns": sum(e.turns for e in episodes) / max(len(episodes), 1),
             "malformed_frac": sum(s.malformed for s in samples) / max(len(samples), 1),
             "env_errors": sum(e.error is not None for e in episodes),
             "prompts_truncated": truncated_prompts, "gen_tokens": generated_tokens,
             "gen_steps": generate_steps, "samples": len(samples), **timers}
    stats["gen_tokens_per_s"] = generated_tokens / max(timers["t_generate"], 1e-9)
    stats["gen_ms_per_step"] = 1000 * timers["t_generate"] / max(generate_steps, 1)
    return samples, episodes, stats

# ==================================================================================================
# 7. Update: old / teacher / reference log-probs, then PPO-clip in mini-batches
# ==================================================================================================


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


def response_logprobs(model, prompts: list, responses: list, cfg: Config, with_entropy: bool = False):
    """Log-probs (and entropies) of each response's tokens given its prompt, one forward pass.

    prompts, responses: lists of token-id lists (the *same* response ids are scored under
    whichever prompt is given: the student's s_t or the teacher's s_t^T). Sequences are right
    padded (positions 0..L-1 as in generation, padding after the end cannot affect earlier
    tokens under causal attention), and only the hidden states that predict response tokens go
    through lm_head. Returns flat tensors over all response tokens, in input order.
    Gradients flow iff enabled by the caller.
    """
    device = next(model.parameters()).device
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    width = max(lengths)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    attention_mask = torch.zeros_like(input_ids)
    rows, cols, targets = [], [], []
    for b, (prompt, response) in enumerate(zip(prompts, responses)):
        sequence = prompt + response
        input_ids[b, : len(sequence)] = torch.tensor(sequence, device=device)
        attention_mask[b, : len(sequence)] = 1
        rows += [b] * len(response)
        cols += range(len(prompt) - 1, len(sequence) - 1)  # position t predicts token t+1
        targets += response
    with autocast(device):
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                  use_cache=False).last_hidden_state
    picked = hidden[torch.tensor(rows, device=device), torch.tensor(cols, device=device)]
    with autocast(device):
        return token_logprobs(picked, torch.tensor(targets, device=device),
                              model.get_output_embeddings(), cfg.logprob_chunk, with_entropy)


def sample_logp_gap(samples: list, old_logp: list) -> dict:
    """|l^sample - l^old| over every response token: the log-prob each token had when it was
    sampled (cached decode, TurnSample.sample_logp) against the scoring pass's (full forward).

    Both are pi_old at temperature 1, so the gap measures numerics only: ~1e-7 in fp32 on CPU; on
    a GPU under bf16 autocast, how far the PPO ratio starts from 1. Samples without a recorded
    log-prob (a scripted generate) are left out; no key at all when none has one.
    """
    pairs = [(s.sample_logp, old) for s, old in zip(samples, old_logp) if s.sample_logp is not None]
    if not pairs:
        return {}
    gap = (torch.cat([sampled for sampled, _ in pairs]) - torch.cat([old for _, old in pairs])).abs()
    return {"sample_logp_gap_mean": float(gap.mean()), "sample_logp_gap_max": float(gap.max())}


@torch.no_grad()
def score_samples(model, samples: list, cfg: Config, use_teacher_prompt: bool = False) -> list:
    """Per-sample response log-probs under a frozen view of `model` (old policy, teacher, ref)."""
    model.eval()
    prompts = [s.teacher_prompt_ids if use_teacher_prompt else s.prompt_ids for s in samples]
    lengths = [len(p) + len(s.response_ids) for p, s in zip(prompts, samples)]
    out: list = [None] * len(samples)
    for batch in make_micro_batches(lengths, cfg.token_budget):
        flat = response_logprobs(model, [prompts[i] for i in batch],
                                 [samples[i].response_ids for i in batch], cfg)
        for i, logp in zip(batch, flat.split([len(samples[i].response_ids) for i in batch])):
            out[i] = logp.float().cpu()
    return out


def ppo_update(model, optimizer, samples: list, old_logp: list, advantages: Optional[list], cfg: Config, *,
               mini_batch: int, kl_coef: float = 0.0, ref_logp: Optional[list] = None,
               teacher_logp: Optional[list] = None, opd_coef: float = 0.0,
               rng: Optional[random.Random] = None) -> dict:
    """One epoch (cfg.ppo_epochs) over the turn-samples: mini-batches -> token-budget micro-batches.

        L = L_PPO(advantages) + kl_coef KL_ref - entropy_coef H  +  opd_coef L_OPD(teacher_logp)

    advantages[i]: the per-token advantage of sample i (shape (len(response_i),)), or None for
    pure OPD, which trains on opd_coef * L_OPD alone. teacher_logp: the teacher's log-probs of
    the same tokens (None: no OPD term). Each optimizer step uses one mini-batch; its loss is the
    token-mean over the whole mini-batch, accumulated over micro-batches. A non-finite loss or
    gradient skips that step (counted, never applied).
    """
    rng = rng or random.Random(0)
    device = next(model.parameters()).device
    model.train()
    totals: dict = {}
    steps = skipped = 0
    trained_tokens = padded_tokens = 0
    grad_norms = []
    with_entropy = advantages is not None and cfg.entropy_coef > 0
    for _epoch in range(cfg.ppo_epochs):
        order = list(range(len(samples)))
        rng.shuffle(order)
        for start in range(0, len(order), mini_batch):
            mini = order[start:start + mini_batch]
            num_tokens = sum(len(samples[i].response_ids) for i in mini)
            lengths = [len(samples[i].prompt_ids) + len(samples[i].response_ids) for i in mini]
            optimizer.zero_grad(set_to_none=True)
            finite = True
            for micro in make_micro_batches(lengths, cfg.token_budget):
                idx = [mini[j] for j in micro]
                padded_tokens += len(idx) * max(lengths[j] for j in micro)
                trained_tokens += sum(lengths[j] for j in micro)
                scored = response_logprobs(
                    model, [samples[i].prompt_ids for i in idx], [samples[i].response_ids for i in idx],
                    cfg, with_entropy=with_entropy)
                logp, entropy = scored if with_entropy else (scored, None)
                cat = lambda tensors: torch.cat([tensors[i] for i in idx]).to(device)  # noqa: E731
                mask = torch.ones_like(logp)
                loss, stats = logp.new_zeros(()), {}
                if advantages is not None:
                    loss, stats = policy_loss(
                        logp, cat(old_logp), cat(advantages), mask, cfg.clip_eps, cfg.dual_clip,
                        ref_logp=cat(ref_logp) if ref_logp is not None else None, kl_coef=kl_coef,
                        entropy=entropy, entropy_coef=cfg.entropy_coef, num_tokens=num_tokens)
                if teacher_logp is not None and opd_coef > 0:
                    distill, distill_stats = opd_loss(logp, cat(old_logp), cat(teacher_logp), mask, num_tokens)
                    loss = loss + opd_coef * distill
                    stats.update(distill_stats)
                if not torch.isfinite(loss):
                    finite = False
                    break
                loss.backward()
                for key, value in stats.items():
                    totals[key] = totals.get(key, 0.0) + value
                totals["loss"] = totals.get("loss", 0.0) + float(loss.detach())
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            if not finite or not torch.isfinite(grad_norm):
                skipped += 1
                optimizer.zero_grad(set_to_none=True)
                continue
            for group in optimizer.param_groups:  # linear warm-up (--lr-warmup-steps), then cfg.lr
                group["lr"] = cfg.lr * min(1.0, (optimizer_steps_taken(optimizer) + 1) / max(cfg.lr_warmup_steps, 1))
            optimizer.step()
            steps += 1
            grad_norms.append(float(grad_norm))
    optimizer.zero_grad(set_to_none=True)
    n = max(steps + skipped, 1)
    out = {key: value / n for key, value in totals.items()}
    out.update(optimizer_steps=steps, skipped_steps=skipped, trained_tokens=trained_tokens,
               grad_norm=sum(grad_norms) / max(len(grad_norms), 1),
               padding_frac=1 - trained_tokens / max(padded_tokens, 1))
    return out


def optimizer_steps_taken(optimizer: torch.optim.Optimizer) -> int:
    """Steps this AdamW has taken (its per-parameter step count; restored with its state)."""
    state = optimizer.state.get(optimizer.param_groups[0]["params"][0], {})
    return int(state["step"]) if "step" in state else 0


def build_adamw(model, cfg: Config) -> torch.optim.AdamW:
    """AdamW over the fp32 master weights; fused on CUDA: one kernel per step, and no temporary
    copy of the parameters (the default multi-tensor path allocates about one fp32 copy, ~6 GB
    at 1.5B). Plain on CPU."""
    on_cuda = next(model.parameters()).device.type == "cuda"
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                             fused=True if on_cuda else None)

# ==================================================================================================
# 8. Phases: Skill-GRPO teacher, then GRPO + OPD student with adaptive retirement
# ==================================================================================================


def read_jsonl(path: Path, note: bool = False) -> list:
    """The records of a jsonl log ([] without the file). A last line cut short (a crash or a full
    disk while it was written) is dropped, with a note when `note`; a damaged line before the
    last is an error."""
    path = Path(path)
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise SystemExit(f"retireopd: {path} line {number} is not JSON: the log is damaged before its last "
                                 "line (repair or delete that line)") from None
            if note:
                print(f"[retireopd] note: the last line of {path} was cut short (a crash while it was written): "
                      "dropped")
    return records


def write_text_atomically(path: Path, text: str) -> None:
    """path.write_text(text) that a crash cannot leave half-written: a temp file, then a rename."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


RUN_IDENTITY = "run.json"  # what a run folder holds: written when the run starts, kept by --resume
RUN_ENTRIES = (RUN_IDENTITY, "config.json", "metrics.jsonl", "events.jsonl", "eval.jsonl", "checkpoints",
               "teacher", "student")  # any of these: the folder holds a run (of any version of this script)


def holds_a_run(folder: Path) -> bool:
    return any((Path(folder) / name).exists() for name in RUN_ENTRIES)


def run_identity(folder: Path, cfg: Config) -> dict:
    """The folder's run.json: which run it holds (an id, when it started, what it runs). Read when it
    exists (a resumed run keeps its id), written otherwise. Checkpoints carry the id."""
    path = folder / RUN_IDENTITY
    with contextlib.suppress(OSError, ValueError):
        return json.loads(path.read_text())
    identity = {"run_id": f"{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(4).hex()}",
                "started": time.strftime("%Y-%m-%d %H:%M:%S"), "algo": cfg.algo, "env": cfg.env, "model": cfg.model}
    write_text_atomically(path, json.dumps(identity, indent=2) + "\n")
    return identity


def saved_model_problem(folder: Path) -> Optional[str]:
    """Why a saved model folder is not whole, or None. Every .json file must parse and every
    .safetensors file must be as long as its header says: a file cut short by a crash or a full
    disk fails one of them. Cheap: the weights themselves are not read."""
    weights = sorted(folder.glob("*.safetensors"))
    if not (folder / "config.json").is_file() or not weights:
        return "no config.json" if weights else "no .safetensors weights"
    for path in sorted(folder.glob("*.json")):
        try:
            json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError):
            return f"{path.name} is cut short or damaged"
    for path in weights:
        size = path.stat().st_size
        with open(path, "rb") as f:
            header_size = int.from_bytes(f.read(8), "little")
            try:
                header = json.loads(f.read(header_size)) if 8 + header_size <= size else None
            except (ValueError, UnicodeDecodeError):
                header = None
        try:
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (AttributeError, KeyError, TypeError, IndexError):  # (a list or a string is no header either)
            return f"{path.name} is cut short (its header is incomplete)"
        if size < 8 + header_size + end:
            return f"{path.name} is cut short ({size} of {8 + header_size + end} bytes)"
    return None


def format_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class Run:
    """The side effects of a run: its folder, the jsonl logs, models and checkpoints.

    run_dir/run.json           which run the folder holds (its id; a new run refuses such a folder)
    run_dir/config.json        the resolved Config
    run_dir/metrics.jsonl      one line per training iteration (README: glossary)
    run_dir/events.jsonl       start, teacher ready, retirement, done
    run_dir/eval.jsonl         evaluations on the fixed panel, per task type
    run_dir/teacher, student   final models, Hugging Face format in bf16 (+ retireopd.json)
    run_dir/checkpoints/       resumable checkpoints: fp32 policy + trainer.pt (optimizer, RNG, retirement)
    """
    latest: Optional[Path] = None  # the folder of the last Run made in this process (the interrupt message)

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.dir = Path(cfg.run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run_id = run_identity(self.dir, cfg)["run_id"]
        write_text_atomically(self.dir / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2))
        self.started = time.time()
        Run.latest = self.dir

    def log(self, name: str, record: dict) -> None:
        try:
            with open(self.dir / name, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as error:
            raise SystemExit(self.write_failure(name, error)) from None

    def write_failure(self, name: str, error: Exception) -> str:
        """The one line of a write into the run folder that failed (a full disk, a quota): what, why,
        what is kept, what to do."""
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        free = shutil.disk_usage(self.dir).free
        newest = (self.checkpoints() or [None])[-1]
        needed = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file()) if newest else 0
        full = getattr(error, "errno", None) == errno.ENOSPC or "No space left" in reason or free < needed
        kept = (f"the last checkpoint, {newest.name}, is kept: `--resume {self.dir}` continues from it" if newest
                else "no checkpoint was written yet")
        return (f"retireopd: could not write {self.dir / name} ({'the disk is full: ' if full else ''}{reason}; "
                f"{format_bytes(free)} free there" + (f", a checkpoint takes {format_bytes(needed)}" if needed else "")
                + f"); {kept}; free some space, or keep fewer checkpoints or write them less often with "
                "--keep-checkpoints and --save-every (--resume accepts new values of both)")

    def save_model(self, model, tokenizer, name: str, extra: Optional[dict] = None,
                   trainer_state: Optional[dict] = None, dtype: Optional[torch.dtype] = torch.bfloat16) -> Path:
        """Hugging Face format (from_pretrained / vLLM), written to a temp folder then renamed,
        so a crash mid-write never leaves a half checkpoint under the final name.

        dtype: the weights' dtype on disk, bf16 by default (final models: half the size, and
        servable: vLLM's dtype=auto serves a float32 checkpoint in fp16, where Qwen2.5 breaks
        down); None keeps the fp32 master weights (resumable checkpoints). The live model is
        not changed."""
        from safetensors import SafetensorError
        final, tmp = self.dir / name, self.dir / f"{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            if dtype is None:
                model.save_pretrained(tmp)
            else:
                save_pretrained_as(model, tmp, dtype)
            tokenizer.save_pretrained(tmp)
            if extra is not None:
                (tmp / "retireopd.json").write_text(json.dumps(extra, indent=2))
            if trainer_state is not None:
                torch.save(trainer_state, tmp / "trainer.pt")
        except (OSError, RuntimeError, SafetensorError) as error:  # torch says "unexpected pos" on a full disk
            shutil.rmtree(tmp, ignore_errors=True)  # what was saved before stays as it was
            raise SystemExit(self.write_failure(name, error)) from None
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        return final

    def checkpoint(self, model, tokenizer, state: dict) -> None:
        """A resumable checkpoint after a completed iteration; keeps the last cfg.keep_checkpoints."""
        name = f"checkpoints/{PHASES.index(state['phase'])}-{state['phase']}-{state['iteration']:05d}"
        (self.dir / "checkpoints").mkdir(exist_ok=True)
        self.save_model(model, tokenizer, name, trainer_state={**state, "run_id": self.run_id}, dtype=None)
        for old in self.checkpoints()[: -self.cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)

    def checkpoints(self) -> list:
        """The resumable checkpoints, oldest first (not one being written, nor one set aside)."""
        folder = self.dir / "checkpoints"
        return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.endswith((".tmp", ".corrupt"))) \
            if folder.is_dir() else []

    def resumable_checkpoint(self) -> tuple[Optional[Path], Optional[dict]]:
        """(the newest whole checkpoint, its trainer state), or (None, None). One that is damaged (a
        file cut short by a crash or a full disk) or another run's is set aside as NAME.corrupt, with a
        note, and the one before it is tried."""
        for folder in reversed(self.checkpoints()):
            problem, state = saved_model_problem(folder), None
            if problem is None:
                try:
                    state = torch.load(folder / "trainer.pt", weights_only=False, map_location="cpu")
                except Exception as error:  # cut short, missing, not a torch file: not resumable either way
                    problem = "trainer.pt does not load: " + (str(error).strip().splitlines() or ["?"])[0]
            if problem is None and state.get("run_id", self.run_id) != self.run_id:
                problem = f"it belongs to run {state['run_id']}, this folder holds run {self.run_id}"
            if problem is None:
                return folder, state
            aside = folder.with_name(folder.name + ".corrupt")
            shutil.rmtree(aside, ignore_errors=True)
            folder.rename(aside)
            print(f"[retireopd] note: checkpoint {folder.name} is not usable ({problem}): set aside as "
                  f"{aside.name}; trying the one before it")
        return None, None

    def finished_phases(self) -> tuple:
        """The phases whose final model this folder holds (teacher/, student/): a resume skips them."""
        return tuple(phase for phase in PHASES if (self.dir / phase / "retireopd.json").is_file())

    def truncate_logs(self, phase: str, iteration: int, finished: tuple = ()) -> None:
        """On resume: drop the log lines of what the resumed run redoes, so that none appears twice:
        every iteration after the checkpoint (phase, iteration), and the start and end (memory
        estimate, report, teacher_ready) of every phase not in `finished`, the phases whose final
        model is saved (they are not redone). A last line cut short by a crash is dropped, with a note."""
        point = (PHASES.index(phase), iteration)
        for saved in finished:  # a saved phase is complete, whichever checkpoint is used
            point = max(point, (PHASES.index(saved), phase_iterations(self.cfg, saved) - 1))

        def keep(record):
            if record.get("panel") == "report":  # written after the phase's last checkpoint
                return record["phase"] in finished
            done = (PHASES.index(record.get("phase", "teacher")), record.get("iteration", -1))
            return done <= point

        def keep_event(event):
            if event["event"] == "retirement":
                return keep({"phase": "student", "iteration": event["decided_after_iteration"]})
            if event["event"] == "teacher_ready":
                return "teacher" in finished
            if event["event"] == "memory_estimate":  # "phase 1" / "phase 2": logged again when it restarts
                return PHASES[int(event["phase"][-1]) - 1] in finished
            return True
        for name in ("metrics.jsonl", "eval.jsonl"):
            records = [r for r in read_jsonl(self.dir / name, note=True) if keep(r)]
            write_text_atomically(self.dir / name, "".join(json.dumps(r) + "\n" for r in records))
        events = [e for e in read_jsonl(self.dir / "events.jsonl", note=True) if keep_event(e)]
        write_text_atomically(self.dir / "events.jsonl", "".join(json.dumps(e) + "\n" for e in events))


def save_pretrained_as(model, folder: Path, dtype: torch.dtype) -> None:
    """model.save_pretrained with the weights cast to dtype (copies on the CPU, a tied weight
    once), and config.json saying so under both names readers use: `dtype` (transformers >= 4.56)
    and `torch_dtype` (older transformers, and the vLLM builds pinned to them)."""
    copies, seen = {}, set()
    for key, tensor in model.state_dict().items():
        if (tensor.data_ptr(), tensor.shape) in seen:  # tied (lm_head = embedding): saved once
            continue
        seen.add((tensor.data_ptr(), tensor.shape))
        copies[key] = tensor.detach().to("cpu", dtype)
    model.save_pretrained(folder, state_dict=copies)
    config_file = Path(folder) / "config.json"
    config = json.loads(config_file.read_text())
    config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def peak_memory_gb(device: torch.device) -> float:
    """CUDA max allocated on GPU, the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def evaluate(model, tokenizer, suite: TaskSuite, tasks: list, cfg: Config, skills: bool, desc: str) -> dict:
    """Success on a fixed panel (`tasks`) at the evaluation temperature, per task type and overall.

    The panels never change between runs (sorted games / the fixed validation goals); episodes
    are played in lock-step batches of B*G with a fixed sampling seed (recorded), drawn from a
    forked RNG so that evaluating does not change the training run's random stream.
    """
    device = next(model.parameters()).device
    chunk = cfg.batch_tasks * cfg.group_size
    records = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(cfg.seed + 12345)
        for start in range(0, len(tasks), chunk):
            batch = tasks[start:start + chunk]
            _, episodes, _ = rollout(model, tokenizer, suite, batch, cfg, group_size=1,
                                     policy_skills=skills, teacher_skills=False,
                                     temperature=cfg.eval_temperature, desc=desc)
            records += [(e.task_type or suite.task_type(task), e.won) for e, task in zip(episodes, batch)]
    return {**success_by_task_type(records), "skills": skills, "seed": cfg.seed + 12345,
            "temperature": cfg.eval_temperature}


def rng_state(device: torch.device) -> dict:
    """The torch RNG streams a resumed run must continue: CPU, and the training GPU's only (a
    run may resume where a different set of GPUs is visible)."""
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and isinstance(state.get("cuda"), torch.Tensor):
        torch.cuda.set_rng_state(state["cuda"], device)


def phase_protocol(cfg: Config, with_teacher: bool) -> tuple[int, float]:
    """(turn-samples per optimizer step, KL-to-reference coefficient) of a phase, as the authors run
    them: phase 1 and --algo grpo 256 / 64 with KL 0.01; phase 2 with a teacher 128, no KL."""
    return (cfg.opd_mini_batch, cfg.opd_kl_coef) if with_teacher else (cfg.mini_batch, cfg.kl_coef)


def phase_iterations(cfg: Config, phase: str) -> int:
    return (cfg.teacher_iterations or cfg.iterations) if phase == "teacher" else cfg.iterations


def validation_due(cfg: Config, iteration: int, iterations: int) -> bool:
    """Every eval_every iterations (1-based: 5, 10, ...), and at the phase's last iteration."""
    return (iteration + 1) % cfg.eval_every == 0 or iteration + 1 == iterations


def retirement_message(iteration: int, retirement: Retirement, record: dict) -> str:
    if retirement.mode == "fixed":
        return f"[retireopd] teacher retired on schedule: GRPO alone from iteration {retirement.retired_at}"
    return (f"[retireopd] teacher retired after iteration {iteration}: the gap K stopped shrinking "
            f"(block mean {record['judged_block']:.4g}, progress {record['progress']:+.3f} <= "
            f"{retirement.threshold}) and the student is competent (its last two validations, "
            f"{record['val_success']:.2f} now, average {record['competence']:.2f} x S_T >= {retirement.rho}); "
            f"GRPO alone from iteration {retirement.retired_at}")


def train_phase(phase: str, policy, tokenizer, suite: TaskSuite, cfg: Config, run: Run, *,
                policy_skills: bool, frozen: dict, grpo_loss: bool = True,
                retirement: Optional[Retirement] = None, resume: Optional[dict] = None) -> list:
    """One phase of training. Returns the validation success rates of its validations.

    phase "teacher": Skill-GRPO (policy_skills=True, no teacher).
    phase "student": GRPO (no teacher), GRPO + OPD (frozen["teacher"] set), pure OPD
    (grpo_loss=False), with the retirement rule fed at every iteration and validation when
    `retirement` is given. frozen: {"teacher": model or None, "reference": model or None}. The
    teacher is popped from this dict at retirement, so that (with the caller holding no other
    reference) it is freed. resume: a checkpoint's trainer state; training continues after its
    iteration.
    """
    device = next(policy.parameters()).device
    optimizer = build_adamw(policy, cfg)
    rng = random.Random(cfg.seed * 1000 + PHASES.index(phase))  # task sampling and mini-batches
    # a distilling phase keeps its protocol after retirement, and when a resume finds the teacher retired
    mini_batch, kl_coef = phase_protocol(cfg, with_teacher=retirement is not None or frozen.get("teacher") is not None)
    val_successes, first = [], 0
    torch.manual_seed(cfg.seed * 1000 + PHASES.index(phase))  # sampling: a fixed stream per phase
    if resume is not None:
        optimizer.load_state_dict(resume.pop("optimizer"))  # pop: no second copy of the moments
        rng.setstate(resume["python_rng"])
        set_rng_state(resume["rng"], device)
        val_successes, first = list(resume["val_successes"]), resume["iteration"] + 1
    iterations = phase_iterations(cfg, phase)
    bar = tqdm(range(first, iterations), desc=f"{phase} ({cfg.algo})", dynamic_ncols=True,
               initial=first, total=iterations)
    for iteration in bar:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t_start = time.perf_counter()
        tasks = [rng.choice(suite.train) for _ in range(cfg.batch_tasks)]
        teacher = frozen.get("teacher")
        teacher_active = teacher is not None and not (retirement and retirement.retired)
        samples, _, roll = rollout(policy, tokenizer, suite, tasks, cfg, group_size=cfg.group_size,
                                   policy_skills=policy_skills, teacher_skills=teacher_active,
                                   desc=f"{phase} {iteration} rollout", temperature=cfg.temperature)
        record: dict = {"phase": phase, "iteration": iteration, **roll}
        if not samples:
            raise RuntimeError("no turn-samples were produced: every episode failed at reset")
        # --- GRPO advantages: one per turn-sample, repeated over its tokens ---------------------
        advantages = None
        if grpo_loss:
            group_adv = grpo_advantages(torch.tensor([s.score for s in samples]),
                                        torch.tensor([s.group for s in samples]))
            advantages = [torch.full((len(s.response_ids),), float(a)) for s, a in zip(samples, group_adv)]
        # --- log-probs: old policy (rollout model), teacher on s_t^T, reference ---------------
        t0 = time.perf_counter()
        old_logp = score_samples(policy, samples, cfg)
        record["t_old_logp"] = time.perf_counter() - t0
        record.update(sample_logp_gap(samples, old_logp))
        teacher_logp = None
        if teacher_active:
            t0 = time.perf_counter()
            teacher_logp = score_samples(teacher, samples, cfg, use_teacher_prompt=True)
            record["t_teacher"] = time.perf_counter() - t0
            flat_old = torch.cat(old_logp)
            record["gap"], record["gap_k3"] = teacher_student_gap(flat_old, torch.cat(teacher_logp),
                                                                  torch.ones_like(flat_old))
            if retirement is not None:
                record.update(retirement.observe_gap(iteration, record["gap"]))
        ref_logp, reference = None, frozen.get("reference")
        if reference is not None and kl_coef > 0:
            t0 = time.perf_counter()
            ref_logp = score_samples(reference, samples, cfg)
            record["t_reference"] = time.perf_counter() - t0
        # --- the update: L_PPO (+ KL - entropy) + lambda L_OPD -----------------------------------
        record["opd_coef"] = cfg.opd_coef if teacher_active else 0.0
        t0 = time.perf_counter()
        update = ppo_update(policy, optimizer, samples, old_logp, advantages, cfg, mini_batch=mini_batch,
                            kl_coef=kl_coef, ref_logp=ref_logp, teacher_logp=teacher_logp,
                            opd_coef=record["opd_coef"], rng=rng)
        record["t_update"] = time.perf_counter() - t0
        record.update(update)
        record["train_tokens_per_s"] = update["trained_tokens"] / max(record["t_update"], 1e-9)
        # --- validation on the fixed panel; it feeds S_T (phase 1) and the retirement rule -------
        if validation_due(cfg, iteration, iterations):
            result = evaluate(policy, tokenizer, suite, suite.validation_panel, cfg, skills=policy_skills,
                              desc=f"{phase} validation")
            run.log("eval.jsonl", {"phase": phase, "iteration": iteration, "panel": "validation", **result})
            val_successes.append(result["overall"])
            record["val_success"] = result["overall"]
            if retirement is not None and teacher_active:
                record.update(retirement.observe_validation(iteration, result["overall"]))
        if retirement is not None and teacher_active:
            retirement.observe_schedule(iteration)
        retired_now = retirement is not None and teacher_active and retirement.retired
        if retired_now:  # from the next iteration on: no OPD term, no teacher forward
            run.log("events.jsonl", {"event": "retirement", "rule": retirement.mode, "retired_at": retirement.retired_at,
                                     "decided_after_iteration": iteration,
                                     **{k: record.get(k) for k in ("judged_block", "progress", "competence",
                                                                   "val_success", "criterion_valid")}})
            tqdm.write(retirement_message(iteration, retirement, record))
            frozen.pop("teacher")  # the teacher leaves memory for good
            del teacher
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        record["teacher_active"] = teacher_active
        record["retired"] = bool(retirement is not None and retirement.retired)
        if retirement is not None:
            record["teacher_success"] = retirement.teacher_success
        record["t_iteration"] = time.perf_counter() - t_start
        record["peak_mem_gb"] = peak_memory_gb(device)
        run.log("metrics.jsonl", record)
        last = iteration + 1 == iterations
        if last or retired_now or (cfg.save_every and (iteration + 1) % cfg.save_every == 0):
            run.checkpoint(policy, tokenizer, {
                "phase": phase, "iteration": iteration, "optimizer": optimizer.state_dict(),
                "python_rng": rng.getstate(), "rng": rng_state(device), "val_successes": val_successes,
                "retirement": dataclasses.asdict(retirement) if retirement else None})
        postfix = {"success": f"{roll['success']:.2f}"}
        if "gap" in record:
            postfix["K"] = f"{record['gap']:.4f}"
        if val_successes:
            postfix["val"] = f"{val_successes[-1]:.2f}"
        if retirement is not None:
            postfix["retired"] = retirement.retired
        bar.set_postfix(postfix)
    return val_successes


def plot_runs(run_dirs: list, out: Optional[Path] = None) -> Optional[Path]:
    """One PNG for one or more runs. Top: success (thin lines: training episodes; dots: the
    validation panel), the competence bar rho * S_T, the retirement. Bottom: the gap K per
    phase-2 iteration, its block means (what the rule compares) and the k3 diagnostic.

    matplotlib is optional: without it we say how to get the plot and return None.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[retireopd] no plot: `pip install matplotlib`, then `python retireopd.py --plot RUN_DIR`")
        return None
    missing = [str(d) for d in run_dirs if not (Path(d) / "metrics.jsonl").is_file()]
    if missing:
        raise SystemExit(f"retireopd: no metrics.jsonl in {', '.join(missing)}: not a run folder")
    fig, (ax_success, ax_gap) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    configs = [json.loads((Path(d) / "config.json").read_text()) for d in run_dirs]
    envs = sorted({c["env"] for c in configs})
    fig.suptitle(f"{configs[0]['algo']} on {configs[0]['env']} with {configs[0]['model']}" if len(run_dirs) == 1
                 else f"{len(run_dirs)} runs on {' and '.join(envs)}", fontsize=10)
    all_metrics = [read_jsonl(Path(d) / "metrics.jsonl") for d in run_dirs]
    # phase 2 is drawn after phase 1 on one iteration axis: every run's phase 2 starts at the same
    # place (a --algo grpo run, which has no phase 1, beside a RetireOPD student)
    offset = max(sum(m["phase"] == "teacher" for m in metrics) for metrics in all_metrics)
    for n, (run_dir, metrics) in enumerate(zip(map(Path, run_dirs), all_metrics)):
        color = f"C{n}"
        label = run_dir.name if len(run_dirs) > 1 else "student"
        teacher = [m for m in metrics if m["phase"] == "teacher"]
        student = [m for m in metrics if m["phase"] == "student"]
        if teacher:
            ax_success.plot(range(offset), [m["success"] for m in teacher], color="gray", alpha=0.35, linewidth=1)
            val = [m for m in teacher if "val_success" in m]
            ax_success.plot([m["iteration"] for m in val], [m["val_success"] for m in val], "o-", color="gray",
                            markersize=4, label="teacher, with skills (phase 1)" if n == 0 else None)
            for ax in (ax_success, ax_gap):
                ax.axvline(offset - 0.5, color="black", linewidth=0.8, alpha=0.3)
        ax_success.plot([offset + m["iteration"] for m in student], [m["success"] for m in student],
                        color=color, alpha=0.35, linewidth=1)
        val = [m for m in student if "val_success" in m]
        ax_success.plot([offset + m["iteration"] for m in val], [m["val_success"] for m in val], "o-",
                        color=color, markersize=4, label=f"{label}, no skills (phase 2)")
        bar = [m["teacher_success"] for m in student if m.get("teacher_success")]
        if bar:
            ax_success.axhline(configs[n]["rho"] * bar[0], color=color, linestyle=":", linewidth=1,
                               label="competence bar rho * S_T" if n == 0 else None)
        with_gap = [m for m in student if "gap" in m]  # none without a teacher in phase 2
        ax_gap.plot([offset + m["iteration"] for m in with_gap], [m["gap"] for m in with_gap], color=color,
                    alpha=0.4, linewidth=1, label=None if not with_gap else f"{label}: K" if len(run_dirs) > 1
                    else "K per iteration")
        ax_gap.plot([offset + m["iteration"] for m in with_gap], [m["gap_k3"] for m in with_gap], color=color,
                    linestyle="--", alpha=0.4, linewidth=1, label=None if len(run_dirs) > 1 else "k3 diagnostic")
        window = configs[n]["window"]
        blocks = [m for m in with_gap if "gap_block" in m]
        for k, m in enumerate(blocks):
            ax_gap.hlines(m["gap_block"], offset + m["iteration"] - window + 0.5, offset + m["iteration"] + 0.5,
                          color=color, linewidth=2.5,
                          label=(f"{label}: block means" if len(run_dirs) > 1 else f"block means of K (W = {window})")
                          if k == 0 else None)
        for event in read_jsonl(run_dir / "events.jsonl"):
            if event.get("event") == "retirement":
                for ax in (ax_success, ax_gap):
                    ax.axvline(offset + event["retired_at"] - 0.5, color=color, linestyle="--")
                ax_gap.annotate("teacher retired", (offset + event["retired_at"] - 0.5, 0), color=color,
                                xycoords=("data", "axes fraction"), xytext=(3, 5), textcoords="offset points")
    ax_success.set_ylim(-0.03, 1.03)
    ax_success.set_ylabel("success (thin: training,\ndots: validation panel)")
    ax_success.legend(fontsize=8)
    ax_gap.set_ylabel("teacher-student gap\n(phase 2, while the teacher scores)")
    ax_gap.set_xlabel("iteration (phase 1, then phase 2)")
    ax_gap.xaxis.get_major_locator().set_params(integer=True)
    ax_gap.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out or Path(run_dirs[0]) / ("compare.png" if len(run_dirs) > 1 else "plot.png"))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ==================================================================================================
# 9. main: arguments, the algorithms (--algo), outputs
# ==================================================================================================


def config_field_help() -> dict:
    """--help text for each Config field: the comment written beside it in the class body."""
    import inspect
    helps, name = {}, None
    for line in inspect.getsource(Config).splitlines():
        field_line = re.match(r"\s+(\w+): [^=]+=.*?#\s*(.*)$", line)
        continuation = re.match(r"\s+#   (.*)$", line)  # a comment continued on the next line
        if field_line:
            name = field_line.group(1)
            helps[name] = field_line.group(2)
        elif continuation and name:
            helps[name] += " " + continuation.group(1)
        else:
            name = None
    return {key: text.replace("%", "%%") for key, text in helps.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + "\n\nWith --model tiny, a flag "
                                     "marked [default: X; tiny: Y] defaults to Y (TINY_PRESET).",
                                     epilog="\n\n".join(__doc__.split("\n\n")[3:5]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run from its last checkpoint")
    parser.add_argument("--plot", metavar="RUN_DIR", help="only draw RUN_DIR/plot.png and exit")
    parser.add_argument("--compare", metavar="RUN_DIR", nargs="+", help="only draw several runs on one figure")
    parser.add_argument("--benchmark", action="store_true",
                        help="time our rollout/update/log-probs against plain Hugging Face calls and exit")
    helps = config_field_help()
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        tiny = f"; tiny: {TINY_PRESET[f.name]}" if f.name in TINY_PRESET else ""  # what --model tiny uses instead
        text = f"{helps.get(f.name, '')} [default: {f.default}{tiny}]"
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=text)
        else:
            kind = {"int": int, "float": float}.get(str(f.type).replace("Optional[", "").rstrip("]"), str)
            parser.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=text)
    return parser


def parse_config(given: dict) -> Config:
    """Flags given on the command line -> the resolved Config.

    Values the user did not give come from the `tiny` preset (for --model tiny) or the Config
    defaults, then the per-benchmark defaults (max turns, prompt budget, mini-batch) fill in.
    """
    values = dict(TINY_PRESET) if given.get("model", Config.model) == "tiny" else {}
    if values and given.get("env", values["env"]) != "kitchen":
        values.update(TINY_PRESET_ELSEWHERE)
    if "iterations" in given and "teacher_iterations" not in given:
        values.pop("teacher_iterations", None)  # --iterations N alone sets both phases
    values.update(given)
    cfg = Config(**values)
    if "retire_at" in values and values["retire_at"] == "half":  # see TINY_PRESET_ELSEWHERE
        cfg.retire_at = max(1, cfg.iterations // 2) if cfg.algo == "retireopd" and cfg.teacher_success is None else None
    alfworld = cfg.env == "alfworld"
    cfg.max_turns = cfg.max_turns or (50 if alfworld else 15)
    cfg.max_prompt_tokens = cfg.max_prompt_tokens or (2048 if alfworld else 4096)
    cfg.mini_batch = cfg.mini_batch or (256 if alfworld else 64)
    if cfg.run_dir is None:
        cfg.run_dir = str(Path("runs") / f"{cfg.env}-{cfg.algo}-{time.strftime('%Y%m%d-%H%M%S')}")
    validate_config(cfg)
    return cfg


def resume_config(run_dir: str, given: dict) -> Config:
    """The Config of the run being resumed; flags that contradict it are an error."""
    saved_file = Path(run_dir) / "config.json"
    if not saved_file.is_file():
        raise SystemExit(f"retireopd: --resume {run_dir}: no config.json there (not a run folder)")
    try:
        saved = json.loads(saved_file.read_text())
    except ValueError:
        raise SystemExit(f"retireopd: --resume {run_dir}: its config.json is damaged (not JSON)") from None
    # how the run is executed, not what it computes (--prefill-batch changes only rounding: lower it
    # to resume a run that ran out of memory in a rollout; the checkpoints' cadence, after a full
    # disk); and S_T, for a run that stopped at S_T = 0
    free = ("run_dir", "env_workers", "prefill_batch", "teacher_success", "save_every", "keep_checkpoints")
    clashes = [f"--{k.replace('_', '-')} {v} (the run has {saved.get(k)})"
               for k, v in given.items() if saved.get(k) != v and k not in free]
    if clashes:
        raise SystemExit("retireopd: --resume continues a run with its own config; drop "
                         + ", ".join(clashes) + " or start a new run")
    cfg = Config(**{**saved, **{k: given[k] for k in free if k in given}, "run_dir": run_dir})
    validate_config(cfg)
    return cfg


def teacher_folder_problem(folder: Path, env: str) -> Optional[str]:
    """Why a saved phase-1 teacher cannot teach a run on `env`, or None: it must have been written by
    phase 1 of this script (retireopd.json: S_T and the environment) on the same environment."""
    try:
        stored_env = json.loads((folder / "retireopd.json").read_text()).get("env")
    except (OSError, ValueError):
        return (f"{folder}: no retireopd.json (the stored teacher success rate) in that folder; pass a folder "
                "written by phase 1 of this script")
    return None if stored_env == env else f"{folder} was trained on {stored_env}, this run is --env {env}"


def check_run_folder(run_dir: str, resuming: bool) -> None:
    """Refuse, in one line and before anything is written, a run folder that cannot be used: one that
    holds another run (unless resuming it), a file, or a place where nothing can be written (a
    read-only disk, /proc). The write test leaves no trace."""
    folder = Path(run_dir)
    if not resuming and holds_a_run(folder):
        raise SystemExit(f"retireopd: {run_dir} holds a run: `--resume {run_dir}` continues it, or choose another "
                         "`--run-dir`")
    blocking = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise SystemExit(f"retireopd: --run-dir {run_dir}: {blocking} is a file, not a folder")
    missing = [p for p in (folder, *folder.parents) if not p.exists()]  # deepest first
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".retireopd-write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as error:
        raise SystemExit(f"retireopd: --run-dir {run_dir}: cannot create or write a folder there "
                         f"({error.strerror or error}): choose one on a writable disk") from None
    finally:
        for created in missing:
            with contextlib.suppress(OSError):
                created.rmdir()


def validate_config(cfg: Config) -> None:
    """Bad flags fail here, in one line each, before any model is loaded."""
    problems = []
    if cfg.algo not in ALGOS:
        problems.append(f"--algo {cfg.algo!r}: choose one of {', '.join(ALGOS)}")
    if cfg.env not in ENVS:
        problems.append(f"--env {cfg.env!r}: choose alfworld, webshop or kitchen")
    if cfg.group_size < 2:
        problems.append("--group-size must be >= 2: GRPO normalises within a group")
    if not 0 < cfg.rho <= 1:
        problems.append("--rho must be in (0, 1]")
    if cfg.window < 1:
        problems.append("--window must be >= 1")
    if cfg.teacher_iterations is not None and cfg.teacher_iterations < 1:
        problems.append("--teacher-iterations must be >= 1")
    for name in ("iterations", "batch_tasks", "max_turns", "max_response_tokens", "mini_batch", "opd_mini_batch",
                 "token_budget", "ppo_epochs", "logprob_chunk"):
        if getattr(cfg, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1")
    if cfg.eval_episodes is not None and cfg.eval_episodes < 1:
        problems.append("--eval-episodes must be >= 1 (leave it out for the whole panel)")
    if cfg.history < 0:
        problems.append("--history must be >= 0 (0: no past observations in the prompt)")
    if cfg.keep_checkpoints < 1:
        problems.append("--keep-checkpoints must be >= 1: --resume needs a checkpoint (--save-every 0 writes "
                        "them only at phase ends and retirement)")
    if cfg.save_every < 0:
        problems.append("--save-every must be >= 0 (0: checkpoints only at phase ends and retirement)")
    for name in ("clip_eps", "grad_clip", "success_reward"):
        if getattr(cfg, name) <= 0:
            problems.append(f"--{name.replace('_', '-')} must be > 0")
    if cfg.eval_temperature < 0:
        problems.append("--eval-temperature must be >= 0 (0: greedy)")
    if cfg.prefill_batch < 0:
        problems.append("--prefill-batch must be >= 0 (0: prefill every prompt in one forward)")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.device):
        problems.append(f"--device {cfg.device}: auto, cpu, cuda or cuda:N")
    elif cfg.device.startswith("cuda") and not torch.cuda.is_available():
        problems.append(f"--device {cfg.device}: this torch sees no CUDA GPU (use --device cpu or auto)")
    if cfg.temperature != 1.0:
        problems.append("--temperature must be 1: the log-probs we train on are those of the full "
                        "distribution at temperature 1 (use --eval-temperature for evaluation)")
    if cfg.retire_at is not None and cfg.retire_at > cfg.iterations:
        problems.append(f"--retire-at {cfg.retire_at} is after the last iteration ({cfg.iterations})")
    for name in ("kl_coef", "opd_kl_coef", "entropy_coef", "opd_coef", "malformed_penalty", "lr", "weight_decay"):
        if getattr(cfg, name) < 0:
            problems.append(f"--{name.replace('_', '-')} must be >= 0")
    if cfg.algo == "opd" and cfg.opd_coef == 0:
        problems.append("--algo opd trains on lambda * L_OPD alone: --opd-coef must be > 0")
    if cfg.dual_clip <= 1:
        problems.append("--dual-clip must be > 1 (it caps the loss of a negative advantage at -c*A)")
    if cfg.window >= 1 and not 1 <= cfg.eval_every <= cfg.window:  # (a bad --window is reported alone)
        problems.append(f"--eval-every {cfg.eval_every}: must be between 1 and --window ({cfg.window}), so "
                        "that every block of W iterations is judged at a validation")
    if cfg.teacher_success is not None and not 0 < cfg.teacher_success <= 1:
        problems.append("--teacher-success must be in (0, 1]")
    if cfg.retire_at is not None and (cfg.algo != "retireopd" or cfg.retire_at < 1):
        problems.append("--retire-at N needs --algo retireopd and N >= 1")
    if cfg.teacher is not None and (problem := teacher_folder_problem(Path(cfg.teacher), cfg.env)):
        problems.append(f"--teacher {problem}")
    if cfg.webshop_reward not in ("faithful", "fixed"):
        problems.append("--webshop-reward: faithful or fixed")
    if cfg.env_workers < 0:
        problems.append("--env-workers must be >= 0 (0: step ALFWorld in this process)")
    elif cfg.env_workers and cfg.env != "alfworld":
        print(f"[retireopd] note: --env-workers is for ALFWorld; {cfg.env} steps in this process")
    if cfg.frozen_dtype not in ("float32", "bfloat16"):
        problems.append("--frozen-dtype: float32 or bfloat16")
    known = cfg.model in MODEL_ALIASES or cfg.model == "tiny" or cfg.model.startswith("random:")
    if not known and "/" not in cfg.model and not Path(cfg.model).is_dir():
        problems.append(f"--model {cfg.model}: not a local folder, a hub id (org/name) or an alias "
                        f"({', '.join([*MODEL_ALIASES, 'tiny'])}, random:<alias>)")
    if cfg.model.startswith("random:") and cfg.model.split(":", 1)[1] not in QWEN25_SHAPES:
        problems.append(f"--model {cfg.model}: random: takes one of {', '.join(QWEN25_SHAPES)}")
    if problems:
        raise SystemExit("retireopd: " + "\n".join(problems))


SMALL_MODEL_PARAMS = 20_000_000


def one_thread_if_small(model, device: torch.device) -> None:
    """On a CPU, a model below SMALL_MODEL_PARAMS runs on one torch thread: its matrices are too
    small to gain from threads, and on a busy 2-core machine two threads were measured 4-20x
    slower for the tiny model (spinning threads of competing processes). Bigger models keep
    torch's default (set OMP_NUM_THREADS to choose)."""
    if device.type == "cpu" and sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMS:
        torch.set_num_threads(1)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# ----- the built-in benchmark (--benchmark): our code paths against the plain Hugging Face ones -----


def process_memory_gb(field_name: str = "VmRSS") -> float:
    """Linux /proc/self/status: VmRSS (resident now) or VmHWM (peak resident), in GiB."""
    for line in open("/proc/self/status"):
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) / 2**20
    return 0.0


def current_memory_gb(device: torch.device) -> float:
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else process_memory_gb("VmRSS")


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:  # Linux: writing 5 to clear_refs resets the process's peak RSS (VmHWM) to its RSS
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def measured_peak_gb(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else process_memory_gb("VmHWM")


MEASURABLE_PEAK_GB = 0.01  # the benchmark's memory floor: below it a peak is noise, not a measurement


def benchmark(cfg: Config, repeats: int = 3) -> dict:
    """Time our rollout generation, update and log-probs against the plain Hugging Face calls on
    the same inputs (interleaved repetitions, medians), with peak memory for the log-probs.

    Ratios > 1 mean ours is faster (time) / leaner (memory is ours / plain: < 1 is leaner).
    """
    import statistics
    device = pick_device(cfg.device)
    model, tokenizer = load_policy(cfg.model, device, torch.float32, cfg.seed)
    if cfg.gradient_checkpointing and device.type == "cuda":
        model.activation_checkpointing_enable()
    rng = random.Random(cfg.seed)
    words = ["go to cabinet", "open drawer", "take mug", "click[b0fsh00001]", "search[red shoes]"]
    prompts = [encode_prompt(tokenizer, build_user_message(
        "alfworld", "put a clean mug in the coffeemachine", 0, [], "You arrive at countertop 1. " * rng.randint(2, 20),
        [f"{rng.choice(words)} {k}" for k in range(rng.randint(5, 40))]))
        for _ in range(cfg.batch_tasks * cfg.group_size)]
    n_new = cfg.max_response_tokens
    samples = [TurnSample(0, i, p, [rng.randrange(len(tokenizer)) for _ in range(n_new)], False)
               for i, p in enumerate(prompts)]
    timings: dict = {name: [] for name in ("ours_generate", "plain_generate", "ours_update",
                                           "plain_update", "ours_logprob", "plain_logprob")}
    memory = {"ours_logprob": [], "plain_logprob": []}
    optimizer = build_adamw(model, dataclasses.replace(cfg, lr=0.0))  # lr 0: measure without moving

    def plain_generate():
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts], device=device)
        with autocast(device):
            out = model.generate(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long(),
                                 do_sample=True, max_new_tokens=n_new, top_k=0, top_p=1.0,
                                 pad_token_id=tokenizer.pad_token_id)
        return int((out[:, width:] != tokenizer.pad_token_id).sum())

    def plain_batch():
        width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        ids = torch.full((len(samples), width), tokenizer.pad_token_id, device=device)
        for b, s in enumerate(samples):
            ids[b, : len(s.prompt_ids) + n_new] = torch.tensor(s.prompt_ids + s.response_ids)
        return ids, (ids != tokenizer.pad_token_id).long()

    def plain_logprobs(ids, mask):  # the naive path: full (batch, seq, vocab) float32 log-softmax
        with autocast(device):
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        return torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)

    def plain_update():
        model.train()
        ids, mask = plain_batch()
        logp = plain_logprobs(ids, mask)
        (-(logp * mask[:, 1:]).sum() / mask.sum()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return int(mask.sum())

    def timed(name, fn):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        timings[name].append((time.perf_counter() - start, result))

    old = [torch.zeros(n_new) for _ in samples]
    advantages = [torch.ones(n_new) for _ in samples]
    for _ in range(repeats):
        model.eval()
        timed("ours_generate", lambda: sum(len(r.ids) for r in generate(model, tokenizer, prompts, n_new, 1.0,
                                                                         prefill_batch=cfg.prefill_batch)))
        timed("plain_generate", plain_generate)
        timed("ours_update", lambda: ppo_update(model, optimizer, samples, old, advantages, cfg,
                                                                  mini_batch=cfg.mini_batch)["trained_tokens"])
        timed("plain_update", plain_update)
        for name, fn in (("ours_logprob", lambda: score_samples(model, samples, cfg)),
                         ("plain_logprob", lambda: plain_logprobs(*plain_batch()))):
            gc.collect()
            base = current_memory_gb(device)
            reset_peak_memory(device)
            with torch.no_grad():
                timed(name, lambda: (fn(), len(samples) * n_new)[1])
            memory[name].append(measured_peak_gb(device) - base)
    median = {name: statistics.median(t for t, _ in runs) for name, runs in timings.items()}
    peak = {name: statistics.median(v) for name, v in memory.items()}
    tokens = {name: runs[-1][1] for name, runs in timings.items()}
    per_s = {name: tokens[name] / median[name] for name in median}
    report = {
        "model": cfg.model, "device": str(device), "sequences": len(prompts), "new_tokens": n_new,
        "tokens_per_s": {k: round(v, 1) for k, v in per_s.items()},
        "rollout_speed_ratio": round(per_s["ours_generate"] / per_s["plain_generate"], 3),
        "update_speed_ratio": round(per_s["ours_update"] / per_s["plain_update"], 3),
        "logprob_speed_ratio": round(median["plain_logprob"] / median["ours_logprob"], 3),
        "logprob_peak_gb": {k: round(v, 4) for k, v in peak.items()},
        # a ratio of two peaks near the measurement's noise (CPU resident-set changes) means
        # nothing, and can even be negative: none below the floor
        "logprob_memory_ratio": round(peak["ours_logprob"] / peak["plain_logprob"], 4)
        if min(peak.values()) >= MEASURABLE_PEAK_GB else None,
    }
    return report


def format_memory_estimate(memory: dict) -> str:
    """One line: the total, what stays resident, and each stage with its parts (the largest first)."""
    stages = {"rollout": ("kv_cache", "prefill", "sampling"),
              "forward_backward": ("activations", "logits"), "optimizer_step": ("optimizer_temporaries",)}
    order = sorted(stages, key=lambda stage: stage != memory["peak_stage"])
    described = [f"{stage}: " + " + ".join(f"{part} {memory[part]}" for part in stages[stage]) for stage in order]
    return (f"{memory['total']} GiB = policy_and_adam {memory['policy_and_adam']} + frozen_models "
            f"{memory['frozen_models']} + the largest stage ({'; '.join(described)}); "
            f"{memory['params_millions']}M parameters")


def print_memory_estimate(policy, cfg: Config, device: torch.device, run: Run, phase: str,
                          n_frozen: int, skill_tokens: int = 0) -> None:
    """Print (and log) the memory estimate before the phase allocates anything heavy."""
    memory = estimate_memory_gb(policy, cfg, n_frozen, skill_tokens, device)
    print(f"[retireopd] {phase} memory estimate: {format_memory_estimate(memory)}")
    if device.type == "cuda":
        available = torch.cuda.get_device_properties(device).total_memory / 2**30
        if memory["total"] > 0.95 * available:
            print(f"[retireopd] WARNING: the estimate exceeds this GPU's {available:.0f} GiB: lower "
                  "--token-budget, --max-prompt-tokens or --batch-tasks, or set --kl-coef 0")
    run.log("events.jsonl", {"event": "memory_estimate", "phase": phase, "gib": memory, "device": str(device)})


def warm_started_tiny_base(run: Run, device: torch.device, steps: int) -> str:
    """The offline demo's base model, RUN_DIR/tiny_base: the tiny model after `steps` warm-start
    steps, built once per run folder (a resume, or a folder that already has it, reuses it). Seed 0
    whatever --seed says: the same base for every seed, as a pretrained checkpoint would be."""
    folder = run.dir / "tiny_base"
    if not (folder / "retireopd.json").is_file():
        model, tok = load_policy("tiny", device, torch.float32, seed=0)
        one_thread_if_small(model, device)
        report = warm_start(model, tok, steps, seed=0)
        print(f"[retireopd] warm start: {steps} behaviour-cloning steps (the answer format, reading a recipe's "
              f"first step, other dishes' recipes; none of the demo's), loss {report['first_loss']:.2f} -> "
              f"{report['last_loss']:.3f}")
        run.save_model(model, tok, "tiny_base", {"warm_start": report})
    return str(folder)


def main(argv: Optional[list] = None) -> Optional[Path]:
    args = vars(build_parser().parse_args(argv))
    resume_dir, plot_dir, compare = args.pop("resume"), args.pop("plot"), args.pop("compare")
    if plot_dir or compare:
        out = plot_runs([plot_dir] if plot_dir else compare)
        print(f"[retireopd] wrote {out}" if out else "")
        return out
    run_benchmark = args.pop("benchmark")
    cfg = resume_config(resume_dir, args) if resume_dir else parse_config(args)
    if resume_dir and any(e.get("event") == "done" for e in read_jsonl(Path(resume_dir) / "events.jsonl")):
        print(f"[retireopd] {resume_dir} already finished: nothing to resume (its outputs are there)")
        return Path(resume_dir)
    if problem := model_source_problem(cfg.model):  # before the data and before anything is written
        raise SystemExit(f"retireopd: {problem}")
    check_run_folder(cfg.run_dir, resuming=bool(resume_dir))
    if run_benchmark:
        report = benchmark(cfg)
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.run_dir) / "benchmark.json").write_text(json.dumps(report, indent=2))
        speed = report["tokens_per_s"]
        print(f"benchmark of {report['model']} on {report['device']} (tokens/s, medians; "
              f"also in {Path(cfg.run_dir) / 'benchmark.json'})\n"
              f"  {'stage':<10}{'ours':>12}{'plain':>12}{'ours/plain':>12}")
        for stage, ratio in (("generate", "rollout_speed_ratio"), ("update", "update_speed_ratio"),
                             ("logprob", "logprob_speed_ratio")):
            print(f"  {stage:<10}{speed['ours_' + stage]:>12.0f}{speed['plain_' + stage]:>12.0f}"
                  f"{report[ratio]:>12.2f}")
        peak, ratio = report["logprob_peak_gb"], report["logprob_memory_ratio"]
        print(f"  log-prob peak memory (GiB): ours {peak['ours_logprob']}, plain {peak['plain_logprob']}, "
              + (f"ratio {ratio}" if ratio is not None else
                 f"no ratio: a peak below {MEASURABLE_PEAK_GB} GiB is too small to measure (use a model with "
                 "the real vocabulary, e.g. random:small-vocab151k)"))
        return Path(cfg.run_dir)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = pick_device(cfg.device)
    frozen_dtype = torch.bfloat16 if cfg.frozen_dtype == "bfloat16" else torch.float32
    try:  # data problems surface here, in one line, before any model is loaded
        suite = TaskSuite(cfg)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"retireopd: {error}") from None
    run = Run(cfg)
    # the newest whole checkpoint (the optimizer state moves to the GPU when it is loaded into AdamW);
    # none: interrupted before its first checkpoint, start over. What is redone leaves the logs first.
    checkpoint, state = run.resumable_checkpoint() if resume_dir else (None, None)
    if resume_dir:
        run.truncate_logs(state["phase"] if state else PHASES[0], state["iteration"] if state else -1,
                          finished=run.finished_phases())
        run.log("events.jsonl", {"event": "resume", "checkpoint": checkpoint.name if checkpoint else None})
        print(f"[retireopd] resuming {run.dir} from checkpoint {checkpoint.name}" if checkpoint else
              f"[retireopd] {run.dir} has no checkpoint yet (the first is written after "
              f"{cfg.save_every or cfg.iterations} iterations): starting it over")
    print(f"[retireopd] {cfg.algo} on {cfg.env} ({len(suite.train)} training tasks, validation panel of "
          f"{len(suite.validation_panel)}, report panel of {len(suite.report_panel)}) with {cfg.model} on "
          f"{device}; run folder {run.dir}")

    base_model = cfg.model  # what both phases start from (and the KL reference)
    if cfg.model == "tiny" and cfg.warm_start > 0:  # the demo's base: warm-started once, kept in the run
        base_model = warm_started_tiny_base(run, device, cfg.warm_start)

    def policy_from(phase: str):
        """The model to train: the base model, or the checkpoint's when resuming this phase."""
        resuming = state is not None and state["phase"] == phase
        model, tok = load_policy(str(checkpoint) if resuming else base_model, device, torch.float32, cfg.seed)
        one_thread_if_small(model, device)
        if cfg.gradient_checkpointing and device.type == "cuda":
            model.activation_checkpointing_enable()
        return model, tok, (state if resuming else None)

    def load_frozen(name: str):
        """A frozen copy for scoring only: the teacher, or the base model as the KL reference."""
        model, _ = load_policy(name, device, frozen_dtype, cfg.seed)
        return model.requires_grad_(False).eval()

    algorithm = ALGORITHMS[cfg.algo]

    # --- phase 1: Skill-GRPO teacher (or a saved one) ---------------------------------------------
    teacher_dir = Path(cfg.teacher) if cfg.teacher else run.dir / "teacher"
    if teacher_dir.is_dir() and (problem := teacher_folder_problem(teacher_dir, cfg.env)):  # a resume's own
        raise SystemExit(f"retireopd: {problem}")
    if algorithm.teacher_phase and not (teacher_dir / "retireopd.json").is_file():
        policy, tokenizer, resume = policy_from("teacher")
        _, kl_coef = phase_protocol(cfg, with_teacher=False)
        frozen = {"teacher": None, "reference": load_frozen(base_model) if kl_coef > 0 else None}
        print_memory_estimate(policy, cfg, device, run, "phase 1", n_frozen=int(kl_coef > 0),
                              skill_tokens=1024)
        validations = train_phase("teacher", policy, tokenizer, suite, cfg, run, policy_skills=True,
                                  frozen=frozen, resume=resume)
        teacher_success = sum(validations[-2:]) / len(validations[-2:])  # S_T: its last two validations
        for skills in (True, False) if cfg.algo == "skill-grpo" else (True,):  # skill-grpo: both ways
            result = evaluate(policy, tokenizer, suite, suite.report_panel, cfg, skills=skills,
                              desc=f"teacher report ({'skills' if skills else 'no skills'})")
            run.log("eval.jsonl", {"phase": "teacher", "iteration": phase_iterations(cfg, "teacher") - 1,
                                   "panel": "report", **result})
        run.log("events.jsonl", {"event": "teacher_ready", "teacher_success": teacher_success})  # (before the
        # save: a resume that finds teacher/ saved finds this line too, one that does not drops it)
        run.save_model(policy, tokenizer, "teacher", {"teacher_success": teacher_success, "env": cfg.env,
                                                     "validations": validations[-2:]})
        del policy, resume, frozen
        gc.collect()

    # --- S_T: the teacher's validation success with skills ----------------------------------------
    teacher_success = None
    if algorithm.student_phase and algorithm.opd_loss:
        stored = json.loads((teacher_dir / "retireopd.json").read_text())["teacher_success"]
        teacher_success = stored if cfg.teacher_success is None else cfg.teacher_success
        print(f"[retireopd] S_T = {teacher_success:.3f}: the teacher's validation success with skills"
              + (f" (--teacher-success; recorded {stored:.3f})" if cfg.teacher_success is not None else
                 " (mean of its last two validations)"))
        if teacher_success <= 0 and algorithm.retirement == "adaptive" and cfg.retire_at is None:
            raise SystemExit(f"retireopd: S_T = 0 (the teacher in {teacher_dir} never won a validation task), "
                             "so the competence test cannot be judged: set --teacher-success S, or retire on a "
                             "fixed schedule with --retire-at N")

    # --- phase 2: the skill-free student ------------------------------------------------------------
    if algorithm.student_phase and "student" not in run.finished_phases():  # (saved: a resume skips it)
        policy, tokenizer, resume = policy_from("student")
        retirement = None
        if algorithm.opd_loss:
            mode = "fixed" if cfg.retire_at is not None else (algorithm.retirement or "never")
            retirement = Retirement(teacher_success, mode, cfg.window, cfg.alignment_threshold, cfg.rho,
                                    cfg.retire_at)
            if resume is not None and resume["retirement"] is not None:
                retirement = Retirement(**resume["retirement"])
        state = None  # phase-1 optimizer moments, if any, are not kept through phase 2
        frozen = {"teacher": None, "reference": None}
        if retirement is not None and not retirement.retired:
            frozen["teacher"] = load_frozen(str(teacher_dir))  # frozen holds the only reference
        _, kl_coef = phase_protocol(cfg, with_teacher=algorithm.opd_loss)
        if kl_coef > 0:  # the reference is the base model; never loaded when its coefficient is 0
            frozen["reference"] = load_frozen(base_model)
        print_memory_estimate(policy, cfg, device, run, "phase 2",
                              n_frozen=sum(m is not None for m in frozen.values()))
        train_phase("student", policy, tokenizer, suite, cfg, run, policy_skills=False, frozen=frozen,
                    grpo_loss=algorithm.grpo_loss, retirement=retirement, resume=resume)
        result = evaluate(policy, tokenizer, suite, suite.report_panel, cfg, skills=False, desc="student report")
        run.log("eval.jsonl", {"phase": "student", "iteration": cfg.iterations - 1, "panel": "report", **result})
        run.save_model(policy, tokenizer, "student", {"algo": cfg.algo, "teacher_success": teacher_success,
                                                     "retired_at": retirement.retired_at if retirement else None})
    suite.close()  # worker processes, if any (they are daemons: a crash takes them down too)
    run.log("events.jsonl", {"event": "done", "wall_s": round(time.time() - run.started, 1)})
    plot = plot_runs([run.dir])
    print(f"[retireopd] done in {time.time() - run.started:.0f}s; outputs in {run.dir}"
          + (f"; plot {plot}" if plot else ""))
    return run.dir


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        resume = f"python retireopd.py --resume {shlex.quote(str(Run.latest))}"
        sys.exit(f"\n[retireopd] interrupted: continue with `{resume}` (from the last checkpoint)" if Run.latest
                 else "\n[retireopd] interrupted before the run folder was written: nothing to resume")
