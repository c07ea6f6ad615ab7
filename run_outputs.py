"""What a run writes into its folder, and how it stops: the jsonl logs, the models, the resumable checkpoints
(Run), which of them a resume reads back (resumable_checkpoint, finished_phases), and the signals that stop
a run at a safe point (SIGTERM, SIGHUP) or at once (Ctrl-C) with the line that resumes it. retireopd.py's
method calls Run's methods by name (its banner lists them); this module imports nothing of it: the config,
the retirement state and the frozen models it is handed are read by their fields."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shlex
import signal
import time
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm.auto import tqdm

import memory  # the peak-memory gauges and the memory estimate
import model_sources  # the tokenizer's fingerprint, saved with every checkpoint
import multigpu  # under torchrun rank 0 writes, every rank calls
import repairs  # a write that fails (one line), skipped steps, the newest whole checkpoint
import run_folder  # which run the folder holds (run.json)
from common import (PHASES, append_line, checkpoint_folders, drop_custom_code, finite_json, fsync_logs, fsync_path,
                    fsync_tree, read_trainer_state, remove_entry, rename_entry, save_pretrained_as,
                    write_text_atomically)


class Run:
    """What a run writes into its folder: the jsonl logs, the models and the checkpoints.

    run_dir/run.json           which run the folder holds (its id, its inputs; a new run refuses such a folder)
    run_dir/.retireopd.lock    flock'ed by the process running there (lock_run_folder): one process per folder
    run_dir/config.json        the resolved Config
    run_dir/metrics.jsonl      one line per training iteration (docs/metrics.md: what each key means)
    run_dir/events.jsonl       start, teacher ready, retirement, done
    run_dir/eval.jsonl         evaluations on the fixed panel, per task type
    run_dir/teacher, student   final models, Hugging Face format in bf16 (+ retireopd.json)
    run_dir/checkpoints/       resumable checkpoints: fp32 policy + trainer.pt (optimizer, RNG, retirement)

    What a resume reads back is below it (resumable_checkpoint, finished_phases; repairs.truncate_logs drops
    the log lines it redoes). Under torchrun, rank 0 alone writes: every rank calls the same methods
    (saving a sharded model gathers its weights from all of them), and rank 0 writes what they gathered.
    """
    latest: Optional[Path] = None  # the folder of the last Run made in this process (the interrupt message)
    tracker: Any = None  # --report-to: a dashboards.Tracker; every line logged goes there too (main starts it)

    def __init__(self, cfg, inputs: Optional[dict] = None):  # cfg: retireopd.Config
        self.cfg = cfg
        self.dir = Path(cfg.run_dir)
        run_id = None
        if multigpu.main_process():
            self.dir.mkdir(parents=True, exist_ok=True)
            run_id = run_folder.run_identity(self.dir, cfg, inputs)["run_id"]
            write_text_atomically(self.dir / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2))
        self.run_id = multigpu.broadcast(run_id)
        self.started = self.lap_started = time.time()
        self.laps: dict = {}  # {stage: seconds}: where this process's wall time went (the end-of-run line)
        self.skipped_streak = 0
        Run.latest = self.dir

    def log(self, name: str, record: dict) -> None:
        if not multigpu.main_process():
            return
        record = finite_json(record)  # NaN and infinities are not JSON: they are written as null
        try:
            append_line(self.dir / name, json.dumps(record, allow_nan=False))
        except OSError as error:
            raise SystemExit(repairs.write_failure(self.dir, name, error)) from None
        if self.tracker is not None:
            self.tracker.log(name, record)

    def save_model(self, model, tokenizer, name: str, extra: Optional[dict] = None,
                   trainer_state: Optional[dict] = None, dtype: Optional[torch.dtype] = torch.bfloat16) -> Path:
        """Hugging Face format (from_pretrained / vLLM), written to a new temp folder, fsync'ed, then
        renamed: neither a crash nor a power loss leaves a half model under the final name.

        dtype: the weights' dtype on disk, bf16 by default (final models: half the size, and
        servable: vLLM's dtype=auto serves a float32 checkpoint in fp16, where Qwen2.5 breaks
        down); None keeps the fp32 master weights (resumable checkpoints). The live model is
        not changed. Sharded: the whole weights are gathered (every rank calls this), rank 0 writes."""
        from safetensors import SafetensorError
        weights = multigpu.full_state_dict(model)  # None: not sharded (save_pretrained reads the model itself)
        final, tmp = self.dir / name, self.dir / f"{name}.tmp"
        if not multigpu.main_process():
            return final
        tensors = [*(model.state_dict() if weights is None else weights).values(), *tensors_in(trainer_state)]
        if bad := non_finite_tensors(tensors):  # weights, AdamW's moments
            raise SystemExit(f"retireopd: not saving {final}: {bad} of its tensors hold NaN or infinite values "
                             "(what was saved before is kept)")
        try:
            remove_entry(tmp, self.dir)
            tmp.mkdir(mode=0o755)  # (fails on a link planted meanwhile; nobody else may add entries in it)
            if dtype is None:
                model.save_pretrained(tmp, state_dict=weights)
            else:
                save_pretrained_as(model, tmp, dtype, weights)
            tokenizer.save_pretrained(tmp)
            if extra is not None:
                (tmp / "retireopd.json").write_text(json.dumps(extra, indent=2), encoding="utf-8")
            if trainer_state is not None:
                torch.save(trainer_state, tmp / "trainer.pt")
            drop_custom_code(tmp)
            fsync_tree(tmp)
        except (OSError, RuntimeError, SafetensorError) as error:  # torch says "unexpected pos" on a full disk
            with contextlib.suppress(OSError):  # what was saved before stays as it was
                remove_entry(tmp, self.dir)
            raise SystemExit(repairs.write_failure(self.dir, name, error)) from None
        try:
            rename_entry(tmp, final, self.dir)
        except OSError as error:  # (a link planted above it since the start: nothing is renamed through it)
            raise SystemExit(repairs.write_failure(self.dir, name, error)) from None
        fsync_path(final.parent)  # the new name is durable before anything older is deleted
        return final

    def checkpoint(self, model, tokenizer, state: dict) -> None:
        """A resumable checkpoint after a completed iteration; keeps the last cfg.keep_checkpoints. The logs
        are fsync'ed first (a checkpoint never covers a log line a power loss could take), and the run's
        settings go with it (retireopd.json: a lost config.json is restored from there)."""
        name = f"checkpoints/{PHASES.index(state['phase'])}-{state['phase']}-{state['iteration']:05d}"
        if multigpu.main_process():
            (self.dir / "checkpoints").mkdir(exist_ok=True)
            fsync_logs(self.dir)
        self.save_model(model, tokenizer, name, {"config": dataclasses.asdict(self.cfg)},
                        {**state, "run_id": self.run_id, "tokenizer": model_sources.tokenizer_fingerprint(tokenizer)},
                        None)
        for old in checkpoint_folders(self.dir)[: -self.cfg.keep_checkpoints] if multigpu.main_process() else ():
            try:
                remove_entry(old, self.dir)
            except OSError as error:  # a mount point inside it: left as it is (it is not the run's to delete)
                tqdm.write(f"[retireopd] note: the old checkpoint {old.name} is kept ({error.strerror}); remove "
                           "it by hand once you have seen what is there")

    def measured_iterations(self, phase: str, start: int, iterations: int, device: torch.device):
        """A phase's iterations from `start`, under a progress bar (under torchrun rank 0's alone); each starts
        the iteration's clock and resets the peak-memory gauge (end_iteration reads both)."""
        self.bar = tqdm(range(start, iterations), desc=f"{phase} ({self.cfg.algo})", dynamic_ncols=True,
                        initial=start, total=iterations, disable=multigpu.world_size() > 1 and not multigpu.main_process())
        for iteration in self.bar:
            memory.reset_peak_memory(device)
            self.iteration_started, self.device = time.perf_counter(), device
            yield iteration

    def end_iteration(self, record: dict, model, tokenizer, iterations: int, retired_now: bool, *, optimizer,
                      rng: random.Random, val_successes: list, retirement) -> None:
        """An iteration's end: its metrics.jsonl line (with S_T in phase 2, the update's tokens per second),
        a checkpoint when one is due (checkpoint_phase), the progress bar's numbers."""
        if retirement is not None:
            record["teacher_success"] = retirement.teacher_success
        record["train_tokens_per_s"] = record["trained_tokens"] / max(record["t_update"], 1e-9)
        self.log_iteration(record)
        self.checkpoint_phase(model, tokenizer, record["phase"], record["iteration"], iterations, retired_now,
                              optimizer=optimizer, rng=rng, val_successes=val_successes, retirement=retirement)
        self.bar.set_postfix(progress_postfix(record, val_successes, retirement))

    def log_iteration(self, record: dict) -> None:
        """One metrics.jsonl line; under torchrun the slowest rank's time and the largest rank's peak, after
        a check that every rank fed the retirement rule the same numbers and took the same decision."""
        record["t_iteration"] = multigpu.max_over_ranks(time.perf_counter() - self.iteration_started)
        peaks = [peak for peak in multigpu.gather_objects(memory.peak_memory_gb(self.device)) if peak is not None]
        record["peak_mem_gb"] = max(peaks) if peaks else None  # (None: a platform without the figure)
        rules = multigpu.gather_objects({key: record.get(key)
                                         for key in ("gap", "val_success", "teacher_active", "retired")})
        if len({json.dumps(rule) for rule in rules}) > 1:  # (they come from gathered numbers)
            raise RuntimeError(f"the processes disagree on the retirement rule's inputs: {rules}")
        self.log("metrics.jsonl", record)
        self.skipped_streak = repairs.note_skipped_steps(record, self.skipped_streak)

    def log_memory_estimate(self, policy, phase: str, frozen, skill_tokens: Optional[int] = None):
        """Print and log the memory estimate of a phase, before it allocates anything heavy (memory.py); phase 1's
        prompts carry a skill block (room for memory.SKILL_BLOCK_TOKENS, unless skill_tokens says)."""
        if skill_tokens is None:
            skill_tokens = memory.SKILL_BLOCK_TOKENS if phase == "phase 1" else 0
        n_frozen = sum(model is not None for model in (frozen.teacher, frozen.reference))
        estimate = memory.print_memory_estimate(policy, self.cfg, phase, n_frozen, skill_tokens)
        self.log("events.jsonl", {"event": "memory_estimate", "phase": phase, "gib": estimate,
                                  "device": str(next(policy.parameters()).device)})

    def log_retirement(self, iteration: int, retirement, record: dict) -> None:
        """The retirement event (events.jsonl) with the numbers that decided it, and its message."""
        self.log("events.jsonl", {"event": "retirement", "rule": retirement.mode, "retired_at": retirement.retired_at,
                                  "decided_after_iteration": iteration,
                                  **{key: record.get(key) for key in ("judged_block", "progress", "competence",
                                                                      "val_success", "criterion_valid")}})
        tqdm.write(retirement_message(iteration, retirement, record))

    def log_report(self, phase: str, result: dict) -> None:
        """An end-of-phase evaluation on the report panel (eval.jsonl)."""
        self.log("eval.jsonl", {"phase": phase, "iteration": phase_iterations(self.cfg, phase) - 1,
                                "panel": "report", **result})

    def checkpoint_phase(self, model, tokenizer, phase: str, iteration: int, iterations: int, retired_now: bool, *,
                         optimizer, rng: random.Random, val_successes: list,
                         retirement) -> None:
        """A resumable checkpoint every --save-every iterations, at the phase's last iteration and at
        retirement: the fp32 policy and everything a resumed run needs to go on exactly as this one."""
        last = iteration + 1 == iterations
        stopping = not multigpu.all_ranks(not STOP_REQUESTED)  # SIGTERM / SIGHUP (any rank): stop here, checkpointed
        if last or retired_now or stopping or (self.cfg.save_every and (iteration + 1) % self.cfg.save_every == 0):
            rngs = multigpu.gather_objects(rng_state(next(model.parameters()).device))  # one per rank
            self.checkpoint(model, tokenizer, {
                "phase": phase, "iteration": iteration, "optimizer": multigpu.optimizer_state(model, optimizer),
                "python_rng": rng.getstate(), "rng": rngs[0] if len(rngs) == 1 else rngs,
                "world_size": multigpu.world_size(), "val_successes": val_successes,
                "retirement": dataclasses.asdict(retirement) if retirement else None})
        if stopping:
            raise Stopped(STOP_REQUESTED[0] if STOP_REQUESTED else signal.SIGTERM,
                          f"after {phase} iteration {iteration}, with a checkpoint")

    def lap(self, stage: str) -> None:
        """The seconds since the last lap (or the start) were spent on `stage`."""
        self.laps[stage] = round(time.time() - self.lap_started, 1)
        self.lap_started = time.time()

    def save_teacher(self, model, tokenizer, teacher_success: float, validations: list) -> None:
        # teacher_ready is logged before the save: a resume that finds teacher/ saved finds this line
        # too, one that does not drops it
        self.log("events.jsonl", {"event": "teacher_ready", "teacher_success": teacher_success})
        self.save_model(model, tokenizer, "teacher", {"teacher_success": teacher_success, "env": self.cfg.env,
                                                      "base_model": self.cfg.model, "validations": validations[-2:],
                                                      "run_id": self.run_id})
        multigpu.barrier()  # phase 2 reads it back on every rank
        self.lap("phase 1")

    def save_student(self, model, tokenizer, teacher_success: Optional[float],
                     retirement) -> None:
        self.save_model(model, tokenizer, "student", {"algo": self.cfg.algo, "teacher_success": teacher_success,
                                                      "retired_at": retirement.retired_at if retirement else None})
        self.lap("phase 2")


