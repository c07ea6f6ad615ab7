"""The models built in code, for runs without a download: the tiny model of the offline demo (its shape,
its tokenizer, its warm start and its presets) and `random:<alias>`, a Qwen2.5 shape with random weights.

retireopd.py reads the presets when it parses the flags, and builds a model here when a run asks for one
(--model tiny, --model random:...). The tiny model is built around retireopd.py's prompts: they come in
as a PromptFormat (its prompt_format()), and the warm start's log-probs as a function, at the call.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from typing import Callable, NamedTuple, Optional

import torch
import transformers
from tqdm.auto import tqdm

from kitchen_env import KITCHEN_INGREDIENTS, KITCHEN_METHODS, KITCHEN_RECIPES, KITCHEN_SKILLS, KitchenEnv, kitchen_note


# Architectures of the Qwen2.5-Instruct checkpoints (their config.json), for `random:` shapes.
QWEN25_SHAPES = {
    "Qwen2.5-1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True),
    "Qwen2.5-3B": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
                       tie_word_embeddings=True),
    "Qwen2.5-7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       tie_word_embeddings=False),
}


# a small shape with the real 151,936-token vocabulary: the log-prob memory problem at CPU size
QWEN25_SHAPES["small-vocab151k"] = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         vocab_size=151936, tie_word_embeddings=True)


# two layers of four heads of 16: reading a skill block (finding the one capitalised ingredient among ~130
# tokens) is learned within the warm start by this shape (and by 16 heads of 4, not by 4 layers of 4 heads
# of 16); a forward and backward of 32 prompts of 175 tokens takes 79 ms on one CPU thread, against 152 ms
# with 16 heads of 4 (measured; docs/cost.md)
TINY_SHAPE = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, tie_word_embeddings=True)


class PromptFormat(NamedTuple):
    """The prompts the tiny model is built around, handed over by retireopd.py (prompt_format): its
    tokenizer's vocabulary is trained on them, and its warm start answers them."""
    texts: list  # the environments' intros and the format instruction
    skills: dict  # {environment: {task type: [rules]}}, the skill notes
    user_message: Callable  # build_user_message(env, task, steps, history, observation, admissible, skill_block)
    encode: Callable  # encode_prompt(tokenizer, user message) -> the chat template's token ids


CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# A randomly initialised model cannot write `<think>...</think><action>...</action>` nor read a
# skill block, and RL cannot find either from scratch in CPU minutes. --warm-start N teaches, by
# behaviour cloning on kitchen prompts, what a pretrained LLM brings to the kitchen: the answer
# format; reading the *first* step (the ingredient) of a recipe in a skill block (short prompts and
# full teacher prompts, random recipes); the recipes of twelve dishes it "knows" (invented ones);
# and, for dishes it has never heard of, guessing (random targets). The demo's six dishes appear
# only with random recipes (in reading examples and as unknown dishes), so the warm-started model
# knows none of their recipes: without skills it is at chance (1/36 per dish), and with skills it
# reads the ingredient but guesses the way to cook it (1/6). Everything above that is learned by
# RL (the teacher finding each way to cook in phase 1) and by RL and OPD (the student).
WARM_START_DISHES = ("brindle", "clomp", "drubble", "fennick", "gorse", "hoplin", "jibber", "krell",
                     "lummox", "nubbin", "pordle", "quorn")


_known = random.Random(12345)  # the recipes the warm-started model "knows": other dishes than the demo's


WARM_START_UNKNOWN = ("arbel", "bosk", "cwill", "dimp", "eskar", "flon", "gwint", "harl", "irple",
                      "jusk", "kemp", "loam")


def balanced(choices: tuple, n: int, rng: random.Random) -> list:
    """n picks from choices, each as often as n allows (shuffled): a base model that knows recipes
    of these dishes favours no seasoning and no way to cook on a dish it does not know."""
    picks = [choices[k % len(choices)] for k in range(n)]
    rng.shuffle(picks)
    return picks


WARM_START_RECIPES = dict(zip(WARM_START_DISHES, zip(balanced(KITCHEN_INGREDIENTS, len(WARM_START_DISHES), _known),
                                                      balanced(KITCHEN_METHODS, len(WARM_START_DISHES), _known))))


WARM_START_ANSWER = "<think>the next step</think><action>{}</action>"


