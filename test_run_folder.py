"""The run folder against an operator on a shared disk and a hostile colleague: no code from a pickle,
one process per folder, a resume that trains on what the run started with, no NaN ever saved, the
teacher checked against its student, signals, contradictory flags, and every bad value in one line.

Each test below fails on the code before these checks existed (the closing comment of each says how
it would fail). Fast ones run in seconds; the few with subprocesses are marked slow.
"""
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import checks
import retireopd as R
import webshop_env
from test_retireopd import QUICK, crash_instead_of_saving, phases

HERE = Path(__file__).parent
GRPO = ["--env", "webshop", "--algo", "grpo"]


def one_line_refusal(argv, match):
    """R.main(argv) stops with one line that matches `match`; returns it."""
    with pytest.raises(SystemExit) as stop:
        R.main(argv)
    message = str(stop.value.code)
    assert "\n" not in message and message.startswith("retireopd: "), message
    assert re.search(match, message), message
    return message


def interrupted_run(tmp_path, monkeypatch, name, *flags):
    """A webshop run that dies where the student's final model would be saved: its checkpoints stay."""
    run_dir = tmp_path / name
    crash_instead_of_saving(monkeypatch, run_dir, [*GRPO, *flags], lambda saved: saved == "student")
    return run_dir


# --- 1. no pickle from a run folder -----------------------------------------------------------------