def resumable_checkpoint(run: Run) -> tuple[Optional[Path], Optional[dict]]:
    """(the newest whole checkpoint, its trainer state), or (None, None). One that is damaged (a file cut
    short by a crash or a full disk) or another run's is set aside as NAME.corrupt, with a note, and the
    one before it is tried (repairs.first_resumable_checkpoint). Under torchrun rank 0 chooses, and every
    rank loads it."""
    if not multigpu.main_process():
        name = multigpu.broadcast(None)
        folder = None if name is None else run.dir / "checkpoints" / name
        return (None, None) if folder is None else (folder, read_trainer_state(folder))
    folder, state = repairs.first_resumable_checkpoint(run.dir, run.run_id)
    multigpu.broadcast(folder.name if folder else None)
    return folder, state


def finished_phases(run_dir: Path) -> tuple:
    """The phases whose final model the run folder holds (teacher/, student/): a resume skips them."""
    return tuple(phase for phase in PHASES if (run_dir / phase / "retireopd.json").is_file())


STOP_REQUESTED: list = []  # the signal received, if any; the run stops at the end of the iteration


class Stopped(KeyboardInterrupt):
    """The run ends the way Ctrl-C ends it (the resume line), for a signal; exit status 128 + signal."""

    def __init__(self, signum: int, where: str = "at once"):
        super().__init__(signum, where)
        self.signum, self.where = signum, where


