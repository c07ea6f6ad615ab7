"""The run's settings: each bad flag fails here in one line, before any model is loaded and before
anything is written (validate_config, a table of rules; a resume's, saved_settings; the command line's
paths, path_flag_problem), and so do the data folders they name (resolve_data_folders) and the data itself
(open_task_suite). retireopd.py calls these at its edges; the method never does.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import os
import re
from pathlib import Path
from typing import Optional

import torch

import alfworld_env
import multigpu
from common import ENVS, MODEL_ALIASES, read_owned_text
from environments import TaskSuite
from model_sources import teacher_folder_problem
from repairs import restored_config
from run_folder import RUN_DEFINING_SETTINGS, give_back_run_folder, run_folder_problem


# ==================================================================================================
# Flags: each bad one fails here in one line, before any model is loaded
# ==================================================================================================


def resolve_data_folders(cfg) -> None:
    """What a run reads, as it resolves now, into cfg (so config.json records it and a resume reads the
    same): the data folders with $ALFWORLD_DATA / $WEBSHOP_DATA applied (WebShop: "builtin" for the
    built-in catalogue), and local --teacher / --model folders, as absolute paths."""
    if cfg.env == "alfworld" and cfg.alfworld_data != "fixtures":
        cfg.alfworld_data = str(alfworld_env.alfworld_data_root(cfg.alfworld_data).absolute())
    if cfg.env == "webshop":
        folder = cfg.webshop_data if cfg.webshop_data is not None else os.environ.get("WEBSHOP_DATA") or "builtin"
        cfg.webshop_data = folder if folder == "builtin" else str(Path(folder).expanduser().absolute())
    if cfg.teacher is not None:
        cfg.teacher = str(Path(cfg.teacher).expanduser().absolute())
    if cfg.model not in (*MODEL_ALIASES, "tiny") and ":" not in cfg.model and Path(cfg.model).expanduser().is_dir():
        cfg.model = str(Path(cfg.model).expanduser().absolute())


def open_task_suite(cfg, created: list = ()) -> TaskSuite:
    """TaskSuite(cfg), its data problems said in one line; a start that fails here gives the run folder
    back (the folders in `created`, and the lock), so nothing blocks the corrected command. A data folder
    that yields no task for training or for a panel is refused here too."""
    data = {"alfworld": cfg.alfworld_data, "webshop": cfg.webshop_data}.get(cfg.env)
    if cfg.env == "alfworld" and importlib.util.find_spec("alfworld") is None:
        give_back_run_folder(cfg.run_dir, list(created))
        raise SystemExit("retireopd: --env alfworld needs the alfworld package, its own install: pip install -r "
                         "requirements-alfworld.txt (it builds a planner: a C++ compiler and make; on Windows, in WSL)")
    try:
        suite = TaskSuite(cfg)
    except PermissionError as error:
        give_back_run_folder(cfg.run_dir, list(created))
        raise SystemExit(f"retireopd: permission denied: {error.filename or data} (this user may not read or write "
                         "it)") from None
    except (FileNotFoundError, ValueError) as error:
        give_back_run_folder(cfg.run_dir, list(created))
        where = "" if data is None or str(data) in str(error) else f" (the {cfg.env} data in {data})"
        raise SystemExit(f"retireopd: {error}{where}") from None
    except (OSError, KeyError, TypeError, AttributeError, IndexError, ArithmeticError,
            RecursionError) as error:  # a file of the wrong shape (nested deeper than any: RecursionError)
        give_back_run_folder(cfg.run_dir, list(created))
        raise SystemExit(f"retireopd: the {cfg.env} data in {data} is malformed ({type(error).__name__}: {error}): "
                         "a file lacks a field or has another shape than the benchmark's") from None
    empty = [name for name, pool in (("training", suite.train), ("validation", suite.validation_panel),
                                     ("report", suite.report_panel)) if not pool]
    if empty:
        suite.close()
        give_back_run_folder(cfg.run_dir, list(created))
        raise SystemExit(f"retireopd: the {cfg.env} data in {data} yields no {' and no '.join(empty)} task: a "
                         "catalogue or split without tasks (check the data folder)")
    return suite


def saved_settings(run_dir: str, given: dict, known: dict) -> dict:
    """The settings of the run being resumed, from RUN_DIR/config.json (`known`: the Config's fields and their
    types, as written), with the flags given on the command line that only change how it runs; a flag that
    contradicts the run, and a config.json that is missing, damaged (a value of another type, a setting that
    defines the run missing) or another version's, are one-line errors."""
    if problem := run_folder_problem(Path(run_dir)):  # before anything of it is read
        raise SystemExit(f"retireopd: {problem}")
    saved_file = Path(run_dir) / "config.json"
    try:
        saved = json.loads(read_owned_text(saved_file))
    except (FileNotFoundError, ValueError) as error:
        saved = restored_config(Path(run_dir), "missing" if isinstance(error, FileNotFoundError) else "damaged")
    if isinstance(saved, dict) and saved.get("temperature") == 1.0:  # an older version's flag, only ever 1: gone,
        del saved["temperature"]  # the rollout temperature is now a constant (retireopd.ROLLOUT_TEMPERATURE)
    if not isinstance(saved, dict) or set(saved) - set(known):
        unknown = sorted(set(saved) - set(known)) if isinstance(saved, dict) else []
        raise SystemExit(f"retireopd: --resume {run_dir}: its config.json " + (
            f"has settings this version of retireopd.py does not know ({', '.join(unknown)}): it was written by "
            "another version; resume it with that one" if unknown else "is not a settings object (damaged)"))
    if problem := settings_type_problem(saved, known):
        raise SystemExit(f"retireopd: --resume {run_dir}: its config.json is damaged ({problem}); restore it from a "
                         "checkpoint's copy (checkpoints/*/retireopd.json) or start a new run")
    # how the run is executed, not what it computes (--prefill-batch changes only rounding: lower it
    # to resume a run that ran out of memory in a rollout; the checkpoints' cadence, after a full
    # disk); and S_T, for a run that stopped at S_T = 0
    free = ("run_dir", "env_workers", "prefill_batch", "sampler", "eval_batch", "teacher_success", "save_every",
            "keep_checkpoints", "report_to")  # (and where it is watched: the dashboard)
    clashes = [f"--{k.replace('_', '-')} {v} (the run has {saved.get(k)})"
               for k, v in given.items() if saved.get(k) != v and k not in free]
    if clashes:
        raise SystemExit("retireopd: --resume continues a run with its own config; drop "
                         + ", ".join(clashes) + " or start a new run")
    return {**saved, **{k: given[k] for k in free if k in given}, "run_dir": run_dir}