def warm_start_example(rng: random.Random, kind: str, user_message: Callable) -> tuple[str, str]:
    """(user message, answer) of one warm-start example; user_message: PromptFormat.user_message.

    kind "short": a random note (kitchen_note: the seasoning) and the first step's admissible
    actions; "skills": the full teacher prompt with a random note, at the first step (reading). "known": a full prompt
    without skills for one of WARM_START_DISHES, answered by its fixed recipe, at either step;
    "unknown": the same for an unknown dish or one of the demo's, answered by a random step
    (nothing to know: the model stays uncertain there, and so explores).
    """
    if kind == "known":  # a dish the model knows, with its known recipe
        dish = rng.choice(WARM_START_DISHES)
        ingredient, method = WARM_START_RECIPES[dish]
    elif kind == "unknown":  # a dish it has never heard of, the demo's among them: it guesses
        dish = rng.choice(WARM_START_UNKNOWN + tuple(KITCHEN_RECIPES))
        ingredient, method = rng.choice(KITCHEN_INGREDIENTS), rng.choice(KITCHEN_METHODS)
    else:  # reading: a random recipe for any dish, the demo's included (it says nothing of theirs)
        dish = rng.choice(WARM_START_DISHES + tuple(KITCHEN_RECIPES))
        ingredient, method = rng.choice(KITCHEN_INGREDIENTS), rng.choice(KITCHEN_METHODS)
    recipes = {dish: (ingredient, method)}
    episode = KitchenEnv(rng.randrange(1000), recipes)  # dish index 0: the invented dish
    observation, info = episode.reset()
    history, right = [], f"{ingredient} the {dish}"
    if kind not in ("short", "skills") and rng.random() < 0.5:  # the second step (reading: first only)
        history = [(observation, right)]
        observation, _, _, info = episode.step(right)
        right = f"{method} the {dish}"
    recipe = "- " + kitchen_note(dish, ingredient)
    if kind == "short":
        message = recipe + "\n\nAdmissible actions: " + ", ".join(f"'{a}'" for a in info["admissible"])
    else:
        skills = f"Skills for this task:\n- {KITCHEN_SKILLS['general'][0]}\n{recipe}" if kind == "skills" else ""
        message = user_message("kitchen", info["task"], len(history), history, observation, info["admissible"],
                               skills)
    return message, WARM_START_ANSWER.format(right)


WARM_START_KINDS = ("short", "skills", "known", "unknown")
WARM_START_BATCH, WARM_START_LR = 32, 3e-3  # examples per AdamW step, its learning rate