def stop_at_the_next_safe_point(signum: int, _frame) -> None:
    """SIGTERM / SIGHUP: finish this iteration, write a checkpoint, then stop (checkpoint_phase). A second
    signal stops at once, as Ctrl-C does (the last checkpoint is then the one to resume from)."""
    if STOP_REQUESTED:
        raise Stopped(signum)
    STOP_REQUESTED.append(signum)
    if multigpu.main_process():
        print(f"\n[retireopd] {signal.Signals(signum).name}: stopping after this iteration, with a checkpoint "
              "(a second signal stops at once)", flush=True)


def stop_line(how: str) -> str:
    """The last line of a stopped run: the command that resumes it, or that there is nothing to resume."""
    launcher = f"torchrun --nproc_per_node {multigpu.world_size()}" if multigpu.world_size() > 1 else "python"
    resume = f"{launcher} retireopd.py --resume {shlex.quote(str(Run.latest))}"
    return (f"\n[retireopd] {how}: continue with `{resume}` (from the last checkpoint)" if Run.latest
            else f"\n[retireopd] {how} before the run folder was written: nothing to resume")


def interrupt_once(_signum: int, _frame) -> None:
    """Ctrl-C: the run unwinds (KeyboardInterrupt) and prints how to resume. A second Ctrl-C while it unwinds
    ends it at once and quietly, with the same line and status: what the run wrote is already whole (every
    file is written aside and renamed), and a lock whose holder is gone is taken over by the next start."""
    if INTERRUPTED:
        if "said" not in INTERRUPTED:
            os.write(2, (stop_line("interrupted") + "\n").encode())
        os._exit(1)
    INTERRUPTED.append(True)
    raise KeyboardInterrupt