def settings_type_problem(saved: dict, types: dict) -> Optional[str]:
    """Why saved settings cannot be a Config's, or None: a setting that defines the run is missing, or a value
    is not of its field's type (`types`: {field: its annotation, as written: "int", "Optional[float]" ...})."""
    if missing := [name for name in RUN_DEFINING_SETTINGS if name not in saved]:
        return f"it lacks {', '.join(missing)}"
    kinds = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}
    for name, value in saved.items():
        annotation = str(types[name])
        optional = annotation.startswith("Optional[")
        allowed = kinds.get(annotation.removeprefix("Optional[").rstrip("]"))
        if allowed is None or (value is None and optional):
            continue
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            return f"{name} is {value!r}, not {annotation.removeprefix('Optional[').rstrip(']')}"
    return None


PATH_FLAGS = ("resume", "plot", "compare", "run_dir", "model", "teacher", "alfworld_data", "webshop_data")


def path_flag_problem(args: dict) -> Optional[str]:
    """Why the command line's paths cannot be what was meant, or None: an empty path (`--resume "$RUN"` with
    RUN unset would otherwise start a new run, `--run-dir ""` run in the current folder), a file given to
    --resume, or --run-dir beside --resume naming another folder (a run resumes in its own)."""
    for name in PATH_FLAGS:
        values = args.get(name)
        if any(value == "" for value in (values if isinstance(values, list) else [values])):
            return (f"--{name.replace('_', '-')} \"\": an empty path (an unset shell variable?): give the folder, or "
                    "leave the flag out")
    resume = args.get("resume")
    if resume is not None and os.path.lexists(resume) and not os.path.isdir(resume):
        return f"--resume {resume} is a file: give the run's folder (the one that holds its config.json)"
    if resume is not None and args.get("run_dir") is not None and \
            os.path.abspath(args["run_dir"]) != os.path.abspath(resume):
        return (f"--resume {resume} continues the run in its own folder: drop --run-dir {args['run_dir']} (a run is "
                "never moved to another)")
    return None


