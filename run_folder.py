"""The run folder: one process per folder (its lock), no mixing of runs (run.json: which run it holds,
and what that run reads), and the names a run writes there.

check_run_folder takes the folder, or refuses it in one line before anything is written: one that another
process holds, that holds another run, or whose own entries are links or FIFOs (run_folder_problem); a run
that stopped before its first iteration is cleared instead. run_identity reads run.json, or writes it (a lost
or damaged one is restored from the checkpoints), and a resume must read what the run read (run_inputs).
retireopd.py calls these at its edges; the method never does.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shlex
import socket
import stat
import sys
import time
from pathlib import Path
from typing import Optional

from common import (checkpoint_folders, create_file, open_entry, read_jsonl, read_owned_text, read_trainer_state,
                    remove_entry, rename_entry, write_text_atomically)
from model_sources import weights_fingerprint


# ==================================================================================================
# The run folder: one process per folder, and no mixing of runs
# ==================================================================================================


RUN_IDENTITY = "run.json"  # what a run folder holds: written when the run starts, kept by --resume


RUN_ENTRIES = (RUN_IDENTITY, "config.json", "metrics.jsonl", "events.jsonl", "eval.jsonl", "checkpoints",
               "teacher", "student")  # any of these: the folder holds a run (of any version of this script)


def holds_a_run(folder: Path) -> bool:
    return any(os.path.lexists(Path(folder) / name) for name in RUN_ENTRIES)  # (a dangling link counts)


WRITE_TEST = ".retireopd-write-test"
IN_PLACE = ("metrics.jsonl", "events.jsonl", "eval.jsonl", ".retireopd.lock")  # written without a new file
FILES = (RUN_IDENTITY, "config.json", "plot.png", "compare.png", "benchmark.json",  # replaced whole (a temp,
         WRITE_TEST)  # a rename); benchmark.json: bench.py's report
OWN_FOLDERS = ("checkpoints", "teacher", "student", "tiny_base", "alfworld_fixtures", "tensorboard")  # written by us


def run_folder_problem(folder: Path) -> Optional[str]:
    """Why the run folder cannot be used safely, or None: an entry that the program owns (the logs, the
    configs, the lock, the write test, the temp and set-aside names, the plots, and everything inside
    OWN_FOLDERS) is a link, a FIFO, a socket or a device, a file where a folder belongs or the reverse,
    a file written in place with other hard links, or a folder that cannot be listed. A link could make
    the run read, write, rename or delete outside its folder; a FIFO would block it. The folder itself
    may be reached through a link."""
    folder = Path(folder)
    if not os.path.isdir(folder):  # (False for a name too long too: the write test says why)
        return None
    owned = {*RUN_ENTRIES, *RUN_ARTEFACTS, *FILES, LOCK_FILE}
    entries = [folder / name for name in sorted(os.listdir(folder))
               if name in owned or name.endswith((".tmp", ".corrupt"))]
    try:
        for path in list(entries):
            if path.name in OWN_FOLDERS and stat.S_ISDIR(os.lstat(path).st_mode):
                for root, folders, files in os.walk(path, onerror=raise_it):  # (os.walk follows no link)
                    entries += [Path(root) / name for name in sorted(folders + files)]
    except OSError as error:
        return f"cannot list {error.filename} ({error.strerror}): the run must see everything in its own folders"
    for path in entries:
        try:
            mode, links = os.lstat(path).st_mode, os.lstat(path).st_nlink
        except FileNotFoundError:  # (gone since it was listed: another rank's write test)
            continue
        if stat.S_ISREG(mode) and links > 1 and path.name in IN_PLACE:
            return (f"{path} has {links - 1} other hard link(s): the run writes to it in place, so it would change "
                    "them too; copy it (cp, not ln), then try again")
        if stat.S_ISREG(mode) and path.name in OWN_FOLDERS and path.parent == folder \
                or stat.S_ISDIR(mode) and path.name in {*IN_PLACE, *FILES}:
            return f"{path} is a {'file' if stat.S_ISREG(mode) else 'folder'}, where the run keeps a " + \
                ("folder" if stat.S_ISREG(mode) else "file") + ": move it away, then try again"
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            kind = f"a link to {os.readlink(path)}" if stat.S_ISLNK(mode) else "a FIFO" if stat.S_ISFIFO(mode) \
                else "not a regular file (a socket or a device)"
            return (f"{path} is {kind}: a run folder's own entries must be plain files and folders (a link could "
                    "make the run write, rename or delete outside it, a FIFO would block it); remove it, then try "
                    "again")
    return None


def raise_it(error: OSError) -> None:
    raise error


def check_run_folder(run_dir: str, resuming: bool) -> list:
    """Take the run folder, or refuse it in one line before anything is written: one that another
    process is using (lock_run_folder), one that holds another run (unless resuming it; a run that
    stopped before its first iteration is cleared instead), a file, or a place where nothing can be
    written (a read-only or full disk, a name too long). The write test leaves no trace."""
    folder = Path(run_dir)
    missing = []
    if problem := run_folder_problem(folder):  # before anything is opened there
        raise SystemExit(f"retireopd: {problem}")
    try:
        blocking = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            raise SystemExit(f"retireopd: --run-dir {run_dir}: {blocking} is a file, not a folder")
        missing = [p for p in (folder, *folder.parents) if not p.exists()]  # deepest first
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / WRITE_TEST
        os.close(create_file(probe))
        probe.unlink()
    except OSError as error:
        for created in missing:
            with contextlib.suppress(OSError):
                created.rmdir()
        advice = {errno.ENOSPC: "the disk is full: free some space there" + (
                      ", then resume" if resuming else ", or choose a folder on another disk"),
                  errno.EDQUOT: "your disk quota is used up: free some of it, or choose a folder elsewhere",
                  errno.ENAMETOOLONG: "a name in that path is longer than the filesystem allows: choose a shorter "
                                      "one"}.get(error.errno, "choose one on a writable disk")
        raise SystemExit(f"retireopd: --run-dir {run_dir}: cannot create or write a folder there "
                         f"({error.strerror or error}): {advice}") from None
    lock_existed = (folder / LOCK_FILE).exists()
    lock_run_folder(folder)
    if not resuming and holds_a_run(folder):
        if not stopped_before_its_first_iteration(folder):
            if not lock_existed:  # (a folder of an older version: left as it was)
                give_back_run_folder(run_dir, [])
                (folder / LOCK_FILE).unlink(missing_ok=True)
            raise SystemExit(f"retireopd: {run_dir} holds a run: `--resume {run_dir}` continues it, or choose "
                             "another `--run-dir`")
        clear_a_start_that_stopped(folder, run_dir)
    found = sorted(set(os.listdir(folder)) & set(RUN_ARTEFACTS)) if not resuming else []
    # a demo base this script wrote may be put there beforehand (study.py does): it is used, never removed
    kept = [name for name in found if name == "tiny_base" and (folder / name / "retireopd.json").is_file()]
    if refused := [name for name in found if name not in kept]:  # names the run writes, in a folder holding no run
        give_back_run_folder(run_dir, missing)
        if not lock_existed:
            (folder / LOCK_FILE).unlink(missing_ok=True)
        raise SystemExit(f"retireopd: --run-dir {run_dir} holds no run but holds {', '.join(refused)}, which a run "
                         "would write over, add to or remove: choose a new or empty --run-dir")
    if not resuming:
        FOUND_AT_START[str(folder.resolve())] = kept
    name_the_holder(folder)
    return missing


FOUND_AT_START: dict = {}  # run folder -> what of RUN_ARTEFACTS it held when this process took it (run.json keeps it)


def clear_a_start_that_stopped(folder: Path, run_dir: str) -> None:
    """Remove what a run that stopped before its first iteration wrote, and nothing else. Its run.json says
    `clean_start` (the folder held none of RUN_ARTEFACTS when it started but what `found_at_start` lists, a
    demo base put there: check_run_folder refuses the rest), so its other entries (RUN_ENTRIES,
    RUN_ARTEFACTS) are all its own. Without it (an older version's
    run.json), only its logs and settings are removed: whose a tiny_base/ or a tensorboard/ is cannot be told,
    and the start is then refused, naming them."""
    identity = json.loads(read_owned_text(folder / RUN_IDENTITY))
    clean, found = identity.get("clean_start") is True, identity.get("found_at_start") or []
    removed = [name for name in (*RUN_ENTRIES, *(RUN_ARTEFACTS if clean else ()))
               if name not in found and os.path.lexists(folder / name)]
    for name in removed:
        remove_entry(folder / name)
    print(f"[retireopd] note: {run_dir} held a run that stopped before its first iteration (nothing trained or saved): "
          f"cleared (removed what it wrote: {', '.join(removed)})")


def give_back_run_folder(run_dir: str, created: list) -> None:
    """A start that failed before the run wrote anything: unlock the folder, and remove the lock file and
    the folders this start created, when they hold nothing else (nothing then blocks the next start)."""
    folder = Path(run_dir)
    lock = folder / LOCK_FILE
    if (handle := HELD_LOCKS.pop(str(lock.resolve()), None)) is not None:
        handle.close()
    if folder.is_dir() and {p.name for p in folder.iterdir()} <= {LOCK_FILE}:
        lock.unlink(missing_ok=True)
        for path in created:
            with contextlib.suppress(OSError):
                path.rmdir()


LOCK_FILE = ".retireopd.lock"  # in the run folder; its flock is held by the process that runs there
RUN_ARTEFACTS = ("tiny_base", "tiny_base.tmp", "alfworld_fixtures", "tensorboard", "wandb", "plot.png")
HELD_LOCKS: dict = {}  # run folder -> its open lock file; the kernel releases the lock when this process ends


def lock_run_folder(folder: Path) -> None:
    """One process per run folder: an exclusive flock on RUN_DIR/.retireopd.lock, taken before the folder
    is checked and held until this process ends (a crash or SIGKILL releases it too). The file names
    the holder, for the one-line refusal of a second start or of a --resume of a live run. A filesystem
    without locks (some network disks) gets a note: the folder is then not guarded. Where there is no
    flock (Windows), filelock's lock (lock_without_flock)."""
    path = folder / LOCK_FILE
    if str(path.resolve()) in HELD_LOCKS:  # this process holds it already (main called again, as tests do)
        return
    try:
        import fcntl
    except ImportError:
        HELD_LOCKS[str(path.resolve())] = lock_without_flock(folder, path)
        return
    handle = os.fdopen(open_entry(path, os.O_RDWR | os.O_CREAT), "r+", encoding="utf-8")  # never through a link
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process (it is starting)"
        handle.close()
        raise SystemExit(f"retireopd: {folder} is in use by {holder}: one process per run folder; wait for it to "
                         f"end (or stop it), then `--resume {folder}` continues the run") from None
    except OSError as error:
        print(f"[retireopd] note: {folder}'s filesystem cannot lock files ({error.strerror}): nothing keeps a "
              "second process out of this run folder")
    HELD_LOCKS[str(path.resolve())] = handle


