"""What several modules share: the tables every part names, the device pick, and the run folder's
file helpers (its jsonl logs, durable atomic writes that follow no link, its checkpoints, a model saved
in bf16). A leaf: it imports no module of ours.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Optional

import torch

PHASES = ("teacher", "student")  # phase 1 trains the teacher, phase 2 the student
ENVS = ("alfworld", "webshop", "kitchen")  # kitchen: the offline demo's (kitchen_env.py)
MODEL_ALIASES = {
    "Qwen2.5-1.5B": "Qwen/Qwen2.5-1.5B-Instruct",
    "Qwen2.5-3B": "Qwen/Qwen2.5-3B-Instruct",
    "Qwen2.5-7B": "Qwen/Qwen2.5-7B-Instruct",
}


def resolve_model_name(name: str) -> str:
    """Alias -> hub id; `random:<alias>` and `tiny` are built in code (tiny.py)."""
    return MODEL_ALIASES.get(name, name)


def pick_device(name: str) -> torch.device:
    """--device: auto is the GPU when torch sees one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# ==================================================================================================
# The run folder's files
# ==================================================================================================


# A run folder may sit on a shared disk where others can write: what the run reads, writes, renames or
# deletes there is never followed through a link, never a FIFO or a device, and every write that replaces
# a file is durable (fsync) before it is in place. run_folder.run_folder_problem refuses a folder whose
# own entries are links or special files at the start; these helpers hold the line while the run goes on.

# What this platform's os.open offers, probed: Linux and macOS have O_NOFOLLOW and O_NONBLOCK; Windows has
# neither (open_entry then holds the line by other means), and O_BINARY, without which a descriptor would
# rewrite line ends; it cannot open a folder (no O_DIRECTORY), so a folder is not fsynced there.
NOFOLLOW, NONBLOCK, BINARY = (getattr(os, name, 0) for name in ("O_NOFOLLOW", "O_NONBLOCK", "O_BINARY"))
OPENS_FOLDERS = hasattr(os, "O_DIRECTORY")


def open_entry(path: Path, flags: int, mode: int = 0o644, folder_ok: bool = False) -> int:
    """os.open(path, flags) of a run folder's entry, following no link and waiting on no FIFO: with
    O_NOFOLLOW | O_NONBLOCK where the platform has them. Elsewhere by lstat and fstat: the entry is looked at
    first (a link, a FIFO or a device is refused before it is opened), a missing one is created with O_EXCL
    (which follows no link), an existing one opened without O_CREAT (a link swapped in meanwhile creates
    nothing), and the descriptor must be the file looked at (else it is closed before a byte is read or
    written). OSError: ELOOP for a link, EINVAL for what is not a regular file (or folder, if folder_ok)."""
    if NOFOLLOW:
        return os.open(path, flags | NOFOLLOW | NONBLOCK | BINARY, mode)
    for _ in range(3):
        try:
            seen = os.lstat(path)
        except FileNotFoundError:
            if not flags & os.O_CREAT:
                raise
            try:
                return os.open(path, flags | os.O_EXCL | BINARY, mode)
            except FileExistsError:
                continue  # created meanwhile: look at it again
        if stat.S_ISLNK(seen.st_mode):
            raise OSError(errno.ELOOP, "a link where the run keeps a file", str(path))
        if not (stat.S_ISREG(seen.st_mode) or folder_ok and stat.S_ISDIR(seen.st_mode)):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        fd = os.open(path, flags & ~os.O_CREAT | BINARY, mode)
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (seen.st_dev, seen.st_ino):
            os.close(fd)
            raise OSError(errno.ELOOP, "replaced while it was opened (by a link?)", str(path))
        return fd
    raise OSError(errno.EEXIST, "created and removed by another process while the run opened it", str(path))


