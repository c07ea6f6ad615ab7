"""The repairs that keep a run resumable after a crash, a kill or a full disk: a checkpoint that is cut,
not whole (no tokenizer, no chat template), another run's or names custom code is set aside
(first_resumable_checkpoint), a lost or damaged config.json is restored from the checkpoints
(restored_config; run.json: run_folder.run_identity), the log lines of what a resume redoes are dropped
(truncate_logs), a lost log line is reported (log_holes), a failed write says what is kept and what to do
(write_failure), and a run that no longer trains stops while its checkpoints hold the weights before
(note_skipped_steps). retireopd.py calls these at its edges; the method never does.
"""

from __future__ import annotations

import contextlib
import errno
import json
import pickle
import re
import shutil
from pathlib import Path
from typing import Optional

from tqdm.auto import tqdm

from common import (PHASES, checkpoint_folders, read_jsonl, read_owned_text, read_trainer_state, rename_entry,
                    write_text_atomically)
from model_sources import non_finite_weights, saved_model_problem, tokenizer_problem


# ==================================================================================================
# Damaged files, and the repairs that keep a run resumable
# ==================================================================================================


TRAINER_STATE_KEYS = ("phase", "iteration", "optimizer", "python_rng", "rng", "world_size", "val_successes",
                      "retirement", "run_id")


def trainer_state_problem(state) -> Optional[str]:
    """Why a loaded trainer.pt cannot continue a run, or None: it must hold what checkpoint_phase writes."""
    if not isinstance(state, dict):
        return f"trainer.pt holds a {type(state).__name__}, not the trainer's state"
    missing = [key for key in TRAINER_STATE_KEYS if key not in state]
    if missing:
        return f"trainer.pt lacks {', '.join(missing)}"
    if state["phase"] not in PHASES or not isinstance(state["iteration"], int) or state["iteration"] < 0:
        return f"trainer.pt names no iteration of a phase ({state['phase']!r}, {state['iteration']!r})"
    if not isinstance(state["val_successes"], list) or not isinstance(state["optimizer"], dict):
        return "trainer.pt's validations or optimizer state are not what a checkpoint writes"
    return None


def log_holes(run_dir: Path, trained: tuple, phase: str, iteration: int, last_iterations: dict) -> Optional[str]:
    """The iterations that the checkpoint (phase, iteration) covers and metrics.jsonl has no line for (a
    line lost or cut before the checkpoint: not redone, since the checkpoint is past it), as one note;
    or None. trained: the phases this run trains; last_iterations: {phase: its last iteration}."""
    logged = {(m.get("phase"), m.get("iteration")) for m in read_jsonl(Path(run_dir) / "metrics.jsonl")}
    covered = [(p, k) for p in trained if PHASES.index(p) <= PHASES.index(phase)
               for k in range((iteration if p == phase else last_iterations[p]) + 1)]
    holes = [f"{p} {k}" for p, k in covered if (p, k) not in logged]
    if not holes:
        return None
    return (f"[retireopd] note: metrics.jsonl has no line for {len(holes)} iteration(s) that the checkpoint covers "
            f"({', '.join(holes[:6])}{', ...' if len(holes) > 6 else ''}): lost or cut before it was written, they "
            "are not redone and stay a hole in the log; the run goes on from the checkpoint")


def lost_teacher_problem(run_dir: Path, checkpoint: Path, state: dict, teacher_dir: Path) -> Optional[str]:
    """Why a resume cannot continue phase 2, or None: its checkpoint is of phase 2 and the teacher it
    distils from (phase 1's, RUN_DIR/teacher, or --teacher) is gone. Never redo phase 1 in its place:
    its lines are in the logs, and the student's checkpoint was trained against that teacher."""
    if state["phase"] != "student" or (teacher_dir / "retireopd.json").is_file():
        return None
    return (f"--resume {run_dir}: checkpoint {checkpoint.name} continues phase 2, but its teacher {teacher_dir} is "
            "gone: put that folder back (from a copy), or start a new run; the run folder is left as it is")


def format_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def first_resumable_checkpoint(run_dir: Path, run_id: str) -> tuple[Optional[Path], Optional[dict]]:
    """(the newest whole checkpoint of this run, its trainer state), or (None, None). One that is damaged (a
    file cut short by a crash or a full disk) or another run's is set aside as NAME.corrupt, with a note, and
    the one before it is tried."""
    for folder in reversed(checkpoint_folders(run_dir)):
        problem, state = saved_model_problem(folder) or non_finite_weights(folder), None
        if problem is None:
            try:
                state = read_trainer_state(folder)
                problem = trainer_state_problem(state)
            except pickle.UnpicklingError:  # weights_only refused it
                problem = "trainer.pt asks to build objects that are not data (a pickle can run code): not loaded"
            except Exception as error:  # cut short, missing, not a torch file
                problem = "trainer.pt does not load: " + (str(error).strip().splitlines() or ["?"])[0]
        if problem is None and state.get("run_id", run_id) != run_id:
            problem = f"it belongs to run {state['run_id']}, this folder holds run {run_id}"
        if problem is None:
            problem = tokenizer_problem(folder, state.get("tokenizer"))
        if problem is None:
            return folder, state
        aside = folder.with_name(folder.name + ".corrupt")
        rename_entry(folder, aside, run_dir)
        print(f"[retireopd] note: checkpoint {folder.name} is not usable ({problem}): set aside as "
              f"{aside.name}; trying the one before it")
    return None, None


