"""tiny.py: the models built in code. The tiny tokenizer (Qwen2's format, trained on our prompts, saved
and reloaded unchanged), the warm start's examples (reading a note, other dishes' recipes, never the
demo's), and the tiny preset that --help shows."""

import random
import re
from collections import Counter


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
