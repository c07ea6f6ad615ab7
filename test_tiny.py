"""tiny.py: the models built in code. The tiny tokenizer (Qwen2's format, trained on our prompts, saved
and reloaded unchanged), the warm start's examples (reading a note, other dishes' recipes, never the
demo's), the shipped base model (current with the code, and what the code builds: slow), and the tiny
preset that --help shows.

    RETIREOPD_WRITE_BASE=1 python -m pytest -q test_tiny.py -k shipped_base_is_what   # refresh tiny_base/
"""

import json
import os
import random
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import kitchen_env
import retireopd as R
import tiny as built_in_models  # (the name `tiny` is the fixture of the tiny model)


def test_tiny_model_and_tokenizer(tiny):
    model, tok = tiny
    n_params = sum(p.numel() for p in model.parameters())
    assert 100_000 < n_params < 1_000_000
    text = "<think>héllo 看</think><action>go to cabinet 1</action>"
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level: everything round-trips
    prompt = tok.decode(R.encode_prompt(tok, "hi"))
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # a lone user message


def test_help_says_which_defaults_the_tiny_preset_replaces():
    helps = {action.dest: action.help for action in R.build_parser()._actions}
    for name, value in built_in_models.TINY_PRESET.items():
        default = R.Config.__dataclass_fields__[name].default
        assert f"[default: {default}; tiny: {value}]" in helps[name].replace("%%", "%"), name
    assert helps["seed"].endswith("[default: 0]")  # a flag the preset leaves alone says nothing about tiny


def test_tiny_tokenizer_saves_and_reloads_identically(tiny, tmp_path):
    model, tok = tiny
    tok.save_pretrained(tmp_path)
    model.config.save_pretrained(tmp_path)
    reloaded = R.transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = R.build_user_message("alfworld", "put 2 mugs in cabinet 10", 1, [("x-large, $40.00", "go to cabinet 1")],
                                "You see a mug 1.", ["take mug 1 from cabinet 1"])
    assert R.encode_prompt(reloaded, text) == R.encode_prompt(tok, text)
    assert reloaded.eos_token_id == tok.eos_token_id and reloaded.pad_token_id == tok.pad_token_id


def test_warm_start_teaches_reading_and_other_dishes_never_the_demo_recipes():
    rng, hits = random.Random(0), Counter()
    known = set(built_in_models.WARM_START_RECIPES)
    assert not known & set(kitchen_env.KITCHEN_RECIPES) and not known & set(built_in_models.WARM_START_UNKNOWN)
    for _ in range(4000):
        kind = rng.choice(("short", "skills", "known", "unknown"))
        message, answer = built_in_models.warm_start_example(rng, kind, R.build_user_message)
        action, well_formed = R.project_action(answer, "kitchen")
        assert well_formed
        if kind in ("short", "skills"):  # reading: the answer is what the recipe in the prompt says
            named = re.search(r"Recipe for a \w+: (\w+) it", message).group(1).lower()
            assert action.split()[0] == named
        if kind == "known":
            assert action.split()[0] in {*built_in_models.WARM_START_RECIPES[action.split()[-1]]}
        dish = action.split()[-1]
        if dish in kitchen_env.KITCHEN_RECIPES:  # a demo dish: its true step comes up at chance
            assert kind != "known"
            hits[kitchen_env.KITCHEN_RECIPES[dish][0] == action.split()[0] or kitchen_env.KITCHEN_RECIPES[dish][1] == action.split()[0]] += 1
    assert 0.14 < hits[True] / sum(hits.values()) < 0.19  # 1 in 6, a seasoning or a way to cook
    known = list(built_in_models.WARM_START_RECIPES.values())  # the known dishes favour no seasoning and no way to cook
    assert Counter(i for i, _ in known) == Counter({i: 2 for i in kitchen_env.KITCHEN_INGREDIENTS})
    assert Counter(m for _, m in known) == Counter({m: 2 for m in kitchen_env.KITCHEN_METHODS})


def test_the_shipped_base_is_current_with_the_code():
    # the demo starts from the project's tiny_base/ only while its key (what it was built from) is what
    # this code would build it from; else every demo rebuilds it (about a minute): refresh it (the
    # command in this file's docstring) whenever the shape, the warm start or the prompts change
    _, tok = R.load_policy("tiny", torch.device("cpu"), torch.float32)
    steps = built_in_models.TINY_PRESET["warm_start"]
    key = built_in_models.warm_start_key(steps, 0, tok, R.prompt_format())
    shipped = json.loads((R.SHIPPED_BASE / "retireopd.json").read_text())
    assert shipped["key"] == key, "tiny_base/ is stale: refresh it (test_tiny.py's docstring says how)"
    assert {p.name for p in R.SHIPPED_BASE.iterdir()} >= {"model.safetensors", "config.json", "tokenizer.json"}
    changed = built_in_models.warm_start_key(steps + 1, 0, tok, R.prompt_format())
    assert changed != key  # (another number of steps is another base: built in code)


def held_out_warm_start_loss(folder: Path) -> float:
    """The token mean of -log p of warm-start answers (256 examples of every kind, a seed the warm start
    never uses) under the model saved in `folder`: what the warm start teaches, measured."""
    model, tok = R.load_policy(str(folder), torch.device("cpu"), torch.float32)
    prompts, rng = R.prompt_format(), random.Random(12345)
    examples = [built_in_models.warm_start_example(rng, rng.choice(built_in_models.WARM_START_KINDS),
                                                   prompts.user_message) for _ in range(256)]
    prompt_ids = [prompts.encode(tok, message) for message, _ in examples]
    answers = [tok(answer + tok.eos_token, add_special_tokens=False)["input_ids"] for _, answer in examples]
    with torch.no_grad():
        return float(-R.sequence_logprobs(model, prompt_ids, answers, R.Config()).mean())


@pytest.mark.slow
def test_the_shipped_base_is_what_the_code_builds(tmp_path):
    # the warm start in code, 500 steps from seed 0, against the shipped weights. Not weight by weight: on
    # another CPU the sums round otherwise and 500 AdamW steps take another path (on one 2-core machine every
    # tensor differed by up to 0.33), so by what it teaches: both answer held-out warm-start examples as well
    # (measured: built 0.026, shipped 0.027 nats per token; the random tiny model 6.89)
    run = R.Run(R.parse_config({"run_dir": str(tmp_path / "run")}))
    built = Path(R.warm_started_tiny_base(run, torch.device("cpu"), 500, shipped=None))
    if os.environ.get("RETIREOPD_WRITE_BASE"):
        shutil.rmtree(R.SHIPPED_BASE, ignore_errors=True)
        shutil.copytree(built, R.SHIPPED_BASE)
    ours, shipped = load_file(built / "model.safetensors"), load_file(R.SHIPPED_BASE / "model.safetensors")
    assert ours.keys() == shipped.keys()
    assert all(ours[name].shape == shipped[name].shape for name in ours)
    same = sum(torch.equal(ours[name], shipped[name]) for name in ours)
    print(f"{same} of {len(ours)} tensors bit-identical to the shipped base")
    built_loss, shipped_loss = held_out_warm_start_loss(built), held_out_warm_start_loss(R.SHIPPED_BASE)
    assert built_loss < 0.1 and shipped_loss < 0.1 and abs(built_loss - shipped_loss) < 0.05, (built_loss, shipped_loss)
    assert json.loads((built / "retireopd.json").read_text())["key"] == \
        json.loads((R.SHIPPED_BASE / "retireopd.json").read_text())["key"]
