"""What several test files share: the tiny model (a fixture), a small config, the quick flags of an
end-to-end run, and the helpers that crash a run on purpose or compare its logs. Tests that read
../shared skip when it is absent (each file says how it finds it)."""

import copy
import importlib.util
import json
import re

import pytest
import torch

import retireopd as R

torch.set_num_threads(1)  # tiny tensors: threading overhead only adds noise

# ALFWorld is its own install (it builds its planner): its tests skip without it, saying how to get it
HAVE_ALFWORLD = importlib.util.find_spec("alfworld") is not None
ALFWORLD_MISSING = "alfworld is not installed: pip install -r requirements-alfworld.txt (it builds a planner)"
needs_alfworld = pytest.mark.skipif(not HAVE_ALFWORLD, reason=ALFWORLD_MISSING)


@pytest.fixture(scope="module")
def pristine_tiny():
    return R.load_policy("tiny", torch.device("cpu"), torch.float32, seed=0)


@pytest.fixture
def tiny(pristine_tiny):
    """(model, tokenizer): a fresh copy for every test, which may train it or change its settings."""
    return tuple(copy.deepcopy(part) for part in pristine_tiny)


def small_cfg(**overrides):
    cfg = R.Config(model="tiny", env="webshop", max_turns=2, max_prompt_tokens=4096, mini_batch=4,
                   max_response_tokens=8, token_budget=4096)
    return R.dataclasses.replace(cfg, **overrides)


class FakeSuite:
    """A one-turn environment for plumbing tests: the task is to say 'open box 1'."""

    class Env:
        def reset(self):
            return "a box 1", {"task": "open the box", "task_type": "pick_and_place_simple",
                               "admissible": ["open box 1", "look"], "won": False}

        def step(self, action):
            won = action == "open box 1"
            return "ok", 10.0 * won, won, {"admissible": ["look"], "won": won}

    def __init__(self):
        self.train, self.validation_panel, self.report_panel = [0], [0], [0]

    def task_type(self, task):
        return "pick_and_place_simple"

    def new_episode(self, task, slot=0):
        return self.Env()


QUICK = ["--model", "tiny", "--iterations", "3", "--batch-tasks", "1", "--group-size", "2",
         "--max-turns", "2", "--max-response-tokens", "6", "--eval-every", "1", "--eval-episodes", "2",
         "--window", "1", "--save-every", "1", "--teacher-success", "0.5", "--warm-start", "0",
         "--opd-coef", "0.01", "--kl-coef", "0.01", "--entropy-coef", "0.001"]
# The random tiny model (--warm-start 0: no behaviour cloning, every code path in seconds) never
# wins, so the teacher's S_T would be 0 and --algo retireopd would stop before phase 2:
# --teacher-success 0.5 lets phase 2 run (and the rule never retires: competence 0). The protocol
# coefficients are the authors' (the demo preset changes them; see TINY_PRESET).


def run_cli(tmp_path, name, *flags):
    run_dir = tmp_path / name
    R.main(QUICK + ["--run-dir", str(run_dir), *flags])
    return run_dir, R.read_jsonl(run_dir / "metrics.jsonl"), R.read_jsonl(run_dir / "events.jsonl")


def phases(metrics):
    return [(m["phase"], m["iteration"]) for m in metrics]


TIMING_KEYS = ("t_", "tokens_per_s", "peak_mem_gb")


def comparable(metrics):
    """metrics.jsonl lines without their timings and memory (what two runs of one seed share)."""
    return [{k: v for k, v in m.items() if not k.startswith(TIMING_KEYS) and "per_s" not in k and "ms_per" not in k}
            for m in metrics]


class Crash(Exception):
    """Stops a run where a kill would (raised in place of a save)."""


def crash_instead_of_saving(monkeypatch, run_dir, flags, crash_at):
    """Run QUICK + flags in run_dir until the first Run.save_model(name) (a checkpoint or a final
    model) for which crash_at(name) is true: there the run stops, that save not even begun."""
    real_save = R.Run.save_model

    def save_model(self, model, tokenizer, name, *args, **kwargs):
        if crash_at(name):
            raise Crash(name)
        return real_save(self, model, tokenizer, name, *args, **kwargs)
    with monkeypatch.context() as patch:
        patch.setattr(R.Run, "save_model", save_model)
        with pytest.raises(Crash):
            R.main(QUICK + ["--run-dir", str(run_dir), *flags])


def one_line_refusal(argv, match):
    """R.main(argv) stops with one line that matches `match`; returns it."""
    with pytest.raises(SystemExit) as stop:
        R.main(argv)
    message = str(stop.value.code)
    assert "\n" not in message and message.startswith("retireopd: "), message
    assert re.search(match, message), message
    return message


def save_teacher(folder, vocab_extra=0, **record):
    model, tok = R.load_policy("tiny", torch.device("cpu"), torch.float32)
    if vocab_extra:
        model.resize_token_embeddings(model.config.vocab_size + vocab_extra)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / "retireopd.json").write_text(json.dumps({"teacher_success": 0.5, "env": "webshop", **record}))
    return folder
