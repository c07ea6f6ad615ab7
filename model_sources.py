"""Models and teachers: what cannot be loaded, or cannot teach this run, said in one line before anything
is written. A --model that cannot be loaded (model_source_problem: a local folder, or a hub id asked of the
Hugging Face hub once, quickly: hub_answer), a model folder that is not whole or names custom code
(saved_model_problem), a teacher that cannot teach this run (teacher_folder_problem, teacher_fit_problem),
and the fingerprints that tell weights and tokenizers apart (weights_fingerprint, tokenizer_fingerprint).
retireopd.py calls these at its edges; the method never does.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
from pathlib import Path
from typing import Optional

import torch
import transformers

from common import resolve_model_name


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
        stored = json.loads(record.read_text(encoding="utf-8"))
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
        written_by = json.loads((teacher_dir / "retireopd.json").read_text(encoding="utf-8")).get("run_id")
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
# Model folders: whole, of the model their config.json describes, and told apart by fingerprints
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
            configs[path.name] = json.loads(path.read_text(encoding="utf-8"))
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
    if not in_config and not (template.is_file() and template.read_text(encoding="utf-8").strip()):
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