class RunsCode:
    """Unpickled, this runs a shell command (what a hostile trainer.pt would hold)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_trainer_pt_that_would_run_code_is_set_aside_and_nothing_of_it_runs(tmp_path, monkeypatch, capsys):
    run_dir = interrupted_run(tmp_path, monkeypatch, "r")
    newest = sorted((run_dir / "checkpoints").iterdir())[-1]
    state = torch.load(newest / "trainer.pt", weights_only=True)
    marker = tmp_path / "the-command-ran"
    torch.save({**state, "extra": RunsCode(marker)}, newest / "trainer.pt")
    R.main(["--resume", str(run_dir)])
    assert not marker.exists()  # weights_only=False (before) ran it, and resumed as if nothing happened
    assert (newest.parent / (newest.name + ".corrupt")).is_dir()
    assert "asks to build objects that are not data" in capsys.readouterr().out
    assert phases(R.read_jsonl(run_dir / "metrics.jsonl")) == [("student", k) for k in range(3)]


def test_a_trainer_state_must_hold_what_a_checkpoint_writes():
    whole = {key: 0 for key in checks.TRAINER_STATE_KEYS} | {"phase": "student", "optimizer": {}, "val_successes": []}
    assert checks.trainer_state_problem(whole) is None
    assert "lacks run_id" in checks.trainer_state_problem({k: v for k, v in whole.items() if k != "run_id"})
    assert "names no iteration" in checks.trainer_state_problem({**whole, "phase": "x"})
    assert "holds a list" in checks.trainer_state_problem([1, 2])


# --- 2. one process per run folder --------------------------------------------------------------------

@pytest.mark.slow
def test_two_starts_at_once_and_a_resume_of_a_live_run_are_refused_in_one_line(tmp_path):
    run_dir = tmp_path / "shared"
    command = [sys.executable, "retireopd.py", *QUICK, *GRPO, "--run-dir", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    load = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # a busy machine: the starts interleave
    try:
        starts = [subprocess.Popen(command, cwd=HERE, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   text=True) for _ in range(2)]
        errors = [start.communicate(timeout=300)[1] for start in starts]
    finally:
        load.kill()
    assert sorted(start.returncode for start in starts) == [0, 1]  # before: 0 and 0, every line twice
    refused = errors[[start.returncode for start in starts].index(1)].strip().splitlines()[-1]
    assert refused.startswith(f"retireopd: {run_dir} is in use by process ") and "--resume" in refused
    assert phases(R.read_jsonl(run_dir / "metrics.jsonl")) == [("student", k) for k in range(3)]
    assert len({m["run_id"] for m in R.read_jsonl(run_dir / "events.jsonl") if "run_id" in m}) <= 1

    live = tmp_path / "live"  # a run that is still going: its --resume is refused, and names it
    process = subprocess.Popen([*command[:-1], str(live), "--iterations", "200"], cwd=HERE, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not R.read_jsonl(live / "metrics.jsonl"):
            time.sleep(0.05)
        one_line_refusal(["--resume", str(live)], f"is in use by process {process.pid} on ")
    finally:
        process.kill()
        process.wait()


# --- 3. a resume trains on exactly what the run started with ------------------------------------------

def write_catalogue(folder, products):
    folder.mkdir(exist_ok=True)
    _, attributes = webshop_env.builtin_catalogue()
    (folder / webshop_env.PRODUCTS_FILE).write_text(json.dumps(products))
    (folder / webshop_env.ATTRIBUTES_FILE).write_text(json.dumps(attributes))


def test_a_resume_reads_the_data_the_run_started_with_and_refuses_other_data(tmp_path, monkeypatch, capsys):
    products, _ = webshop_env.builtin_catalogue()
    data = tmp_path / "shop"
    write_catalogue(data, products[:9])  # not the built-in catalogue: fewer goals
    tasks = len(webshop_env.WebShop(str(data)).train_goal_indices)
    assert tasks != len(webshop_env.WebShop("builtin").train_goal_indices)
    monkeypatch.setenv("WEBSHOP_DATA", str(data))
    run_dir = interrupted_run(tmp_path, monkeypatch, "r")
    assert json.loads((run_dir / "config.json").read_text())["webshop_data"] == str(data)  # before: null
    monkeypatch.delenv("WEBSHOP_DATA")
    capsys.readouterr()
    R.main(["--resume", str(run_dir)])  # before: the built-in catalogue's 26 tasks, without a word
    assert f"({tasks} training tasks" in capsys.readouterr().out
    other = interrupted_run(tmp_path, monkeypatch, "other", "--webshop-data", str(data))
    write_catalogue(data, products[:10])  # the folder's files changed under the run
    one_line_refusal(["--resume", str(other)], "would not train on what the run started with \\(train_tasks")


# --- 4. a missing or damaged run.json throws nothing away ---------------------------------------------

@pytest.mark.parametrize("damage", ["removed", "cut"])
def test_a_lost_run_json_is_restored_from_the_checkpoints(tmp_path, monkeypatch, capsys, damage):
    run_dir = interrupted_run(tmp_path, monkeypatch, "r")
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    if damage == "removed":
        (run_dir / "run.json").unlink()
    else:
        (run_dir / "run.json").write_text('{"run_id": "2026')
    capsys.readouterr()
    R.main(["--resume", str(run_dir)])
    said = capsys.readouterr().out
    assert f"restored from checkpoint {kept[-1]} (run {run_id})" in said and "set aside" not in said
    assert json.loads((run_dir / "run.json").read_text())["run_id"] == run_id
    assert (run_dir / "run.json.corrupt").exists() == (damage == "cut")
    resumed = [e for e in R.read_jsonl(run_dir / "events.jsonl") if e["event"] == "resume"]
    assert resumed[-1]["checkpoint"] == kept[-1]  # before: every checkpoint set aside, phase 2 from 0
    assert phases(R.read_jsonl(run_dir / "metrics.jsonl")) == [("student", k) for k in range(3)]


# --- 5, 6. numbers: finite flags, a diverged step, nothing non-finite saved --------------------------

@pytest.mark.parametrize("flag", ["--lr", "--clip-eps", "--opd-coef", "--kl-coef", "--entropy-coef",
                                  "--alignment-threshold", "--rho"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_non_finite_flag_is_one_line_and_writes_nothing(tmp_path, flag, value):
    one_line_refusal(QUICK + ["--run-dir", str(tmp_path / "x"), "--save-every", "1", flag, value],
                     f"^retireopd: {flag} {value}: must be a finite number$")
    assert not (tmp_path / "x").exists()  # --lr inf, before: a checkpoint saved 100% NaN


def test_lr_and_weight_decay_must_keep_adamw_sane(tmp_path):
    one_line_refusal(QUICK + ["--run-dir", str(tmp_path / "x"), "--lr", "1e3"], "lr must be < 1 and lr \\* weight")
    one_line_refusal(QUICK + ["--run-dir", str(tmp_path / "x"), "--lr", "0.5", "--weight-decay", "2"], "< 1")
    assert not (tmp_path / "x").exists()


def test_a_step_that_leaves_non_finite_weights_stops_the_run_and_nothing_of_it_is_saved(tmp_path, monkeypatch):
    real_build = R.build_adamw

    def build_diverging_adamw(model, cfg):  # the second optimizer step leaves a NaN in the weights
        optimizer = real_build(model, cfg)
        real_step = optimizer.step

        def step(*args, **kwargs):
            out = real_step(*args, **kwargs)
            if R.optimizer_steps_taken(optimizer) == 2:
                next(model.parameters()).data[0, 0] = float("nan")
            return out
        optimizer.step = step
        return optimizer
    monkeypatch.setattr(R, "build_adamw", build_diverging_adamw)
    run_dir = tmp_path / "r"
    one_line_refusal(QUICK + GRPO + ["--run-dir", str(run_dir)],
                     "optimizer step 2 \\(lr 0.0001\\) left the weights with NaN or infinite values")
    for checkpoint in (run_dir / "checkpoints").iterdir():  # the one before the step, finite
        assert R.non_finite_tensors(R.load_policy(str(checkpoint), torch.device("cpu"), torch.float32)[0]
                                    .parameters()) == 0
    assert phases(R.read_jsonl(run_dir / "metrics.jsonl")) == [("student", 0)]


def test_a_non_finite_model_is_neither_loaded_nor_saved_and_logs_hold_no_nan(tmp_path):
    cfg = R.parse_config({"model": "tiny", "env": "webshop", "run_dir": str(tmp_path / "run")})
    run = R.Run(cfg)
    model, tok = R.load_policy("tiny", torch.device("cpu"), torch.float32)
    run.save_model(model, tok, "finite")
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("inf")
    with pytest.raises(SystemExit, match="not saving .*broken: [12] of its tensors hold NaN or infinite values"):
        run.save_model(model, tok, "broken")
    assert not (run.dir / "broken").exists() and not (run.dir / "broken.tmp").exists()
    model.save_pretrained(tmp_path / "nan-model")  # written by someone else
    tok.save_pretrained(tmp_path / "nan-model")
    with pytest.raises(SystemExit, match="weight tensors hold NaN or infinite values: not a usable model"):
        R.load_policy(str(tmp_path / "nan-model"), torch.device("cpu"), torch.float32)
    run.log("metrics.jsonl", {"loss": float("nan"), "terms": [1.0, float("-inf")]})
    assert json.loads((run.dir / "metrics.jsonl").read_text(), parse_constant=pytest.fail) == {
        "loss": None, "terms": [1.0, None]}


def test_iterations_whose_every_step_is_skipped_are_said_and_three_in_a_row_stop(capsys):
    skipped = {"phase": "student", "optimizer_steps": 0, "skipped_steps": 2}
    streak = checks.note_skipped_steps({**skipped, "iteration": 0}, 0)
    assert streak == 1 and "student iteration 0: all 2 optimizer steps were skipped" in capsys.readouterr().out
    streak = checks.note_skipped_steps({**skipped, "iteration": 1, "optimizer_steps": 1}, streak)  # a step taken
    assert streak == 0  # the count restarts
    streak = checks.note_skipped_steps({**skipped, "iteration": 2}, streak)
    streak = checks.note_skipped_steps({**skipped, "iteration": 3}, streak)
    with pytest.raises(SystemExit, match="3 iterations in a row \\(up to student iteration 4\\)"):
        checks.note_skipped_steps({**skipped, "iteration": 4}, streak)


# --- 7. a broken game is an error, never an empty episode ----------------------------------------------

def test_a_game_whose_reset_fails_is_counted_never_trained_on_and_a_broken_panel_stops(tmp_path, monkeypatch):
    cfg = R.parse_config({"model": "tiny", "run_dir": str(tmp_path / "run"), "max_turns": 2,
                          "max_response_tokens": 4})
    suite = R.TaskSuite(cfg)
    model, tok = R.load_policy("tiny", torch.device("cpu"), torch.float32)
    real_reset = R.KitchenEnv.reset
    broken = {task for task in suite.validation_panel[:12] if task % 2}

    def reset(self):  # what AlfWorldEnv.reset returns for a game file it cannot load
        observation, info = real_reset(self)
        return ("", {**info, "task": "", "error": "ValueError: broken game"}) if self.task in broken else (
            observation, info)
    monkeypatch.setattr(R.KitchenEnv, "reset", reset)
    result = R.evaluate(model, tok, suite, suite.validation_panel[:12], cfg, skills=False, desc="validation")
    assert result["env_errors"] == len(broken) and result["n"] == 12 - len(broken)  # before: 0 errors, n 12
    samples, episodes, _ = R.rollout(model, tok, suite, sorted(broken)[:2], cfg, group_size=2,
                                     skills_in_prompt=False, with_teacher_prompts=False, temperature=1.0,
                                     desc="rollout")
    assert samples == [] and all(e.error == "reset: ValueError: broken game" for e in episodes)
    with pytest.raises(SystemExit, match="every episode of the validation \\(6 tasks\\) failed to start, the first "
                                         "with reset: ValueError: broken game: the data is broken"):
        R.evaluate(model, tok, suite, sorted(broken), cfg, skills=False, desc="validation")


# --- 8, 9. the teacher: it must fit the student, and its stored S_T must be one ------------------------

def save_teacher(folder, vocab_extra=0, **record):
    model, tok = R.load_policy("tiny", torch.device("cpu"), torch.float32)
    if vocab_extra:
        model.resize_token_embeddings(model.config.vocab_size + vocab_extra)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / "retireopd.json").write_text(json.dumps({"teacher_success": 0.5, "env": "webshop", **record}))
    return folder


def test_a_teacher_with_another_vocabulary_is_refused_and_the_corrected_command_takes_the_folder(tmp_path, capsys):
    teacher = save_teacher(tmp_path / "big", vocab_extra=64)
    run_dir = tmp_path / "r"
    vocab = R.load_policy("tiny", torch.device("cpu"), torch.float32)[0].config.vocab_size
    one_line_refusal(QUICK + ["--env", "webshop", "--algo", "opd", "--teacher", str(teacher),
                              "--run-dir", str(run_dir)],
                     f"has a vocabulary of {vocab + 64} tokens, the student {vocab}: a teacher must be trained")
    assert (run_dir / "run.json").is_file()  # the start failed after the run folder was written
    capsys.readouterr()
    R.main(QUICK + [*GRPO, "--run-dir", str(run_dir)])  # the corrected command: before, "holds a run"
    assert "stopped before its first iteration (nothing trained or saved): cleared" in capsys.readouterr().out
    assert phases(R.read_jsonl(run_dir / "metrics.jsonl")) == [("student", k) for k in range(3)]
    assert [e["event"] for e in R.read_jsonl(run_dir / "events.jsonl")].count("start") <= 1


def test_a_failed_start_before_the_run_leaves_no_folder(tmp_path):
    one_line_refusal(QUICK + ["--env", "webshop", "--webshop-data", str(tmp_path), "--run-dir",
                              str(tmp_path / "a" / "b")], "items_shuffle_1000.json")
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("stored,said", [
    (float("nan"), "is nan"), (7.0, "is 7.0, not a number in \\[0, 1\\]"), (-0.25, "is -0.25"), ("0.8", "is '0.8'"),
    ([0.5], "is \\[0.5\\]"), (True, "is True"), (None, None)])
def test_a_bad_stored_S_T_is_a_damaged_teacher_in_one_line(tmp_path, stored, said):
    record = {} if stored is None else {"teacher_success": stored}
    teacher = save_teacher(tmp_path / "t")
    (teacher / "retireopd.json").write_text(json.dumps({"env": "webshop", **record}))
    one_line_refusal(QUICK + ["--env", "webshop", "--teacher", str(teacher), "--run-dir", str(tmp_path / "r")],
                     "retireopd.json is damaged: " + ("it holds no teacher_success" if said is None else
                                                      "its teacher_success \\(S_T\\) " + said))
    assert not (tmp_path / "r").exists()  # before: NaN and 7.0 never retired, the rest a traceback


def test_a_cut_retireopd_json_is_reported_as_damaged_not_missing(tmp_path):
    teacher = save_teacher(tmp_path / "t")
    (teacher / "retireopd.json").write_text('{"teacher_succ')
    assert "retireopd.json is damaged (JSONDecodeError)" in checks.teacher_folder_problem(teacher, "webshop")
    (teacher / "model.safetensors").unlink()  # a teacher folder that is not a model
    (teacher / "retireopd.json").write_text(json.dumps({"teacher_success": 0.5, "env": "webshop"}))
    assert "is not a whole model folder (no .safetensors weights)" in checks.teacher_folder_problem(teacher, "webshop")


# --- 10. signals -----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_sigterm_stops_after_the_iteration_with_a_checkpoint_and_the_resume_line(tmp_path):
    run_dir = tmp_path / "r"
    process = subprocess.Popen([sys.executable, "retireopd.py", *QUICK, *GRPO, "--iterations", "40", "--save-every",
                                "0", "--run-dir", str(run_dir)], cwd=HERE, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None and not R.read_jsonl(run_dir / "metrics.jsonl"):
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM  # before: 143 too, but no message and no checkpoint
    last = R.read_jsonl(run_dir / "metrics.jsonl")[-1]["iteration"]
    assert stderr.strip().splitlines()[-1] == (
        f"[retireopd] stopped by SIGTERM after student iteration {last}, with a checkpoint: continue with "
        f"`python retireopd.py --resume {run_dir}` (from the last checkpoint)")
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [f"1-student-{last:05d}"]  # --save-every 0
    R.main(["--resume", str(run_dir)])
    assert phases(R.read_jsonl(run_dir / "metrics.jsonl")) == [("student", k) for k in range(40)]


# --- 11, 12. contradictory flags, and the remaining tracebacks --------------------------------------------

def test_contradictory_flags_are_refused_and_unused_ones_noted(tmp_path, capsys):
    teacher = save_teacher(tmp_path / "t")
    for algo in ("skill-grpo", "grpo"):  # before: trained and evaluated nothing / silently ignored the teacher
        one_line_refusal(QUICK + ["--env", "webshop", "--algo", algo, "--teacher", str(teacher), "--run-dir",
                                  str(tmp_path / "x")], f"--teacher: --algo {algo} .* so it would not be used")
    R.parse_config({"model": "tiny", "env": "webshop", "algo": "grpo", "teacher_success": 0.5,
                    "run_dir": str(tmp_path / "y")})
    assert "note: --teacher-success only decides the adaptive retirement: --algo grpo does not use it" in \
        capsys.readouterr().out


def test_the_remaining_tracebacks_are_one_line(tmp_path, monkeypatch):
    run_dir = interrupted_run(tmp_path, monkeypatch, "r")
    config = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({**config, "newer_setting": 1}))
    one_line_refusal(["--resume", str(run_dir)], "does not know \\(newer_setting\\): it was written by another")
    one_line_refusal(QUICK + [*GRPO, "--run-dir", str(tmp_path / ("n" * 300))], "longer than the filesystem allows")
    (tmp_path / "weightless").mkdir()
    (tmp_path / "weightless" / "config.json").write_text("{}")
    one_line_refusal(QUICK + [*GRPO, "--model", str(tmp_path / "weightless"), "--run-dir", str(tmp_path / "w")],
                     "has no .safetensors weights")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    one_line_refusal(["--compare", str(run_dir), str(tmp_path / "half")], "no metrics.jsonl in")
    (tmp_path / "half" / "metrics.jsonl").write_text('{"x": 1}\n')
    one_line_refusal(["--compare", str(run_dir), str(tmp_path / "half")], "cannot draw .* not a run's of this script")
    shop = tmp_path / "shop"
    write_catalogue(shop, [{"asin": "B0"}])  # a product without its fields
    one_line_refusal(QUICK + [*GRPO, "--webshop-data", str(shop), "--run-dir", str(tmp_path / "s")],
                     "the webshop data in .* is malformed \\(KeyError")
    assert not (tmp_path / "s").exists()


def test_advice_fits_the_failure(tmp_path):
    import errno
    run = R.Run(R.parse_config({"model": "tiny", "env": "webshop", "run_dir": str(tmp_path / "run")}))
    too_big = checks.write_failure(run.dir, "metrics.jsonl", OSError(errno.EFBIG, "File too large"))
    assert "ulimit -f" in too_big and "free some space" not in too_big
    full = checks.write_failure(run.dir, "metrics.jsonl", OSError(errno.ENOSPC, "No space left on device"))
    assert "free some space" in full


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("alfworld") is None, reason="alfworld is not installed")
def test_broken_alfworld_games_through_the_real_engine(tmp_path):
    import alfworld_env
    root = alfworld_env.write_fixture_alfworld_games(tmp_path / "games")
    valid = alfworld_env.discover_alfworld_games(root, "valid_seen")
    broken = json.dumps({"pddl_domain": "(define", "grammar": "", "pddl_problem": "", "solvable": True})
    Path(valid[0]).write_text(broken)  # one game of the panel that the engine cannot load
    flags = QUICK + ["--env", "alfworld", "--alfworld-data", str(root), "--algo", "grpo", "--iterations", "1",
                     "--eval-episodes", "3"]
    R.main(flags + ["--run-dir", str(tmp_path / "one")])
    first = R.read_jsonl(tmp_path / "one" / "eval.jsonl")[0]
    assert first["env_errors"] == 1 and first["n"] == 2  # before: n 3, the broken game a "failure"
    for game in valid[1:]:
        Path(game).write_text(broken)
    one_line_refusal(flags + ["--run-dir", str(tmp_path / "all")],
                     "every episode of the student validation \\(3 tasks\\) failed to start")