def read_owned_text(path: Path) -> str:
    """The text of a run folder's file (open_entry: never through a link, never waiting on a FIFO); an entry
    that is not a regular file raises OSError (ELOOP, or EINVAL)."""
    fd = open_entry(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        return f.read().decode(errors="replace")


def an_iteration(value, first: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= first


def a_record(log: str, record) -> bool:
    """Whether a line of a run folder's log holds what a resume, the summary and the plots read of it, with
    values of the kinds a run writes: a phase of PHASES, an iteration that is an integer (-1: an evaluation
    before training), an evaluation's panel, skills and success, an event's name and the fields its kind needs
    (a retirement's iterations, a memory estimate's phase). Anything else is damage, never a traceback."""
    if not isinstance(record, dict):
        return False
    if log == "metrics.jsonl":
        return record.get("phase") in PHASES and an_iteration(record.get("iteration"))
    if log == "eval.jsonl":
        overall = record.get("overall")
        return (record.get("phase") in PHASES and an_iteration(record.get("iteration"), -1)
                and record.get("panel") in ("validation", "report") and isinstance(record.get("skills"), bool)
                and isinstance(overall, (int, float)) and not isinstance(overall, bool) and 0 <= overall <= 1)
    if log == "events.jsonl":
        event = record.get("event")
        if event == "retirement":
            return an_iteration(record.get("retired_at")) and an_iteration(record.get("decided_after_iteration"))
        if event == "memory_estimate":
            return record.get("phase") in ("phase 1", "phase 2")
        return isinstance(event, str)
    return True


def not_a_number(constant: str):
    raise ValueError(f"{constant} is not a value a run writes")  # (json.loads would accept NaN and Infinity)


def read_jsonl(path: Path, note: bool = False) -> list:
    """The records of a jsonl log ([] without the file). A last line cut short (a crash or a full
    disk while it was written) is dropped, with a note when `note`; a damaged line before the
    last is an error. A line that is JSON but not one of the log's records (a_record: not an object, without
    what a resume reads of it or with values of other kinds, or holding NaN, which a run never writes) is
    skipped, with a note when `note`:
    a resume rewrites the log without it, and a lost iteration is reported as a hole (log_holes)."""
    path = Path(path)
    lines = read_owned_text(path).splitlines() if os.path.lexists(path) else []
    records, skipped = [], []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line, parse_constant=not_a_number)
        except json.JSONDecodeError:
            if number < len(lines):
                raise SystemExit(f"retireopd: {path} line {number} is not JSON: the log is damaged before its last "
                                 "line (repair or delete that line)") from None
            if note:
                print(f"[retireopd] note: the last line of {path} was cut short (a crash while it was written): "
                      "dropped")
            continue
        except (ValueError, RecursionError):  # NaN or Infinity; nested deeper than a record ever is
            record = None
        if a_record(path.name, record):
            records.append(record)
        else:
            skipped.append(number)
    if skipped and note:
        print(f"[retireopd] note: {path} line(s) {', '.join(map(str, skipped[:6]))}{' ...' if len(skipped) > 6 else ''} "
              "are not records of this log (damaged): skipped, and left out when it is rewritten")
    return records


def append_line(path: Path, line: str) -> None:
    """line + newline at the end of a jsonl log, never through a link or into a FIFO."""
    fd = open_entry(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        f.write(line + "\n")


def no_link_between(root: Path, path: Path) -> None:
    """Raise OSError (ELOOP) if a folder between root (a run folder, which may itself be reached through a
    link) and path is a link or not a folder: what is then deleted or renamed at path stays inside root,
    even when a link was planted after the run folder was checked."""
    parts = Path(path).relative_to(root).parts
    for depth in range(1, len(parts)):
        folder = Path(root).joinpath(*parts[:depth])
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            raise OSError(errno.ELOOP, "a link, or not a folder, inside the run folder", str(folder))


def mount_points() -> list:
    """Every mount point this process sees, from Linux's /proc/self/mountinfo (its 5th field, with the octal
    escapes of spaces and tabs undone); [] where there is none (elsewhere a mount is told by its st_dev)."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as mounts:
            return [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4]) for line in mounts]
    except (OSError, IndexError):
        return []


def mount_inside(folder: Path) -> Optional[str]:
    """A mount point at or below `folder` (another disk, or a bind mount of another folder: whose files are
    not the run's), or None: from the mount table, and by each subfolder's st_dev (os.walk enters no link)."""
    real = os.path.realpath(folder)
    if point := next((p for p in mount_points() if p == real or p.startswith(real.rstrip(os.sep) + os.sep)), None):
        return point
    device = os.lstat(folder).st_dev
    for parent, folders, _ in os.walk(folder):
        for name in folders:
            if os.lstat(os.path.join(parent, name)).st_dev != device:
                return os.path.join(parent, name)
    return None


def remove_entry(path: Path, root: Optional[Path] = None) -> None:
    """Delete a run folder's entry: a link or a file is unlinked (a link's target is never touched), a
    real folder removed with its contents (shutil.rmtree unlinks the links inside, never follows them),
    unless a mount point lies inside it: then nothing is deleted (OSError EBUSY), since what is mounted
    there is not the run's. root: the run folder, when path lies deeper than its top (no_link_between is
    checked first)."""
    path = Path(path)
    no_link_between(root or path.parent, path)
    if not os.path.lexists(path):
        return
    if stat.S_ISDIR(os.lstat(path).st_mode):
        if mount := mount_inside(path):
            raise OSError(errno.EBUSY, f"{mount} is mounted inside it (not the run's): not deleted", str(path))
        shutil.rmtree(path)
    else:
        path.unlink()


def rename_entry(source: Path, target: Path, root: Path) -> None:
    """Rename a run folder's entry (a real file or folder, never a link) to target, replacing what target
    held (remove_entry); neither name is reached through a link below root (no_link_between)."""
    no_link_between(root, source)
    if stat.S_ISLNK(os.lstat(source).st_mode):
        raise OSError(errno.ELOOP, "a link where the run keeps a file or folder", str(source))
    remove_entry(target, root)
    Path(source).rename(target)


def make_fresh(folder: Path, root: Path) -> None:
    """folder made anew by this process, holding the regular files it held: a tracker (TensorBoard) writes
    there under names anyone can predict, and a link planted at one would be followed. The new folder
    (mode 0o755) lets no one else add a name to it; a link, a FIFO or a folder among the old one's entries
    is refused (OSError, naming it) before anything moves, and checked again once moved."""
    fresh = folder.with_name(folder.name + ".fresh")
    remove_entry(fresh, root)  # (one a crash left)
    os.mkdir(fresh, 0o755)
    moved = []
    if os.path.lexists(folder):
        for name in sorted(os.listdir(folder)):
            refuse_unless_regular(folder / name)
        for name in sorted(os.listdir(folder)):
            os.rename(folder / name, fresh / name)  # (a rename follows no link: a swapped-in one arrives as a link)
            moved.append(name)
        remove_entry(folder, root)
    for name in moved:
        refuse_unless_regular(fresh / name)
    os.rename(fresh, folder)


def refuse_unless_regular(path: Path) -> None:
    mode = os.lstat(path).st_mode
    if not stat.S_ISREG(mode):
        raise OSError(errno.ELOOP if stat.S_ISLNK(mode) else errno.EINVAL,
                      "a link" if stat.S_ISLNK(mode) else "not a regular file", str(path))


def create_file(path: Path) -> int:
    """A new, empty file at path for writing (its descriptor): whatever was there is removed first, and the
    file is created with O_EXCL (open_entry), so a link planted there meanwhile fails instead of being
    followed."""
    remove_entry(path)
    return open_entry(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)


def fsync_path(path: Path) -> None:
    """fsync a file, or a folder (the names renamed into it or deleted from it then survive a power loss),
    opened without following a link or waiting on a FIFO (open_entry). A filesystem that cannot fsync a
    folder (EINVAL), or a platform that cannot open one (Windows), keeps its own order."""
    if not OPENS_FOLDERS and stat.S_ISDIR(os.lstat(path).st_mode):
        return
    fd = open_entry(path, os.O_RDONLY, folder_ok=True)
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """fsync every file of a folder (a model just written), then the folder itself."""
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file() and not path.is_symlink():
            fsync_path(path)
    fsync_path(folder)


def fsync_logs(run_dir: Path) -> None:
    """fsync a run folder's jsonl logs: what a checkpoint about to be written covers is on the disk first."""
    for name in ("metrics.jsonl", "eval.jsonl", "events.jsonl"):
        if os.path.lexists(Path(run_dir) / name):
            fsync_path(Path(run_dir) / name)


def write_bytes_atomically(path: Path, data: bytes) -> None:
    """Replace path with data so that neither a crash nor a power loss leaves it half-written: a new temp
    file (create_file: never through a link), fsync'ed, renamed over path (a link at path is replaced,
    not followed), then the folder fsync'ed."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with os.fdopen(create_file(tmp), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def write_text_atomically(path: Path, text: str) -> None:
    """path.write_text(text) that a crash cannot leave half-written (write_bytes_atomically)."""
    write_bytes_atomically(path, text.encode())


def finite_json(value):
    """value with every float NaN or infinity replaced by None (JSON null), through dicts and lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite_json(item) for key, item in value.items()}
    return [finite_json(item) for item in value] if isinstance(value, (list, tuple)) else value