def warm_start(model, tokenizer, steps: int, seed: int, prompts: PromptFormat, answer_logprobs: Callable,
               batch: int = WARM_START_BATCH, lr: float = WARM_START_LR) -> dict:
    """Behaviour cloning of `steps` AdamW steps on warm_start_example answers (token mean of
    -log p over the answer tokens; answer_logprobs(model, prompt ids, answer ids): retireopd.py's
    sequence_logprobs). Deterministic per seed. Returns the first and last losses."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for step in tqdm(range(steps), desc="warm start", leave=False, disable=not sys.stderr.isatty()):
            examples = [warm_start_example(rng, rng.choice(WARM_START_KINDS), prompts.user_message)
                        for _ in range(batch)]
            prompt_ids = [prompts.encode(tokenizer, message) for message, _ in examples]
            answers = [tokenizer(answer + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
                       for _, answer in examples]
            loss = -answer_logprobs(model, prompt_ids, answers).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(float(loss.detach()))
    return {"steps": steps, "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None}


def warm_start_key(steps: int, seed: int, tokenizer, prompts: PromptFormat) -> dict:
    """What a warm-started base model depends on, to tell whether a saved one (the shipped tiny_base/)
    is what warm_start would build here: its steps and seed, the shape, AdamW's batch and learning
    rate, the tokenizer, the examples of its first two steps (their token ids: the warm start's code
    and the prompt format), and the releases of torch and transformers."""
    rng, ids = random.Random(seed), []
    for _ in range(2 * WARM_START_BATCH):
        message, answer = warm_start_example(rng, rng.choice(WARM_START_KINDS), prompts.user_message)
        ids.append([prompts.encode(tokenizer, message), tokenizer(answer, add_special_tokens=False)["input_ids"]])
    fingerprint = lambda text: hashlib.sha256(text.encode()).hexdigest()[:16]  # noqa: E731
    return {"steps": steps, "seed": seed, "shape": TINY_SHAPE, "batch": WARM_START_BATCH, "lr": WARM_START_LR,
            "tokenizer": fingerprint(tokenizer.backend_tokenizer.to_str()), "examples": fingerprint(json.dumps(ids)),
            "torch": torch.__version__.split("+")[0], "transformers": transformers.__version__}


def build_tiny_tokenizer(prompts: PromptFormat, vocab_size: int = 1024):
    """A Qwen2 tokenizer (byte-level BPE, Qwen's pre-tokenizer, ChatML) with a vocabulary trained
    in code on our own prompt text: deterministic, no download, and it saves and reloads as the
    same Qwen2Tokenizer. Byte-level: any text round-trips, CJK included.
    """
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
    corpus = [*prompts.texts, "<think></think><action></action> search[ click[ ] [SEP]"]
    for notes in prompts.skills.values():
        corpus += [rule for rules in notes.values() for rule in rules]
    rng = random.Random(0)  # kitchen prompts and answers, so that their words are single tokens
    corpus += [text for _ in range(60) for text in warm_start_example(rng, "skills", prompts.user_message)]
    corpus += 20 * [f"cook a {dish}" for dish in KITCHEN_RECIPES] + 20 * ["<|im_start|>user\n", "assistant"]
    corpus += 20 * [": " + ", ".join(word.capitalize() for word in KITCHEN_INGREDIENTS + KITCHEN_METHODS)]
    corpus += ["The pot holds salt. The grue is ruined. The dorl is ready! Nothing happens."]
    corpus += ["You arrive at countertop 1. On the countertop 1, you see a apple 1, a mug 2.",
               "Nothing happens. go to take from move to open close clean heat cool use examine "
               "inventory look Your task is to: put a clean cloth in cabinet.",
               "Back to Search Next > < Prev Buy Now Description Features Reviews Attributes "
               "Instruction: i need a pack of 2 navy blue x-large shirts, and price lower than 40.00 dollars"]
    trainer_model = Tokenizer(models.BPE())
    trainer_model.normalizer = normalizers.NFC()  # the same pipeline as Qwen2Tokenizer's
    trainer_model.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    trainer_model.train_from_iterator(corpus * 4, trainer)
    learned = json.loads(trainer_model.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tokenizer = transformers.Qwen2Tokenizer(vocab=learned["vocab"], merges=merges, eos_token="<|im_end|>",
                                            pad_token="<|endoftext|>", unk_token=None)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_model(name: str, dtype: torch.dtype, seed: int, tokenizer):
    """A model built in code: `tiny` (TINY_SHAPE) or `random:<alias>` (the alias's shape, QWEN25_SHAPES),
    random weights from `seed`, for `tokenizer` (build_tiny_tokenizer's)."""
    shape = TINY_SHAPE if name == "tiny" else QWEN25_SHAPES[name.split(":", 1)[1]]
    shape = {"vocab_size": len(tokenizer), **shape}
    config = transformers.Qwen2Config(max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                                      bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id, **shape)
    with torch.random.fork_rng(devices=[]):  # same seed -> same weights; the global RNG is untouched
        torch.manual_seed(seed)
        return transformers.Qwen2ForCausalLM(config).to(dtype)


# ==================================================================================================
# The presets: what --model tiny runs, unless a flag says otherwise
# ==================================================================================================
# `python retireopd.py --model tiny` must run teacher -> student -> retirement -> GRPO in minutes on
# a laptop CPU. These values replace the protocol defaults for the tiny model, unless a flag is given.
# On ALFWorld's fixture games and the built-in WebShop catalogue the tiny model only runs the code
# paths: small and quick, no warm start (it knows only the kitchen), and since it never wins (S_T =
# 0) the teacher retires on a fixed schedule halfway through phase 2, unless --teacher-success or
# --retire-at is given (retire_halfway).
TINY_PRESET_ELSEWHERE = dict(warm_start=0, teacher_iterations=None, iterations=10, batch_tasks=2, group_size=4,
                             max_response_tokens=32, eval_episodes=4, lr=1e-4, lr_warmup_steps=0)


def retire_halfway(iterations: int, algo: str, teacher_success) -> Optional[int]:
    """--retire-at of the tiny model outside the kitchen (unless given): halfway through phase 2, for the
    method without --teacher-success (S_T would be 0 there); None otherwise."""
    return max(1, iterations // 2) if algo == "retireopd" and teacher_success is None else None


TINY_PRESET = dict(
    env="kitchen", alfworld_data="fixtures", warm_start=500, teacher_iterations=24, iterations=50, batch_tasks=8,
    group_size=8, max_turns=4, max_response_tokens=24, max_prompt_tokens=4096, mini_batch=32, opd_mini_batch=32,
    window=2, eval_every=2, lr=5e-4, lr_warmup_steps=10, entropy_coef=0.01, kl_coef=0.3, opd_coef=3.0,
    eval_batch=64,
)
