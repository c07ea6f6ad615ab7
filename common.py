"""What several modules share: the tables every part names, the device pick, and the run folder's
file helpers (its jsonl logs, atomic writes, its checkpoints, a model saved in bf16). A leaf: it
imports no module of ours.
"""

from __future__ import annotations

import json
import math
import os
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


def finite_json(value):
    """value with every float NaN or infinity replaced by None (JSON null), through dicts and lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite_json(item) for key, item in value.items()}
    return [finite_json(item) for item in value] if isinstance(value, (list, tuple)) else value


def write_text_atomically(path: Path, text: str) -> None:
    """path.write_text(text) that a crash cannot leave half-written: a temp file, then a rename."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def checkpoint_folders(run_dir: Path) -> list:
    """The resumable checkpoints of a run folder, oldest first (not one being written, nor one set aside)."""
    folder = Path(run_dir) / "checkpoints"
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.endswith((".tmp", ".corrupt"))) \
        if folder.is_dir() else []


def read_trainer_state(folder: Path) -> dict:
    """A checkpoint's trainer.pt, memory-mapped (under torchrun every rank reads it; the pages are shared).
    weights_only: tensors, numbers, strings, lists, tuples and dicts, which is all it holds; a file that
    asks to build any other object (a pickle can run code) fails to load, and nothing of it runs."""
    return torch.load(folder / "trainer.pt", weights_only=True, map_location="cpu", mmap=True)


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
    config = json.loads(config_file.read_text())
    config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