MIN_TEMPERATURE = 1e-3  # below it fp32 logits / T overflow for logits of a few hundred: the sampler fails
MAX_ENV_WORKERS = 64

MIN_PROMPT_TOKENS = 128  # the shortest first prompt, the kitchen's with the tiny tokenizer, has 103 tokens


NOTE = "[retireopd] note: "  # a rule whose line starts so is printed, not refused: the flag is merely unused
DEVICES = r"auto|cpu|cuda(:\d+)?"


def config_rules(algorithms: dict, notes: bool) -> list:
    """validate_config's rules, in the order they are judged: (condition, message) rows, the condition a
    function of the config, the message its one line (or a function of the config that writes it). A rule
    whose condition holds refuses the run, or, if its line is a NOTE, prints it (the notes' conditions hold
    only when `notes`). A row per flag of a list binds its name as the lambda's default (name=name)."""
    import tiny  # the models built in code

    def algorithm(c):
        return algorithms.get(c.algo)

    @functools.lru_cache(maxsize=None)  # (judged once, said as found)
    def teacher_problem(teacher: str, env: str) -> Optional[str]:
        return teacher_folder_problem(Path(teacher), env)

    def known_model(c):
        return c.model in MODEL_ALIASES or c.model == "tiny" or c.model.startswith("random:")

    return [
        (lambda c: c.algo not in algorithms, lambda c: f"--algo {c.algo!r}: choose one of {', '.join(algorithms)}"),
        (lambda c: c.env not in ENVS, lambda c: f"--env {c.env!r}: choose alfworld, webshop or kitchen"),
        (lambda c: c.group_size < 2, "--group-size must be >= 2: GRPO normalises within a group"),
        (lambda c: not 0 < c.rho <= 1, "--rho must be in (0, 1]"),
        (lambda c: c.window < 1, "--window must be >= 1"),
        (lambda c: c.teacher_iterations is not None and c.teacher_iterations < 1, "--teacher-iterations must be >= 1"),
        *[(lambda c, name=name: getattr(c, name) < 1, f"--{name.replace('_', '-')} must be >= 1")
          for name in ("iterations", "batch_tasks", "max_turns", "max_response_tokens", "mini_batch",
                       "opd_mini_batch", "token_budget", "ppo_epochs", "logprob_chunk")],
        (lambda c: c.max_prompt_tokens < (MIN_PROMPT_TOKENS if notes else 1),  # (a resume: the run's own value)
         f"--max-prompt-tokens must be >= {MIN_PROMPT_TOKENS}: a first prompt (instructions, task, actions) is "
         "longer, so a smaller budget would cut every prompt"),
        (lambda c: isinstance(c.seed, bool) or not 0 <= c.seed < 2**32,
         "--seed must be in [0, 2**32): the phases derive torch seeds from it, within what torch accepts"),
        (lambda c: c.eval_episodes is not None and c.eval_episodes < 1,
         "--eval-episodes must be >= 1 (leave it out for the whole panel)"),
        (lambda c: c.history < 0, "--history must be >= 0 (0: no past observations in the prompt)"),
        (lambda c: c.keep_checkpoints < 1, "--keep-checkpoints must be >= 1: --resume needs a checkpoint "
                                           "(--save-every 0 writes them only at phase ends and retirement)"),
        (lambda c: c.save_every < 0, "--save-every must be >= 0 (0: checkpoints only at phase ends and retirement)"),
        *[(lambda c, name=name: getattr(c, name) <= 0, f"--{name.replace('_', '-')} must be > 0")
          for name in ("clip_eps", "grad_clip", "success_reward")],
        (lambda c: c.eval_temperature < 0 or 0 < c.eval_temperature < MIN_TEMPERATURE,
         lambda c: f"--eval-temperature {c.eval_temperature}: 0 (greedy) or at least {MIN_TEMPERATURE} (below it "
                   "the logits divided by it overflow, and nothing can be sampled)"),
        (lambda c: c.lr_warmup_steps < 0, "--lr-warmup-steps must be >= 0 (0: no warm-up)"),
        (lambda c: c.warm_start < 0, "--warm-start must be >= 0 (0: the random tiny model)"),
        (lambda c: notes and c.teacher_iterations is not None and c.algo == "grpo",
         NOTE + "--teacher-iterations sets phase 1, which --algo grpo does not run"),
        (lambda c: c.sampler not in ("eager", "static", "auto"),
         "--sampler: eager, static or auto (static on a GPU, eager on CPU)"),
        (lambda c: c.eval_batch < 1, "--eval-batch must be >= 1"),
        (lambda c: c.prefill_batch < 0, "--prefill-batch must be >= 0 (0: prefill every prompt in one forward)"),
        (lambda c: not re.fullmatch(DEVICES, c.device), lambda c: f"--device {c.device}: auto, cpu, cuda or cuda:N"),
        (lambda c: re.fullmatch(DEVICES, c.device) and c.device.startswith("cuda") and not torch.cuda.is_available(),
         lambda c: f"--device {c.device}: this torch sees no CUDA GPU (use --device cpu or auto)"),
        (lambda c: c.retire_at is not None and c.retire_at > c.iterations,
         lambda c: f"--retire-at {c.retire_at} is after the last iteration ({c.iterations})"),
        *[(lambda c, name=name: getattr(c, name) < 0, f"--{name.replace('_', '-')} must be >= 0")
          for name in ("kl_coef", "opd_kl_coef", "entropy_coef", "opd_coef", "malformed_penalty", "lr",
                       "weight_decay")],
        (lambda c: c.lr >= 1 or c.lr * c.weight_decay >= 1,  # AdamW: w <- w (1 - lr wd) - lr m/sqrt(v)
         lambda c: f"--lr {c.lr} with --weight-decay {c.weight_decay}: an AdamW step moves each weight by about lr "
                   "and multiplies it by 1 - lr * weight decay, so lr must be < 1 and lr * weight decay < 1 (the "
                   "protocol's lr is 1e-6)"),
        (lambda c: algorithm(c) is not None and not algorithm(c).student_opd and c.teacher is not None,  # grpo ...
         lambda c: f"--teacher: --algo {c.algo} trains " + (
             "a teacher and no student" if c.algo == "skill-grpo" else "a student without a teacher")
         + ", so it would not be used: drop it, or choose --algo retireopd, opd or grpo+opd"),
        (lambda c: notes and algorithm(c) is not None and c.teacher_success is not None and (
            algorithm(c).retirement != "adaptive" or c.retire_at is not None),  # merely unused: a note
         lambda c: NOTE + f"--teacher-success only decides the adaptive retirement: --algo {c.algo}"
         + (f" --retire-at {c.retire_at}" if c.retire_at is not None else "") + " does not use it"),
        (lambda c: c.algo == "opd" and c.opd_coef == 0,
         "--algo opd trains on lambda * L_OPD alone: --opd-coef must be > 0"),
        (lambda c: c.dual_clip <= 1, "--dual-clip must be > 1 (it caps the loss of a negative advantage at -c*A)"),
        (lambda c: c.window >= 1 and not 1 <= c.eval_every <= c.window,  # (a bad --window is reported alone)
         lambda c: f"--eval-every {c.eval_every}: must be between 1 and --window ({c.window}), so that every block "
                   "of W iterations is judged at a validation"),
        (lambda c: c.teacher_success is not None and not 0 < c.teacher_success <= 1,
         "--teacher-success must be in (0, 1]"),
        (lambda c: c.retire_at is not None and (c.algo != "retireopd" or c.retire_at < 1),
         "--retire-at N needs --algo retireopd and N >= 1"),
        (lambda c: c.teacher is not None and teacher_problem(c.teacher, c.env),
         lambda c: f"--teacher {teacher_problem(c.teacher, c.env)}"),
        (lambda c: c.webshop_reward not in ("faithful", "fixed"), "--webshop-reward: faithful or fixed"),
        (lambda c: not 0 <= c.env_workers <= MAX_ENV_WORKERS,
         f"--env-workers must be between 0 (step ALFWorld in this process) and {MAX_ENV_WORKERS} (each worker is a "
         "process of about 260 MB)"),
        (lambda c: notes and 0 <= c.env_workers <= MAX_ENV_WORKERS and c.env_workers and c.env != "alfworld",
         lambda c: NOTE + f"--env-workers is for ALFWorld; {c.env} steps in this process"),
        (lambda c: c.frozen_dtype not in ("float32", "bfloat16"), "--frozen-dtype: float32 or bfloat16"),
        (lambda c: c.loss_agg not in ("exact", "authors"),
         "--loss-agg: exact (one token-mean per mini-batch) or authors (their micro-batch means)"),
        (lambda c: c.micro_batch_rows < 1, "--micro-batch-rows must be >= 1"),
        (lambda c: c.report_to not in ("none", "tensorboard", "wandb"), "--report-to: none, tensorboard or wandb"),
        (lambda c: c.batch_tasks % multigpu.world_size(),
         lambda c: f"--batch-tasks {c.batch_tasks}: under torchrun each of the {multigpu.world_size()} processes "
                   "plays whole groups, so it must be a multiple of --nproc_per_node"),
        (lambda c: not known_model(c) and "/" not in c.model and not Path(c.model).is_dir(),
         lambda c: f"--model {c.model}: not a local folder, a hub id (org/name) or an alias "
                   f"({', '.join([*MODEL_ALIASES, 'tiny'])}, random:<alias>)"),
        (lambda c: c.model.startswith("random:") and c.model.split(":", 1)[1] not in tiny.QWEN25_SHAPES,
         lambda c: f"--model {c.model}: random: takes one of {', '.join(tiny.QWEN25_SHAPES)}"),
    ]


def validate_config(cfg, algorithms: dict, notes: bool = True) -> None:
    """Bad flags fail here, in one line each, before any model is loaded (and flags that are merely unused
    get a note, unless `notes` is False: a resume said them when the run started). algorithms: the --algo
    table (retireopd.py's ALGORITHMS)."""
    not_finite = [f"--{f.name.replace('_', '-')} {getattr(cfg, f.name)}: must be a finite number"
                  for f in dataclasses.fields(cfg)
                  if isinstance(getattr(cfg, f.name), float) and not math.isfinite(getattr(cfg, f.name))]
    if not_finite:  # (NaN passes every `< 0` below: nothing else is judged until these are fixed)
        raise SystemExit("retireopd: " + "\n".join(not_finite))
    problems = []
    for condition, message in config_rules(algorithms, notes):
        if condition(cfg):
            line = message(cfg) if callable(message) else message
            if line.startswith(NOTE):
                print(line)
            else:
                problems.append(line)
    if problems:
        raise SystemExit("retireopd: " + "\n".join(problems))