class FileLockHolder:
    """A lock taken with filelock (lock_without_flock), held as the flock'ed file is: close() releases it."""

    def __init__(self, lock):
        self.lock = lock

    def close(self) -> None:
        self.lock.release()


def lock_without_flock(folder: Path, path: Path) -> FileLockHolder:
    """The folder's lock where the platform has no flock: filelock (torch's and the hub's dependency) takes
    what the platform offers (msvcrt's byte-range lock on Windows), released as a flock is when this process
    ends. filelock owns the lock file, so it does not name the holder; a link at its name is refused first."""
    import filelock
    if os.path.islink(path):
        raise SystemExit(f"retireopd: {path} is a link: a run folder's own entries are never links (remove it)")
    lock = filelock.FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        raise SystemExit(f"retireopd: {folder} is in use by another process: one process per run folder; wait "
                         f"for it to end (or stop it), then `--resume {folder}` continues the run") from None
    except OSError as error:
        print(f"[retireopd] note: {folder}'s filesystem cannot lock files ({error.strerror}): nothing keeps a "
              "second process out of this run folder")
    return FileLockHolder(lock)


def name_the_holder(folder: Path) -> None:
    """Write who holds the folder's lock into the lock file (once the folder is taken: a refused start
    leaves it as it was), for the refusal another start will print (not into filelock's file)."""
    handle = HELD_LOCKS.get(str((folder / LOCK_FILE).resolve()))
    if handle is not None and not isinstance(handle, FileLockHolder):
        handle.seek(0)
        handle.truncate()
        handle.write(f"process {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')} "
                     f"(`{shlex.join(sys.argv)[:300]}`)")
        handle.flush()