CHECKPOINT_NAME = re.compile(r"\d-(teacher|student)-\d{5}")  # Run.checkpoint's: phase number, phase, iteration


def checkpoint_folders(run_dir: Path) -> list:
    """The resumable checkpoints of a run folder, oldest first (not one being written, nor one set aside): the
    folders named as Run.checkpoint names them, and not another run's folder (a run.json), so that what
    someone put there (a run started inside it) is never taken for one, set aside or deleted."""
    folder = Path(run_dir) / "checkpoints"  # (a link is never one: run_folder_problem refuses it)
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.is_symlink() and CHECKPOINT_NAME.fullmatch(p.name)
                  and not (p / "run.json").exists()) if folder.is_dir() and not folder.is_symlink() else []


def read_trainer_state(folder: Path) -> dict:
    """A checkpoint's trainer.pt. Memory-mapped under torchrun (every rank reads it; the pages are shared);
    one process reads it whole, since AdamW would otherwise keep its moments in the file's mapping for the
    rest of the run, and a platform that cannot delete a mapped file (Windows) could not rotate that
    checkpoint away. weights_only: tensors, numbers, strings, lists, tuples and dicts, which is all it holds;
    a file that asks to build any other object (a pickle can run code) fails to load, and nothing of it runs."""
    return torch.load(folder / "trainer.pt", weights_only=True, map_location="cpu",
                      mmap=int(os.environ.get("WORLD_SIZE", "1")) > 1)