def truncate_logs(run_dir: Path, phase: str, iteration: int, finished: tuple, last_iterations: dict) -> None:
    """On resume: drop the log lines of what the resumed run redoes, so that none appears twice: every
    iteration after the checkpoint (phase, iteration), and the start and end (memory estimate, report,
    teacher_ready) of every phase not in `finished`, the phases whose final model is saved (they are not
    redone; last_iterations: {phase: its last iteration}). A last line cut short by a crash is dropped,
    with a note."""
    point = (PHASES.index(phase), iteration)
    for saved in finished:  # a saved phase is complete, whichever checkpoint is used
        point = max(point, (PHASES.index(saved), last_iterations[saved]))

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
        records = [r for r in read_jsonl(run_dir / name, note=True) if keep(r)]
        write_text_atomically(run_dir / name, "".join(json.dumps(r) + "\n" for r in records))
    events = [e for e in read_jsonl(run_dir / "events.jsonl", note=True) if keep_event(e)]
    write_text_atomically(run_dir / "events.jsonl", "".join(json.dumps(e) + "\n" for e in events))


def write_failure(run_dir: Path, name: str, error: Exception) -> str:
    """The one line of a write into the run folder that failed (a full disk, a quota): what, why,
    what is kept, what to do."""
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    free = shutil.disk_usage(run_dir).free
    newest = (checkpoint_folders(run_dir) or [None])[-1]
    needed = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file()) if newest else 0
    code = getattr(error, "errno", None) or next(  # safetensors says "... (os error 27)"
        (int(n) for n in re.findall(r"os error (\d+)", reason)), None)
    full = code == errno.ENOSPC or "No space left" in reason or (free < needed and code != errno.EFBIG)
    kept = (f"the last checkpoint, {newest.name}, is kept: `--resume {run_dir}` continues from it" if newest
            else "no checkpoint was written yet")
    fewer = ("keep fewer checkpoints or write them less often with --keep-checkpoints and --save-every (--resume "
             "accepts new values of both)")
    advice = {errno.EFBIG: "a limit on the size of one file stopped it (`ulimit -f` shows it): raise that limit",
              errno.EDQUOT: f"your disk quota is used up: free some of it, or {fewer}"}.get(
                  code, f"free some space, or {fewer}" if full else "check that the folder is writable")
    return (f"retireopd: could not write {run_dir / name} ({'the disk is full: ' if full else ''}{reason}; "
            f"{format_bytes(free)} free there" + (f", a checkpoint takes {format_bytes(needed)}" if needed else "")
            + f"); {kept}; {advice}")


SKIPPED_ITERATIONS_TO_STOP = 3  # iterations in a row whose every optimizer step was skipped

def note_skipped_steps(record: dict, streak: int) -> int:
    """An iteration whose every optimizer step was skipped (a non-finite loss or gradient) says so;
    SKIPPED_ITERATIONS_TO_STOP of them in a row stop the run: it is no longer training. Returns the
    new count of such iterations in a row."""
    all_skipped = record.get("skipped_steps", 0) > 0 and record.get("optimizer_steps", 0) == 0
    streak = streak + 1 if all_skipped else 0
    if not all_skipped:
        return streak
    where = f"{record['phase']} iteration {record['iteration']}"
    if streak >= SKIPPED_ITERATIONS_TO_STOP:
        raise SystemExit(f"retireopd: every optimizer step of {streak} iterations in a row (up to "
                         f"{where}) was skipped: the loss or its gradient is not finite, so the run is no longer "
                         "training; start again with a lower --lr (the checkpoints hold the weights before)")
    tqdm.write(f"[retireopd] note: {where}: all {record['skipped_steps']} optimizer steps were skipped (a "
               "non-finite loss or gradient); the weights did not change")
    return streak


def restored_config(run_dir: Path, how: str) -> dict:
    """A run folder's settings when its config.json is missing or damaged: from the newest checkpoint that
    holds a copy (Run.checkpoint writes one; the run writes config.json again when it starts); without
    one, a one-line refusal."""
    for checkpoint in reversed(checkpoint_folders(run_dir)):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            saved = json.loads(read_owned_text(checkpoint / "retireopd.json"))["config"]
            print(f"[retireopd] note: {run_dir / 'config.json'} is {how}: the run's settings are restored from "
                  f"checkpoint {checkpoint.name}")
            return saved
    raise SystemExit(f"retireopd: --resume {run_dir}: " + ("no config.json there (not a run folder)" if how == "missing"
                     else "its config.json is damaged (not JSON), and no checkpoint holds a copy"))
