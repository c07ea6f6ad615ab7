"""The checks that keep a run honest and its folder safe, and the repairs of a damaged run folder.

Each check answers before anything is written, in one line that says what to do: bad flags
(validate_config; a resume's, saved_settings; the data folders they name, resolve_data_folders, and
the data itself, open_task_suite), a model that cannot be loaded (model_source_problem), a teacher that cannot teach
this run (teacher_folder_problem, teacher_fit_problem), a run folder that another process holds, that
holds another run, or whose own entries are links or FIFOs (check_run_folder, run_folder_problem). The
repairs keep a run resumable after a crash, a kill or a full disk: a checkpoint that is cut, not whole
(no tokenizer, no chat template) or names custom code is set aside, a lost run.json or config.json is
restored from the checkpoints, a lost log line is reported, a failed write says what is kept and what
to do. retireopd.py calls these at its edges; the method never does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import hashlib
import json
import math
import os
import pickle
import re
import shlex
import shutil
import stat
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import transformers
from tqdm.auto import tqdm

import alfworld_env
import multigpu
from common import (ENVS, MODEL_ALIASES, PHASES, checkpoint_folders, create_file, read_jsonl, read_owned_text,
                    read_trainer_state, remove_entry, rename_entry, resolve_model_name, write_text_atomically)
from environments import TaskSuite


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
OWN_FOLDERS = ("checkpoints", "teacher", "student", "tiny_base", "alfworld_fixtures")  # written by this script


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
    without locks (some network disks) gets a note: the folder is then not guarded."""
    import fcntl
    path = folder / LOCK_FILE
    if str(path.resolve()) in HELD_LOCKS:  # this process holds it already (main called again, as tests do)
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)  # never through a link
    handle = os.fdopen(fd, "r+")
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