def drop_custom_code(folder: Path) -> None:
    """Remove `auto_map` (the custom code a model's hub repo may name, which this script never runs: the
    model loads with transformers' own class) from a model folder it saved, so that its checkpoints and
    final models, which must name no code (model_sources.saved_model_problem), load again."""
    for name in ("config.json", "tokenizer_config.json"):
        path = Path(folder) / name
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
        if isinstance(config, dict) and config.pop("auto_map", None) is not None:
            path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def save_pretrained_as(model, folder: Path, dtype: torch.dtype, weights: Optional[dict] = None) -> None:
    """model.save_pretrained with the weights (default: the model's) cast to dtype (copies on the CPU,
    a tied weight once), and config.json saying so under both names readers use: `dtype`
    (transformers >= 4.56) and `torch_dtype` (older transformers, and the vLLM builds pinned to them)."""
    copies, seen = {}, set()
    for key, tensor in (model.state_dict() if weights is None else weights).items():
        if (tensor.data_ptr(), tensor.shape) in seen:  # tied (lm_head = embedding): saved once
            continue
        seen.add((tensor.data_ptr(), tensor.shape))
        copies[key] = tensor.detach().to("cpu", dtype)
    model.save_pretrained(folder, state_dict=copies)
    config_file = Path(folder) / "config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