def release_run_folders() -> None:
    """Let other processes use the run folders this one held (at the end of main; exiting does it too)."""
    while HELD_LOCKS:
        HELD_LOCKS.popitem()[1].close()


def stopped_before_its_first_iteration(folder: Path) -> bool:
    """A run folder whose start failed after run.json was written (a teacher that does not fit, a
    model that does not load): our run.json, and no iteration, evaluation, checkpoint or saved model."""
    try:
        identity = json.loads(read_owned_text(folder / RUN_IDENTITY))
        if not isinstance(identity, dict) or "run_id" not in identity:
            return False
    except (OSError, ValueError, TypeError):
        return False
    progress = [name for name in ("metrics.jsonl", "eval.jsonl") if read_jsonl(folder / name)]
    return not progress and not any((folder / name).exists() for name in ("checkpoints", "teacher", "student"))


# ==================================================================================================
# Which run a folder holds (run.json), and what it reads: a resume must read the same
# ==================================================================================================


RUN_DEFINING_SETTINGS = ("model", "algo", "env")  # a config.json without one of these is not a run's


def run_identity(folder: Path, cfg, inputs: Optional[dict]) -> dict:
    """The folder's run.json: which run it holds (an id, when it started, what it runs, and `inputs`, what
    it trains and validates on). Read when it exists (a resumed run keeps its id), written otherwise.
    Checkpoints carry the id, so a run.json that is missing or damaged is restored from them (the
    damaged one is kept as run.json.corrupt): the checkpoints are never discarded for want of it. A
    resume whose inputs differ from the run's is refused (same_inputs)."""
    path = folder / RUN_IDENTITY
    identity = None
    with contextlib.suppress(OSError, ValueError):
        identity = json.loads(read_owned_text(path))
    if isinstance(identity, dict) and isinstance(identity.get("run_id"), str):
        edited = [f"{key} {getattr(cfg, key)} (the run's is {identity[key]})" for key in RUN_DEFINING_SETTINGS
                  if identity.get(key) is not None and identity[key] != getattr(cfg, key)]
        if edited:  # (config.json edited since: the run would go on as another)
            raise SystemExit(f"retireopd: --resume {folder}: its config.json says {', '.join(edited)}, as run.json "
                             "recorded when the run started: config.json was changed; restore it (a checkpoint "
                             "keeps a copy, checkpoints/*/retireopd.json) or start a new run")
        return same_inputs(identity, inputs, folder)
    damaged = os.path.lexists(path)
    if damaged:
        rename_entry(path, path.with_name(RUN_IDENTITY + ".corrupt"), folder)
    identity = {"run_id": f"{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(4).hex()}",
                "started": time.strftime("%Y-%m-%d %H:%M:%S"), "algo": cfg.algo, "env": cfg.env, "model": cfg.model,
                "inputs": inputs, "clean_start": True,  # (check_run_folder: of RUN_ARTEFACTS, only these were there)
                "found_at_start": FOUND_AT_START.get(str(folder.resolve()), [])}
    for checkpoint in reversed(checkpoint_folders(folder)):  # the newest whose trainer state names its run
        with contextlib.suppress(Exception):
            identity.update(run_id=str(read_trainer_state(checkpoint)["run_id"]), started=None, inputs=None,
                            restored_from=checkpoint.name)
            print(f"[retireopd] note: {path} was {'damaged (kept as run.json.corrupt)' if damaged else 'missing'}: "
                  f"restored from checkpoint {checkpoint.name} (run {identity['run_id']})")
            break
    write_text_atomically(path, json.dumps(identity, indent=2) + "\n")
    return same_inputs(identity, inputs, folder)