INTERRUPTED: list = []  # set by the first Ctrl-C, and once its line is printed


def retirement_message(iteration: int, retirement, record: dict) -> str:
    if retirement.mode == "fixed":
        return f"[retireopd] teacher retired on schedule: GRPO alone from iteration {retirement.retired_at}"
    return (f"[retireopd] teacher retired after iteration {iteration}: the gap K stopped shrinking "
            f"(block mean {record['judged_block']:.4g}, progress {record['progress']:+.3f} <= "
            f"{retirement.threshold}) and the student is competent (this and the previous judging validation, "
            f"{record['val_success']:.2f} now, average {record['competence']:.2f} x S_T >= {retirement.rho}); "
            f"GRPO alone from iteration {retirement.retired_at}")




def phase_iterations(cfg, phase: str) -> int:
    return (cfg.teacher_iterations or cfg.iterations) if phase == "teacher" else cfg.iterations


def progress_postfix(record: dict, val_successes: list, retirement) -> dict:
    postfix = {"success": f"{record['success']:.2f}"}
    if "gap" in record:
        postfix["K"] = f"{record['gap']:.4f}"
    if val_successes:
        postfix["val"] = f"{val_successes[-1]:.2f}"
    if retirement is not None:
        postfix["retired"] = retirement.retired
    return postfix


def non_finite_tensors(tensors) -> int:
    """How many of these tensors (a sharded one: this rank's shard) hold a NaN or an infinity."""
    flags = [torch.isfinite(getattr(t, "to_local", lambda: t)().detach()).all() for t in tensors
             if t.is_floating_point()]
    return int((~torch.stack(flags)).sum()) if flags else 0


def tensors_in(value) -> list:
    """Every tensor in a nested structure of dicts, lists and tuples (a trainer state)."""
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return [tensor for item in items for tensor in tensors_in(item)]


def rng_state(device: torch.device) -> dict:
    """The torch RNG streams a resumed run must continue: CPU, and the training GPU's only (a
    run may resume where a different set of GPUs is visible)."""
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device: torch.device) -> None:
    """state: rng_state's, or (under torchrun) one per rank, in rank order."""
    state = state[multigpu.rank()] if isinstance(state, list) else state
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and isinstance(state.get("cuda"), torch.Tensor):
        torch.cuda.set_rng_state(state["cuda"], device)