def name_the_holder(folder: Path) -> None:
    """Write who holds the folder's lock into the lock file (once the folder is taken: a refused start
    leaves it as it was), for the refusal another start will print."""
    handle = HELD_LOCKS.get(str((folder / LOCK_FILE).resolve()))
    if handle is not None:
        handle.seek(0)
        handle.truncate()
        handle.write(f"process {os.getpid()} on {os.uname().nodename}, since {time.strftime('%Y-%m-%d %H:%M:%S')} "
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


def weights_fingerprint(source: Optional[str]) -> Optional[str]:
    """A fingerprint of a local model folder's weights, or None (the models built in code, hub ids): each
    .safetensors file's size, header (names, shapes, offsets) and three MiB of its data (start, middle, end).
    Weights trained further, or another model's, differ there; reading them whole would cost seconds per GB."""
    folder = Path(resolve_model_name(source)).expanduser() if source else None
    if folder is None or not folder.is_dir():
        return None
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        size = path.stat().st_size
        with open(path, "rb") as f:
            header = f.read(min(int.from_bytes(f.read(8), "little"), size))
            digest.update(path.name.encode() + str(size).encode() + header)
            for start in (8 + len(header), size // 2, max(size - 2**20, 0)):
                f.seek(start)
                digest.update(f.read(2**20))
    return digest.hexdigest()[:16]


# ==================================================================================================
# Damaged files, and the repairs that keep a run resumable
# ==================================================================================================


def saved_model_problem(folder: Path) -> Optional[str]:
    """Why a model folder (a checkpoint, a teacher, --model) is not whole, or None. Whole: weights, a
    config, a tokenizer (tokenizer.json, vocab.json + merges.txt, or tokenizer.model) and a chat template;
    every entry a file or a folder (a FIFO would block the load), every .json file parses and every
    .safetensors file is as long as its header says (a file cut short by a crash or a full disk fails
    one of them); and no file names custom code (auto_map): this script never runs code from a model
    folder. Cheap: the weights themselves are not read. (A --model folder's files may be links, as in
    the hub cache: they are followed here; a run folder's own entries never are, run_folder_problem.)"""
    special = next((p.name for p in sorted(folder.iterdir()) if not (p.is_file() or p.is_dir())), None)
    if special is not None:
        return f"{special} is neither a file nor a folder (a FIFO, a device or a dangling link)"
    weights = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
    if not (folder / "config.json").is_file() or not weights:
        return "no config.json" if weights else "no .safetensors weights"
    configs = {}
    for path in sorted(folder.glob("*.json")):
        try:
            configs[path.name] = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError, IsADirectoryError):
            return f"{path.name} is cut short or damaged"
    custom = [name for name in ("config.json", "tokenizer_config.json")
              if isinstance(configs.get(name), dict) and configs[name].get("auto_map")]
    if custom:
        return (f"its {custom[0]} names custom code (auto_map): this script runs no code from a model folder "
                "(trust_remote_code=False)")
    if not any(all((folder / name).is_file() for name in names) for names in (
            ("tokenizer.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",))):
        return "no tokenizer (tokenizer.json, vocab.json and merges.txt, or tokenizer.model)"
    template = folder / "chat_template.jinja"
    in_config = (configs.get("tokenizer_config.json") or {}).get("chat_template") \
        if isinstance(configs.get("tokenizer_config.json"), dict) else None
    if not in_config and not (template.is_file() and template.read_text().strip()):
        return "no chat template (chat_template.jinja is missing or empty): the prompts are built with it"
    stored = {}  # every tensor the weight files hold: its shape
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
            stored.update({k: tuple(t["shape"]) for k, t in header.items() if k != "__metadata__"})
        except (AttributeError, KeyError, TypeError, IndexError):  # (a list or a string is no header either)
            return f"{path.name} is cut short (its header is incomplete)"
        if size < 8 + header_size + end:
            return f"{path.name} is cut short ({size} of {8 + header_size + end} bytes)"
    return weights_problem(folder, stored)


def weights_problem(folder: Path, stored: dict) -> Optional[str]:
    """Why the weights (`stored`: {name: shape}, from the files' headers) are not the whole of the model that
    config.json describes, or None: a tensor the model has and the files lack (transformers would initialise it
    at random, in silence), one the model does not have (another architecture's), or one of another shape.
    The model is built on the meta device from its config (no memory, no weights read); a tied output head is
    the embedding, stored once."""
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
        with torch.device("meta"):
            expected = {name: tuple(tensor.shape) for name, tensor in transformers.AutoModelForCausalLM.from_config(
                config, trust_remote_code=False).state_dict().items()}
    except Exception as error:  # (any: the config is the user's file, and its validators raise their own kinds)
        return f"its config.json does not describe a causal language model ({type(error).__name__}: " + \
            (str(error).strip().splitlines() or ["?"])[0][:200] + ")"
    if getattr(config, "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)
        stored = {name: shape for name, shape in stored.items() if name != "lm_head.weight"}
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(stored) - set(expected))
    other_shape = sorted(name for name in set(expected) & set(stored) if expected[name] != stored[name])
    for problem, names in (("lack", missing), ("hold tensors this model does not have:", unexpected),
                           ("hold tensors of another shape than its config.json's:", other_shape)):
        if names:
            listed = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            return (f"its weights {problem} {listed}" + (" (transformers would initialise them at random)"
                                                         if problem == "lack" else "")
                    + f": they are not the {config.architectures[0] if config.architectures else 'model'} its "
                    "config.json describes")
    return None


def non_finite_weights(folder: Path) -> Optional[str]:
    """Which weight of a model folder holds a NaN or an infinity, or None (every tensor read, one at a time: a
    run never saves such weights, so a checkpoint that holds one was damaged after it was written)."""
    from safetensors import safe_open
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as weights:
            for name in weights.keys():
                tensor = weights.get_tensor(name)
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    return f"its weight {name} holds NaN or infinite values"
    return None


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


def tokenizer_fingerprint(tokenizer) -> str:
    """What makes two tokenizers the same for a run: the token -> id map and the special tokens (hashed)."""
    key = json.dumps([sorted(tokenizer.get_vocab().items()), sorted(map(str, tokenizer.all_special_tokens))])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def tokenizer_problem(folder: Path, fingerprint: Optional[str]) -> Optional[str]:
    """Why a checkpoint's tokenizer cannot go on with the run, or None: it must load (no remote code) and be
    the tokenizer the run trained with (its fingerprint, saved in trainer.pt). (Its files, its chat
    template among them, were checked by saved_model_problem.)"""
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as error:  # a missing, cut or foreign file
        return "its tokenizer does not load: " + (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    if fingerprint is not None and tokenizer_fingerprint(tokenizer) != fingerprint:
        return "its tokenizer is not the one the run trained with (another vocabulary or other special tokens)"
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


# ==================================================================================================
# Models and teachers: what cannot be loaded, or cannot teach this run
# ==================================================================================================


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


def from_the_cache_only(path: str) -> bool:
    """A cached hub model while the hub cannot be reached: load it straight from the cache (asking the
    hub first would retry for minutes)."""
    return not Path(path).is_dir() and hub_model_cached(path) and hub_answer(path).startswith("unreachable")


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
        if not (folder / "config.json").is_file():
            return (f"--model {name}: {folder} has no config.json, so it is not a Hugging Face model folder (a run's "
                    "teacher/ or student/ is one)")
        if not any(folder.glob("*.safetensors")):
            return (f"--model {name}: {folder} has no .safetensors weights (we load no pickled .bin weights: a "
                    "pickle can run code); convert them, or pass another folder")
        where = "" if str(folder) == name else f"{folder}: "
        return None if (problem := saved_model_problem(folder)) is None else f"--model {name}: {where}{problem}"
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


def teacher_folder_problem(folder: Path, env: str) -> Optional[str]:
    """Why a saved phase-1 teacher cannot teach a run on `env`, or None: it must have been written by
    phase 1 of this script (retireopd.json: S_T in [0, 1] and the environment) on the same
    environment, and be a model folder (config.json and weights; their vocabulary is checked against
    the student's when phase 2 loads it, teacher_fit_problem)."""
    record = folder / "retireopd.json"
    if not record.is_file():
        return (f"{folder}: no retireopd.json (the stored teacher success rate) in that folder; pass a folder "
                "written by phase 1 of this script")
    try:
        stored = json.loads(record.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as error:
        return f"{record} is damaged ({type(error).__name__}): not a teacher this script wrote"
    success = stored.get("teacher_success") if isinstance(stored, dict) else None
    if isinstance(success, bool) or not isinstance(success, (int, float)) or not 0 <= success <= 1:
        return (f"{record} is damaged: its teacher_success (S_T) is {success!r}, not a number in [0, 1]"
                if isinstance(stored, dict) and "teacher_success" in stored else
                f"{record} is damaged: it holds no teacher_success (S_T)")
    if stored.get("env") != env:
        return f"{folder} was trained on {stored.get('env')}, this run is --env {env}"
    if problem := saved_model_problem(folder):
        return f"{folder} is not a whole model folder ({problem})"
    return None


def foreign_teacher_problem(teacher_dir: Path, run_id: str) -> Optional[str]:
    """Why a run's own teacher/ is not the one its phase 1 wrote, or None: its retireopd.json names another run
    (one put back in place of a lost teacher, from another run's folder). A teacher of an older version names
    none, and is taken as the run's."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        written_by = json.loads((teacher_dir / "retireopd.json").read_text()).get("run_id")
        if isinstance(written_by, str) and written_by != run_id:
            return (f"{teacher_dir} was written by run {written_by}, and this folder holds run {run_id}: put this run's "
                    "own teacher back (from a copy), or pass the other one as --teacher to a new run")
    return None


def teacher_fit_problem(teacher, teacher_dir: Path, student, tokenizer) -> Optional[str]:
    """Why a teacher cannot score the student's tokens, or None: the same vocabulary (the size of the
    output layer, and the tokenizer's token -> id map). A teacher trained from the student's base
    model always fits."""
    sizes = (teacher.get_output_embeddings().weight.shape[0], student.get_output_embeddings().weight.shape[0])
    if sizes[0] != sizes[1]:
        return f"the teacher in {teacher_dir} has a vocabulary of {sizes[0]} tokens, the student {sizes[1]}"
    teacher_tokenizer = transformers.AutoTokenizer.from_pretrained(str(teacher_dir), trust_remote_code=False)
    if teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
        return f"the teacher in {teacher_dir} has another tokenizer than the student (the same token ids mean " \
               "other text)"
    return None


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
    try:
        suite = TaskSuite(cfg)
    except PermissionError as error:
        give_back_run_folder(cfg.run_dir, list(created))
        raise SystemExit(f"retireopd: permission denied: {error.filename or data} (this user may not read or write "
                         "it)") from None
    except (FileNotFoundError, ValueError) as error:
        give_back_run_folder(cfg.run_dir, list(created))
        raise SystemExit(f"retireopd: {error}") from None
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


RUN_DEFINING_SETTINGS = ("model", "algo", "env")  # a config.json without one of these is not a run's


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
        if allowed is None or (value is None and optional) or name == "retire_at" and value == "half":
            continue
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            return f"{name} is {value!r}, not {annotation.removeprefix('Optional[').rstrip(']')}"
    return None


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
    if cfg.algo not in algorithms:
        problems.append(f"--algo {cfg.algo!r}: choose one of {', '.join(algorithms)}")
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
    if cfg.max_prompt_tokens < (MIN_PROMPT_TOKENS if notes else 1):  # (a resume: the run's own value)
        problems.append(f"--max-prompt-tokens must be >= {MIN_PROMPT_TOKENS}: a first prompt (instructions, task, "
                        "actions) is longer, so a smaller budget would cut every prompt")
    if isinstance(cfg.seed, bool) or not 0 <= cfg.seed < 2**32:
        problems.append("--seed must be in [0, 2**32): the phases derive torch seeds from it, within what torch "
                        "accepts")
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
    if cfg.eval_temperature < 0 or 0 < cfg.eval_temperature < MIN_TEMPERATURE:
        problems.append(f"--eval-temperature {cfg.eval_temperature}: 0 (greedy) or at least {MIN_TEMPERATURE} (below "
                        "it the logits divided by it overflow, and nothing can be sampled)")
    if cfg.lr_warmup_steps < 0:
        problems.append("--lr-warmup-steps must be >= 0 (0: no warm-up)")
    if cfg.warm_start < 0:
        problems.append("--warm-start must be >= 0 (0: the random tiny model)")
    if notes and cfg.teacher_iterations is not None and cfg.algo == "grpo":
        print("[retireopd] note: --teacher-iterations sets phase 1, which --algo grpo does not run")
    if cfg.sampler not in ("eager", "static", "auto"):
        problems.append("--sampler: eager, static or auto (static on a GPU, eager on CPU)")
    if cfg.eval_batch < 1:
        problems.append("--eval-batch must be >= 1")
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
    if cfg.lr >= 1 or cfg.lr * cfg.weight_decay >= 1:  # AdamW: w <- w (1 - lr wd) - lr m/sqrt(v)
        problems.append(f"--lr {cfg.lr} with --weight-decay {cfg.weight_decay}: an AdamW step moves each weight by "
                        "about lr and multiplies it by 1 - lr * weight decay, so lr must be < 1 and lr * weight "
                        "decay < 1 (the protocol's lr is 1e-6)")
    algorithm = algorithms.get(cfg.algo)
    if algorithm is not None and not algorithm.student_opd and cfg.teacher is not None:  # grpo, skill-grpo
        trains = "a teacher and no student" if cfg.algo == "skill-grpo" else "a student without a teacher"
        problems.append(f"--teacher: --algo {cfg.algo} trains {trains}, so it would not be used: drop it, or choose "
                        "--algo retireopd, opd or grpo+opd")
    if notes and algorithm is not None and cfg.teacher_success is not None and (
            algorithm.student_retirement is None or cfg.retire_at is not None):  # merely unused: a note
        print(f"[retireopd] note: --teacher-success only decides the adaptive retirement: --algo {cfg.algo}"
              + (f" --retire-at {cfg.retire_at}" if cfg.retire_at is not None else "") + " does not use it")
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
    if not 0 <= cfg.env_workers <= MAX_ENV_WORKERS:
        problems.append(f"--env-workers must be between 0 (step ALFWorld in this process) and {MAX_ENV_WORKERS} (each "
                        "worker is a process of about 260 MB)")
    elif notes and cfg.env_workers and cfg.env != "alfworld":
        print(f"[retireopd] note: --env-workers is for ALFWorld; {cfg.env} steps in this process")
    if cfg.frozen_dtype not in ("float32", "bfloat16"):
        problems.append("--frozen-dtype: float32 or bfloat16")
    if cfg.loss_agg not in ("exact", "authors"):
        problems.append("--loss-agg: exact (one token-mean per mini-batch) or authors (their micro-batch means)")
    if cfg.micro_batch_rows < 1:
        problems.append("--micro-batch-rows must be >= 1")
    if cfg.report_to not in ("none", "tensorboard", "wandb"):
        problems.append("--report-to: none, tensorboard or wandb")
    if cfg.batch_tasks % multigpu.world_size():
        problems.append(f"--batch-tasks {cfg.batch_tasks}: under torchrun each of the {multigpu.world_size()} processes "
                        "plays whole groups, so it must be a multiple of --nproc_per_node")
    known = cfg.model in MODEL_ALIASES or cfg.model == "tiny" or cfg.model.startswith("random:")
    if not known and "/" not in cfg.model and not Path(cfg.model).is_dir():
        problems.append(f"--model {cfg.model}: not a local folder, a hub id (org/name) or an alias "
                        f"({', '.join([*MODEL_ALIASES, 'tiny'])}, random:<alias>)")
    import tiny  # the models built in code
    if cfg.model.startswith("random:") and cfg.model.split(":", 1)[1] not in tiny.QWEN25_SHAPES:
        problems.append(f"--model {cfg.model}: random: takes one of {', '.join(tiny.QWEN25_SHAPES)}")
    if problems:
        raise SystemExit("retireopd: " + "\n".join(problems))