def same_inputs(identity: dict, inputs: Optional[dict], folder: Path) -> dict:
    """A resume must read what the run read (run_inputs): refuse it in one line if not, and record the
    inputs of a run.json that lacks them (restored from a checkpoint, or written by an older version)."""
    if inputs is None or identity.get("inputs") == inputs:
        return identity
    recorded = identity.get("inputs")
    changed = [f"{key} {recorded.get(key)} -> {value}" for key, value in inputs.items()
               if isinstance(recorded, dict) and key in recorded and recorded[key] != value]
    if changed:  # (a key the record lacks was added by a later version: recorded now, not compared)
        raise SystemExit(f"retireopd: --resume {folder} would not train on what the run started with ("
                         + "; ".join(changed) + "): restore those (a data folder, an environment "
                         "variable), or start a new run")
    identity = {**identity, "inputs": inputs}
    write_text_atomically(folder / RUN_IDENTITY, json.dumps(identity, indent=2) + "\n")
    return identity


def run_inputs(cfg, suite) -> dict:
    """What decides what a run trains and validates on, as resolved values: the data folder, the model,
    the teacher, and a fingerprint of the tasks (the training pool and both panels; WebShop: their
    goals' text; ALFWorld: the games' paths below the data root). A resume that would differ is refused."""
    def task_text(task):
        if cfg.env == "webshop":
            return suite.shop.goals[task]["instruction_text"]
        return os.path.relpath(task, suite.root) if cfg.env == "alfworld" else str(task)
    tasks = [[task_text(t) for t in pool] for pool in (suite.train, suite.validation_panel, suite.report_panel)]
    data = {"alfworld": cfg.alfworld_data, "webshop": cfg.webshop_data}.get(cfg.env, "built in")
    return {"data": data, "model": cfg.model, "teacher": cfg.teacher, "train_tasks": len(suite.train),
            "panels": [len(suite.validation_panel), len(suite.report_panel)],
            "tasks_sha256": hashlib.sha256(json.dumps(tasks).encode()).hexdigest()[:16],
            "model_weights": weights_fingerprint(cfg.model), "teacher_weights": weights_fingerprint(cfg.teacher)}
