"""The docs cannot drift from the code: README.md and every docs/*.md, read against the code they describe.

Five checks, each failing with the file:line of every offending mention:
1. every `--flag` the docs quote exists: a Config field's flag, one of retireopd.py's own actions, a flag of
   bench.py or study.py, or a flag of another tool in OTHER_TOOLS; in a command (a bash block, or a code span
   that starts with `python X.py` or `torchrun`), the flag must be one of that very program's; and every command
   of the labs (labs.md, labs-key.md) parses as its script's, a script there is, from the shipped teachers;
2. every default the docs state for a flag, in each phrasing they use (DEFAULT_PHRASINGS: "`--window` (5; the
   demo: 2)", "`[default: 5; tiny: 2]`", "256 by default", "`--loss-agg exact`, the default", "0.4
   (`--eval-temperature`)", ...), is the Config default, and the demo's value is tiny.TINY_PRESET's; a
   `--flag VALUE` shown in passing is the default, the tiny value, one of the choices its --help lists, or
   one of the other values the docs show on purpose (ALTERNATIVE_VALUES);
3. every name in backticks that is used as code (`teacher_student_gap`, `Retirement.blocks`, `engine.generate`,
   `R.main`, `build_user_message(..., skill_block=...)`) exists in the project's modules (every *.py here but
   the tests), with the keyword arguments it is shown with; so do the names a lab's Python uses (`R.SKILLS`),
   the functions in the README's algorithm, and every test the docs name (docs/tests.md);
4. the glossary states a value for each symbol that has a flag (B, G, H, W, ρ, λ, ε, c, the threshold, R_i,
   the malformed penalty), and every value any doc gives a symbol (`W = 5`, `λ = 0.01`, `R_i = 10`,
   `0.01·KL_k3`, "lr 1e-6", "every 5 iterations") is its flag's default or tiny value (or a listed
   alternative: SYMBOL_ALTERNATIVES, NAMED_VALUES);
5. every table of the study (its per-seed table, its claims) is what study.py prints from the study the docs
   report, docs/study.json (study.py's own record of it), line for line.

Fast: the code is read with `ast` and the parsers are built in-process; nothing runs a model.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import io
import itertools
import re
import shlex
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# ------------------------------------------------------------------------------------------------------------
# What the docs are allowed to name besides the project's own code: each entry says where it comes from.
# ------------------------------------------------------------------------------------------------------------
OTHER_TOOLS = {  # flags of programs other than ours, by program
    "torchrun": {"--nproc_per_node", "--standalone", "--shutdown-timeout"},
    "pytest": {"--collect-only"},
    "tensorboard": {"--logdir"},
    "pip": {"--index-url"},  # the CPU wheel of torch on Linux (README)
}
# Values the docs give a flag in passing that are neither its default, nor the tiny preset's, nor one of the
# choices its --help lists (`retireopd | grpo | ...`): an alternative, an error case, an example, on purpose.
# A value stated as *the default* is never looked up here (it must be the default).
ALTERNATIVE_VALUES = {
    "--eval-batch": {"128"},  # the smaller validation batch, for an 80 GB GPU
    "--prefill-batch": {"0"},  # every prompt in one forward
    "--save-every": {"0"},  # checkpoints only at phase ends and retirement
    "--kl-coef": {"0"},  # no reference model (troubleshooting)
    "--frozen-dtype": {"bfloat16"},  # the authors' precision, half the memory
    "--micro-batch-rows": {"32"},  # the authors' phase-1 ALFWorld micro-batch
    "--warm-start": {"300"},  # an example of a change that rebuilds the tiny base
    "--max-turns": {"0"},  # refused in one line
    "--run-dir": {"."},  # a refused folder
}
# Names in backticks that look like code but are not the project's: the authors' code and verl, the libraries
# we use, the environments' own code, placeholders. A name is looked up here only when the project does not
# define it and it appears nowhere in the project's code as a string (a log key, a JSON field, a task type).
EXTERNAL_NAMES = {
    # the authors' SDAR / verl / verl-agent code, which the README compares with ours
    "compute_sdl_loss", "compute_policy_loss", "adjust_batch", "balance_batch", "low_var_kl",
    # PyTorch and transformers, named where the docs say what the code calls
    "fully_shard", "register_fsdp_forward_method", "scaled_dot_product_attention", "apply_rotary_pos_emb",
    "encode_batch", "from_pretrained",
    # ALFWorld / TextWorld, and the original WebShop's code
    "PddlEnv", "AlfredDemangler", "AlfredInfos", "AlfredTWEnv", "goal_options",
    # the standard library's getrusage field, whose unit differs by platform (running.md)
    "ru_maxrss",
    # a placeholder: "Setting `R.X` for a name that lives in another module changes nothing"
    "R.X",
}


# ------------------------------------------------------------------------------------------------------------
# Reading the docs
# ------------------------------------------------------------------------------------------------------------
class Unit(NamedTuple):
    """A piece of a doc: a prose paragraph (its lines joined), one table row, or a fenced block."""
    path: Path
    kind: str  # "prose", "table" or "code"
    lang: str  # the fence's language ("" for prose, tables and bare fences)
    text: str
    first_line: int

    def line(self, offset: int) -> int:
        return self.first_line + self.text.count("\n", 0, offset)

    def where(self, offset: int = 0) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line(offset)}"

    def flat(self) -> str:
        """The text as one line: a line break and the next line's indentation are one space, as in markdown."""
        return re.sub(r"\n[ \t]*", " ", self.text)

    def flat_where(self, offset: int) -> str:
        """where() of an offset into flat()."""
        line, removed = self.first_line, 0
        for match in re.finditer(r"\n[ \t]*", self.text):
            if match.start() - removed >= offset:
                break
            line, removed = line + 1, removed + len(match.group(0)) - 1
        return f"{self.path.relative_to(ROOT)}:{line}"


@lru_cache(maxsize=None)
def units() -> tuple:
    out = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        n = 0
        while n < len(lines):
            line = lines[n]
            if line.startswith("```"):
                end = next((m for m in range(n + 1, len(lines)) if lines[m].startswith("```")), len(lines))
                out.append(Unit(path, "code", line[3:].strip(), "\n".join(lines[n + 1:end]), n + 2))
                n = end + 1
            elif line.startswith("|"):
                out.append(Unit(path, "table", "", line, n + 1))
                n += 1
            elif line.strip():
                end = n
                while end < len(lines) and lines[end].strip() and not lines[end].startswith(("```", "|")):
                    end += 1
                out.append(Unit(path, "prose", "", "\n".join(lines[n:end]), n + 1))
                n = end
            else:
                n += 1
    return tuple(out)


SPAN = re.compile(r"`([^`]+)`")


def spans():
    """(unit, offset, text) of every inline code span of the prose and the tables."""
    for unit in units():
        if unit.kind != "code":
            for match in SPAN.finditer(unit.text):
                yield unit, match.start(), match.group(1).replace("\n", " ")


# ------------------------------------------------------------------------------------------------------------
# Reading the code
# ------------------------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def project():
    import retireopd
    import tiny
    return retireopd, tiny


def parser_options(parser: argparse.ArgumentParser) -> set:
    return {option for action in parser._actions for option in action.option_strings if option.startswith("--")}


class _Parsed(Exception):
    pass


@lru_cache(maxsize=None)
def script_parser(module_name: str) -> argparse.ArgumentParser:
    """The argparse parser a script's main() builds, caught at parse_args (bench.py and study.py build theirs
    inside main(); they run nothing before it)."""
    import importlib
    module = importlib.import_module(module_name)
    caught = {}

    def catch(self, *args, **kwargs):
        caught["parser"] = self
        raise _Parsed

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = catch
    try:
        with contextlib.redirect_stdout(io.StringIO()), pytest.raises(_Parsed):
            module.main([])
    finally:
        argparse.ArgumentParser.parse_args = original
    return caught["parser"]


@lru_cache(maxsize=None)
def flags_of() -> dict:
    """program -> its long flags."""
    R, _ = project()
    retireopd = parser_options(R.build_parser())
    config_flags = parser_options(R.build_parser(actions=False))
    return {"retireopd.py": retireopd, "config": config_flags, "bench.py": parser_options(script_parser("bench")),
            "study.py": parser_options(script_parser("study")), **OTHER_TOOLS}


@lru_cache(maxsize=None)
def fields() -> dict:
    """--flag -> its Config field."""
    R, _ = project()
    return {"--" + f.name.replace("_", "-"): f for f in dataclasses.fields(R.Config)}


def test_every_config_field_has_its_flag_and_help_lists_it():
    R, _ = project()
    help_text = R.build_parser().format_help()
    missing = [flag for flag in fields() if flag not in help_text]
    assert not missing, f"--help does not list {missing}"
    assert {"--resume", "--plot", "--compare", "--show-prompts"} <= flags_of()["retireopd.py"]
    assert {"--seeds", "--teachers", "--variants", "--out"} <= flags_of()["study.py"]
    assert "--versus-plain" in flags_of()["bench.py"]


# ------------------------------------------------------------------------------------------------------------
# 1. Every --flag exists, and in a command it is that program's
# ------------------------------------------------------------------------------------------------------------
FLAG = re.compile(r"(?<![\w-])--[a-zA-Z][\w-]*")


def commands():
    """(unit, offset, words) of every command the docs show: a bash block's lines (continuations joined, its
    heredocs' bodies left out) and the code spans that start with a program."""
    for unit in units():
        if unit.kind == "code" and unit.lang in ("bash", "sh", "console"):
            offset, heredoc = 0, None
            logical, start = "", 0
            for raw in unit.text.split("\n"):
                here = offset
                offset += len(raw) + 1
                if heredoc is not None:
                    heredoc = None if raw.strip() == heredoc else heredoc
                    continue
                if not logical:
                    start = here
                logical += raw.rstrip("\\") + " "
                if raw.rstrip().endswith("\\"):
                    continue
                if match := re.search(r"<<\s*'?(\w+)'?", logical):
                    heredoc = match.group(1)
                yield from split_command(unit, start, logical)
                logical = ""
        elif unit.kind != "code":
            for match in SPAN.finditer(unit.text):
                text = match.group(1).replace("\n", " ")
                if re.match(r"(?:[A-Z_]+=\S+ )*(?:python|torchrun|pip|tensorboard|pytest) ", text):
                    yield from split_command(unit, match.start(), text)


def split_command(unit, offset, line):
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # an unclosed quote in prose: split on spaces
        words = line.split("#")[0].split()
    command = []
    for word in words + [";"]:
        if word in ("&&", "||", "|", ";"):
            if command:
                yield unit, offset, command
            command = []
        else:
            command.append(word)


def program_flags(words: list) -> list:
    """[(program, flag)] of one command: which program each --flag goes to."""
    words = [w for w in words if not re.fullmatch(r"[A-Z_]+=\S*", w)]  # VAR=value before the program
    if not words:
        return []
    head = words[0]
    out = []
    if head in ("python", "python3"):
        if len(words) > 2 and words[1] == "-m":
            module = words[2]
            script = next((n for n, w in enumerate(words) if w.endswith(".py")), None)
            if module == "pytest" or script is None:
                return [(module, w) for w in words[3:] if FLAG.fullmatch(w.split("=")[0])]
            words = words[script:]  # python -m cProfile ... retireopd.py --flags: the script's
        else:
            words = words[1:]
        head = words[0]
    elif head == "torchrun":
        script = next((n for n, w in enumerate(words) if w.endswith(".py")), len(words))
        out += [("torchrun", w.split("=")[0]) for w in words[1:script] if FLAG.fullmatch(w.split("=")[0])]
        if script == len(words):  # torchrun's own flags alone (`torchrun --shutdown-timeout S`)
            return out
        words, head = words[script:], words[script]
    program = Path(head).name
    after_separator = False
    for word in words[1:]:
        if word == "--":  # study.py: every flag after it goes to each run's retireopd.py
            after_separator = True
            continue
        flag = word.split("=")[0]
        if FLAG.fullmatch(flag):
            out.append(("config" if program == "study.py" and after_separator else program, flag))
    return out


def test_every_flag_in_a_command_is_its_programs():
    known = flags_of()
    wrong, seen = [], 0
    for unit, offset, words in commands():
        for program, flag in program_flags(words):
            seen += 1
            if flag not in known.get(program, set()):
                wrong.append(f"{unit.where(offset)}: {flag} is not a flag of {program} (in: {' '.join(words)})")
    assert seen > 50, f"only {seen} flags found in the docs' commands: is the parser still reading them?"
    assert not wrong, "flags that the program they are given to does not have:\n" + "\n".join(wrong)


def test_every_flag_the_docs_name_exists():
    known = set().union(*flags_of().values())
    wrong = []
    for unit in units():
        for match in FLAG.finditer(unit.text):
            if match.group(0) not in known:
                wrong.append(f"{unit.where(match.start())}: {match.group(0)}")
    assert not wrong, ("flags no program has (a Config field's flag, retireopd.py's, bench.py's, study.py's, or "
                       "OTHER_TOOLS):\n" + "\n".join(wrong))


# ------------------------------------------------------------------------------------------------------------
# 2. and 4. Every default, tiny value and symbol value the docs state is the code's
# ------------------------------------------------------------------------------------------------------------
NUMBER = r"[-+]?\d+(?:,\d{3})*(?:\.\d+)?(?:e[-+]?\d+)?"
FLAG_NAME = r"--[a-z][a-z0-9-]*"


class Claim(NamedTuple):
    where: str
    flag: str  # the flag whose value is stated
    value: str
    kind: str  # "default": the Config default; "tiny": the tiny preset's; "any": default, tiny or an alternative
    text: str  # what the doc says, for the message


# Phrasings that state a flag's default (or the demo's value), as they occur in the docs; each regex names its
# groups: flag, value (the default), tiny (the demo's, optional).
DEFAULT_PHRASINGS = [
    # `--window` (5; the demo: 2), `--clip-eps` (ε = 0.2), `--keep-checkpoints` (default 2, ...),
    # **... as `--eval-batch` allows** (256)
    rf"`(?P<flag>{FLAG_NAME})`(?: \w+)?\**\s*\((?:default )?(?:\S{{1,2}} = )?(?P<value>{NUMBER})"
    rf"(?:; (?:the demo|tiny): (?P<tiny>{NUMBER}))?[),;]",
    # `--eval-batch` (the episodes of a validation batch, 256 by default; ...)
    rf"`(?P<flag>{FLAG_NAME})`[^`]{{0,60}}?(?<![\w.])(?P<value>{NUMBER}) by default",
    # `--run-dir`, default `runs/...`; `--report-to tensorboard` or `wandb`, default `none`;
    # `--sampler static`** (behind the flag; the default stays `eager`); `--eval-batch 128` (the default 256 adds
    rf"`(?P<flag>{FLAG_NAME})(?: [^`]*)?`(?:[^`.]|`[^`-][^`]*`){{0,60}}?\bdefault(?: stays| is)?:? "
    rf"(?:`(?P<value>[^`]+)`|(?P<number>{NUMBER})(?![\w.]))",
    # (`--webshop-reward`): `faithful` (default)
    rf"`(?P<flag>{FLAG_NAME})`[^`]{{0,5}}`(?P<value>[^`]+)` \(default\)",
    # `--loss-agg exact`, the default; `--sampler eager` stays the default
    rf"`(?P<flag>{FLAG_NAME}) (?P<value>[^`\s]+)`(?:,| stays| is)? \(?the default(?=[:,.;)])",
    # (`--window`: `[default: 5; tiny: 2]`), as --help prints it
    rf"`(?P<flag>{FLAG_NAME})`[^`]{{0,10}}`\[default: (?P<value>[^;\]]+)(?:; tiny: (?P<tiny>[^\]]+))?\]`",
    # with the default `--eval-batch 256`
    rf"\bdefault `(?P<flag>{FLAG_NAME}) (?P<value>[^`\s]+)`",
    # temperature 0.4 (`--eval-temperature`): a number, then the flag it is the value of (not "phase 2 (...)")
    rf"(?<!phase )(?<!lab )(?<![\w.])(?P<value>{NUMBER}) \(`(?P<flag>{FLAG_NAME})`\)",
]
# A symbol's value, wherever a doc gives it: B = 16, `W = 2`, λ = 0.01, B·G = 128 (ε is left out: it is also
# GRPO's 1e-6, which has no flag).
SYMBOLS = {"B": "--batch-tasks", "G": "--group-size", "H": "--history", "W": "--window", "ρ": "--rho",
           "λ": "--opd-coef", "T": "--eval-temperature"}  # (T = 0.4: a validation's temperature)
SYMBOL_ALTERNATIVES = {"λ": {"0", "10"},  # 0 once retired; 10: the tiny model's earlier shape (choices.md)
                       "ρ": {"1.0", "0.5"}, "W": {"4"}}  # the knobs of lab 5
# The same for the formulas' numbers and the protocol's words: (regex with a value group, flag, alternatives).
NAMED_VALUES = [
    (rf"R_i`?\s?=\s?(?:`--success-reward`\s?=\s?)?`?(?P<value>{NUMBER})", "--success-reward", set()),
    (rf"R_i`?\s?[−-]\s?(?P<value>{NUMBER})", "--malformed-penalty", set()),
    (rf"(?P<value>{NUMBER}) if it was won", "--success-reward", set()),  # the glossary's R_i
    (rf"(?P<value>{NUMBER})·KL", "--kl-coef", set()),
    (rf"(?P<value>{NUMBER})·H\(π\)", "--entropy-coef", set()),
    (rf"\blr (?P<value>{NUMBER})", "--lr", {"1e-3", "0"}),  # choices.md: probes of the tiny model, SGD at lr 0
    (rf"(?P<value>{NUMBER}) iterations per phase", "--iterations", set()),
    (rf"weight decay (?P<value>{NUMBER})", "--weight-decay", set()),
    (rf"grad(?:ient)? clip (?P<value>{NUMBER})", "--grad-clip", set()),
    (rf"dual clip (?P<value>{NUMBER})", "--dual-clip", set()),
    (rf"(?<!dual )(?<!grad )\bclip (?P<value>{NUMBER})", "--clip-eps", set()),
    (rf"\bentropy (?:bonus of )?(?P<value>{NUMBER})", "--entropy-coef", set()),
    (rf"(?P<value>{NUMBER}) epochs?\b", "--ppo-epochs", set()),
    (rf"every (?P<value>{NUMBER}) iterations", "--eval-every", set()),
    (rf"(?P<value>{NUMBER}) teacher iterations", "--teacher-iterations", set()),
    (rf"(?P<value>{NUMBER}) student iterations", "--iterations", set()),
    (rf"(?P<value>{NUMBER}) warm-up steps", "--lr-warmup-steps", set()),
    (rf"(?P<value>{NUMBER})-token answers", "--max-response-tokens", set()),
]


def default_claims():
    for unit in units():
        if unit.kind == "code":
            continue
        text = unit.flat()
        for phrasing in DEFAULT_PHRASINGS:
            for match in re.finditer(phrasing, text):
                groups = match.groupdict()
                value = groups["value"] if groups["value"] is not None else groups.get("number")
                where = unit.flat_where(match.start())
                if value not in ("X", None):  # (`[default: X; tiny: Y]`: how --help writes it, not a value)
                    yield Claim(where, groups["flag"], value.strip(), "default", match.group(0))
                if groups.get("tiny"):
                    yield Claim(where, groups["flag"], groups["tiny"].strip(), "tiny", match.group(0))
        # "... The default is 0": the default of the last flag the paragraph named before it
        for match in re.finditer(rf"\b[Tt]he default is (?:`(?P<value>[^`]+)`|(?P<number>{NUMBER})(?![\w.]))", text):
            named = re.findall(rf"`({FLAG_NAME})[ `]", text[:match.start()])
            if named:
                value = match.group("value") or match.group("number")
                yield Claim(unit.flat_where(match.start()), named[-1], value, "default", match.group(0))
        if unit.kind == "table":  # a cell that is a value and its flag: | 256 ALFWorld / 64 WebShop (`--mini-batch`) |
            for cell in re.finditer(rf"\| (?P<value>[^|`(]*?) \(`(?P<flag>{FLAG_NAME})`\)(?= \|)", text):
                for number in re.finditer(NUMBER, cell.group("value")):
                    yield Claim(unit.flat_where(cell.start()), cell.group("flag"), number.group(0), "default",
                                cell.group(0).strip("| "))


def passing_values():
    """`--flag VALUE` spans of prose and tables that state no default: the value is shown in passing."""
    stated = {(c.where, c.flag, c.value) for c in default_claims()}
    for unit, offset, text in spans():
        match = re.fullmatch(rf"({FLAG_NAME}) (\S+)", text)
        if not match or re.search(r"\b[A-Z][A-Z_]*\b|…|\.\.\.", match.group(2)):  # placeholders: N, RUN_DIR, S
            continue
        claim = Claim(unit.where(offset), match.group(1), match.group(2), "any", f"`{text}`")
        if (claim.where, claim.flag, claim.value) not in stated:
            yield claim


def symbol_claims():
    for unit in units():
        if unit.kind == "code" and unit.lang in ("bash", "sh"):
            continue
        text = unit.flat()
        symbol_value = rf"(?<![\w^{{·])(?P<sym>B·G|[BGHTWρλ])`?\s?=\s?(?P<value>{NUMBER})(?![\w.])"
        for match in re.finditer(symbol_value, text):
            symbol = match.group("sym")
            if symbol == "B·G":
                yield Claim(unit.flat_where(match.start()), "B·G", match.group("value"), "product", match.group(0))
            else:
                yield Claim(unit.flat_where(match.start()), SYMBOLS[symbol], match.group("value"),
                            "symbol:" + symbol, match.group(0))
        for pattern, flag, _ in NAMED_VALUES:
            for match in re.finditer(pattern, text):
                yield Claim(unit.flat_where(match.start()), flag, match.group("value"), "named:" + pattern,
                            match.group(0))


def placeholders(text: str) -> str:
    """`runs/<env>-<algo>-<time>` and `runs/ENV-ALGO-TIME` are the same value: placeholders in capitals."""
    return re.sub(r"<(\w+)>", lambda m: m.group(1).upper(), text)


def same(text: str, value) -> bool:
    text = text.strip("`").replace(",", "")
    if isinstance(value, bool):
        return text.lower() == str(value).lower()
    if isinstance(value, (int, float)):
        try:
            return float(text) == float(value)
        except ValueError:
            return False
    return text == str(value)


def is_default(flag: str, value: str) -> bool:
    """The Config default; for a field whose default is None (resolved per benchmark), a value its --help names."""
    field = fields()[flag]
    if field.default is None:
        return re.search(rf"(?<![\w.]){re.escape(placeholders(value))}(?![\w])",
                         placeholders(field.metadata["help"])) is not None
    return same(value, field.default)


def is_tiny(flag: str, value: str) -> bool:
    _, tiny = project()
    name = fields()[flag].name
    presets = (tiny.TINY_PRESET, tiny.TINY_PRESET_ELSEWHERE)  # (the kitchen's, and elsewhere's changes to it)
    return any(name in preset and same(value, preset[name]) for preset in presets)


def choices(flag: str) -> set:
    """The values a flag's --help lists as its choices: `none | tensorboard (...) | wandb: ...`."""
    help_text = fields()[flag].metadata["help"]
    return {part.split()[0].rstrip(":,") for part in help_text.split("|")} if "|" in help_text else set()


def describe(flag: str) -> str:
    _, tiny = project()
    field = fields()[flag]
    tiny_value = tiny.TINY_PRESET.get(field.name, "unchanged")
    return f"Config.{field.name} = {field.default!r}, tiny.TINY_PRESET: {tiny_value!r}"


def test_every_default_the_docs_state_is_the_codes():
    wrong, found = [], []
    for claim in default_claims():
        found.append(claim)
        if claim.flag not in fields():
            wrong.append(f"{claim.where}: {claim.text!r} states a default of {claim.flag}, which is no Config field")
        elif claim.kind == "default" and not is_default(claim.flag, claim.value):
            wrong.append(f"{claim.where}: {claim.text!r} says the default of {claim.flag} is {claim.value}; "
                         f"the code: {describe(claim.flag)}")
        elif claim.kind == "tiny" and not is_tiny(claim.flag, claim.value):
            wrong.append(f"{claim.where}: {claim.text!r} says the demo's {claim.flag} is {claim.value}; "
                         f"the code: {describe(claim.flag)}")
    # the phrasings must still be found where they are known to be, or this test checks nothing
    found_in = {(c.where.split(":")[0], c.flag) for c in found}
    for expected in [("docs/glossary.md", "--window"), ("docs/glossary.md", "--opd-coef"),
                     ("docs/running.md", "--window"), ("docs/running.md", "--keep-checkpoints"),
                     ("docs/running.md", "--eval-temperature")]:
        assert expected in found_in, f"no stated default of {expected[1]} found in {expected[0]}: a phrasing changed?"
    assert not wrong, "stated defaults that are not the code's:\n" + "\n".join(wrong)


def test_every_value_shown_in_passing_is_the_default_the_tiny_value_or_a_known_alternative():
    wrong = []
    for claim in passing_values():
        if claim.flag not in fields():
            continue  # --resume "", --seeds 0 of study.py...: not a Config field (its values are checked by nothing)
        if not (is_default(claim.flag, claim.value) or is_tiny(claim.flag, claim.value)
                or claim.value in choices(claim.flag) or claim.value in ALTERNATIVE_VALUES.get(claim.flag, ())):
            wrong.append(f"{claim.where}: {claim.text} is neither the default nor the tiny preset's value "
                         f"({describe(claim.flag)}): if it states the default, correct the doc; if the doc shows "
                         "another value on purpose, add it to ALTERNATIVE_VALUES")
    assert not wrong, "\n".join(wrong)


def test_every_value_a_doc_gives_a_symbol_is_its_flags():
    wrong = []
    for claim in symbol_claims():
        if claim.kind == "product":  # B·G: the rollout's episodes per iteration
            _, tiny = project()
            default = fields()["--batch-tasks"].default * fields()["--group-size"].default
            demo = tiny.TINY_PRESET["batch_tasks"] * tiny.TINY_PRESET["group_size"]
            if not (same(claim.value, default) or same(claim.value, demo)):
                wrong.append(f"{claim.where}: {claim.text!r}: B·G is {default} (tiny: {demo})")
            continue
        alternatives = (SYMBOL_ALTERNATIVES.get(claim.kind.split(":")[1], set()) if claim.kind.startswith("symbol")
                        else next(alt for pattern, _, alt in NAMED_VALUES if claim.kind == "named:" + pattern))
        if not (is_default(claim.flag, claim.value) or is_tiny(claim.flag, claim.value)
                or claim.value in alternatives):
            wrong.append(f"{claim.where}: {claim.text!r} gives {claim.flag} the value {claim.value}: "
                         f"{describe(claim.flag)}")
    assert not wrong, "symbol values that are not their flag's:\n" + "\n".join(wrong)


def test_the_glossary_states_each_symbols_value_and_it_is_the_codes():
    glossary = ROOT / "docs" / "glossary.md"
    rows = {}
    for unit in units():
        if unit.path == glossary and unit.kind == "table":
            cells = [cell.strip() for cell in unit.text.strip("|").split("|")]
            if len(cells) == 3:
                rows[cells[0]] = (unit, cells[2])
    claims = {}
    for claim in [*default_claims(), *symbol_claims()]:  # (checked against the code by the tests above)
        if claim.where.startswith("docs/glossary.md"):
            claims.setdefault(claim.flag, []).append(claim)
    wrong = []
    for symbol, flag in [("B", "--batch-tasks"), ("G", "--group-size"), ("H", "--history"), ("W", "--window"),
                         ("ρ", "--rho"), ("λ", "--opd-coef"), ("threshold", "--alignment-threshold"),
                         ("L_PPO", "--clip-eps"), ("L_PPO", "--dual-clip"), ("R_i", "--success-reward"),
                         ("r_{i,t}", "--malformed-penalty")]:
        if symbol not in rows or flag not in rows[symbol][1]:
            wrong.append(f"docs/glossary.md: the row of {symbol} does not name {flag}")
        elif not any(c.where == rows[symbol][0].where() for c in claims.get(flag, [])):
            wrong.append(f"{rows[symbol][0].where()}: the row of {symbol} states no value for {flag} "
                         "(write it as `--flag` (default) or `--flag` (default; the demo: tiny))")
    for flag in ("--window", "--opd-coef"):  # the two the demo changes: the glossary says so
        if not any(c.kind == "tiny" for c in claims.get(flag, [])):
            wrong.append(f"docs/glossary.md: the tiny preset changes {flag}, and the glossary does not say to what")
    assert not wrong, "\n".join(wrong)


# ------------------------------------------------------------------------------------------------------------
# 3. Every name used as code exists
# ------------------------------------------------------------------------------------------------------------
class Code(NamedTuple):
    modules: dict  # module name -> {top-level name: its ast node (None for an imported name)}
    classes: dict  # class name -> {member names: methods, class fields, self.X attributes}
    signatures: dict  # function or class name -> its parameter names (a class: __init__'s, or its fields)
    names: set  # every parameter and assigned name in the code (locals: `old_logp` in `ppo_update`)
    strings: set  # every string constant that is a name: log keys, JSON fields, task types, variables


@lru_cache(maxsize=None)
def code() -> Code:
    modules, classes, signatures, names, strings = {}, {}, {}, set(), set()
    for path in sorted(ROOT.glob("*.py")):
        if path.name.startswith("test_") or path.name == "conftest.py":
            continue
        tree = ast.parse(path.read_text())
        top = modules.setdefault(path.stem, {})
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                top[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            top[name.id] = node
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    top[(alias.asname or alias.name).split(".")[0]] = None
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                members = classes.setdefault(node.name, set())
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        members.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        members.add(item.target.id)
                    elif isinstance(item, ast.Assign):
                        members.update(t.id for t in item.targets if isinstance(t, ast.Name))
                for sub in ast.walk(node):
                    if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                            and isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                        members.add(sub.attr)
                init = next((i for i in node.body if isinstance(i, ast.FunctionDef) and i.name == "__init__"), None)
                signatures[node.name] = (parameters(init) if init else
                                         {i.target.id for i in node.body if isinstance(i, ast.AnnAssign)})
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                signatures.setdefault(node.name, parameters(node))
                names.update(parameters(node))
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                strings.add(node.value)  # a whole string that is a name: "judged_block", "valid_seen", "ALFWORLD_DATA"
    return Code(modules, classes, signatures, names, strings)


def parameters(function) -> set:
    args = function.args
    return {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs} | (
        {args.vararg.arg} if args.vararg else set()) | ({args.kwarg.arg} if args.kwarg else set())


MODULE_ALIASES = {"R": "retireopd"}  # the labs' `import retireopd as R`
NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
FILE_SUFFIX = re.compile(r"\.(py|jsonl?|md|png|txt|pt|safetensors|sh|model|ini|lock|tmp|corrupt|out|tw-pddl|ipynb)$")


def looks_like_code(name: str, called: bool) -> bool:
    """The names worth checking: a call, a dotted name, a name with an underscore, a CamelCase class name or
    a constant in capitals (`ALGORITHMS`).
    A plain lowercase word (`rollout`, `gap`, `none`) may be code or a value, and is left alone, as are math
    symbols with a subscript (`R_i`, `S_T`, `L_OPD`: one letter, an underscore, a short or capital subscript)
    and the tail of a name written as a suffix (`sample_logp_gap_mean`/`_max`)."""
    if re.fullmatch(r"[A-Za-z]_(?:\w{1,2}|[A-Z]+)", name) or name.startswith("_"):  # (`L_OPD`; `…_mean`/`_max`)
        return False
    return (called or "." in name or "_" in name or re.match(r"[A-Z][a-z]", name) is not None
            or re.fullmatch(r"[A-Z]{3,}", name) is not None)


def resolve(name: str):
    """Where the project defines `name` ("" when nowhere): a module's top-level name, a class's member, a
    parameter or variable, or a string of the code (a key or a field of the run's files)."""
    import builtins
    import math
    import sys
    c = code()
    parts = name.split(".")
    head = MODULE_ALIASES.get(parts[0], parts[0])
    if len(parts) == 1:
        if name in c.modules:
            return f"the module {name}"
        if hasattr(builtins, name) or hasattr(math, name):  # `min(500, n_goals // 4)`, `ceil(n / 256)`
            return "a builtin"
        for module, top in c.modules.items():
            if name in top and top[name] is not None:
                return f"{module}.{name}"
        if any(name in members for members in c.classes.values()):
            return "a class member"
        if name in c.names:
            return "a parameter or variable"
        if name in c.strings:
            return "a string of the code (a key or field)"
        return ""
    if head in c.modules:  # module.name[.member]
        top = c.modules[head]
        if parts[1] not in top:
            return ""
        if len(parts) == 2:
            return f"{head}.{parts[1]}"
        if parts[1] in c.classes:
            return f"{head}.{parts[1]}" if parts[2] in c.classes[parts[1]] else ""
        return module_attribute(head, parts[1:])
    if head in c.classes:  # Class.member
        return f"{head}.{parts[1]}" if parts[1] in c.classes[head] else ""
    if head in ("torch", "transformers", *sys.stdlib_module_names):  # torch.load, os._exit, random.Random
        return module_attribute(head, parts[1:])
    if head[:1].islower() and any(parts[1] in members for members in c.classes.values()):
        return "an instance's member"  # suite.validation_panel: an object of one of the project's classes
    return ""


def module_attribute(module: str, attributes: list) -> str:
    import importlib
    try:
        value = importlib.import_module(module)
        for attribute in attributes:
            value = getattr(value, attribute)
    except (ImportError, AttributeError):
        return ""
    return ".".join([module, *attributes])


def code_mentions():
    """(where, name, keyword arguments, text) of every backticked name used as code in prose and tables, the
    names called in the labs' Python, and the functions in the right column of the README's algorithm."""
    for unit, offset, text in spans():
        text = text.strip()
        try:
            tree = ast.parse(text, mode="eval").body
        except SyntaxError:
            continue
        functions = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}  # (`a` of `a.b`)
        for node in ast.walk(tree) if isinstance(tree, ast.Call) else [tree]:  # (not `a / b`: a path or a formula)
            called = isinstance(node, ast.Call)
            target = node.func if called else node
            if (not isinstance(target, (ast.Name, ast.Attribute)) or id(node) in inner
                    or (not called and id(node) in functions)):
                continue
            name = ast.unparse(target)
            if not NAME.fullmatch(name) or FILE_SUFFIX.search(name) or not looks_like_code(name, called):
                continue
            keywords = [k.arg for k in node.keywords if k.arg] if called else []
            yield unit.where(offset), name, keywords, text
    for unit in units():
        if unit.kind != "code":
            continue
        for match in re.finditer(r"<<\s*'?(\w+)'?\n(.*?)\n\1\n", unit.text + "\n", re.S):  # a lab's Python file
            tree = ast.parse(match.group(2))
            imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported:
                    yield unit.where(match.start(2)), ast.unparse(node), [], ast.unparse(node)
        if "Phase 1" in unit.text and unit.path.name == "README.md":  # the algorithm: `... step    function`
            for n, line in enumerate(unit.text.split("\n")):
                if match := re.search(r"\s{3,}([a-z_]\w+|[A-Z]\w+)$", line):
                    yield f"README.md:{unit.first_line + n}", match.group(1), [], line.strip()


@lru_cache(maxsize=None)
def names_of_tests() -> frozenset:
    return frozenset(node.name for path in ROOT.glob("test_*.py") for node in ast.parse(path.read_text()).body
                     if isinstance(node, ast.FunctionDef))


def test_every_name_the_docs_use_as_code_exists():
    wrong, checked, external = [], 0, set()
    metric_keys = set(re.findall(r"^\| `(\w+)`(?:, `(\w+)`)?", (ROOT / "docs" / "metrics.md").read_text(), re.M))
    metric_keys = {key for pair in metric_keys for key in pair if key}
    for where, name, keywords, text in code_mentions():
        if name in metric_keys:  # metrics.jsonl's keys: test_layout.py checks them against a run's log
            continue
        if name in names_of_tests():  # a test, named where it grades something
            checked += 1
            continue
        if where.startswith("docs/tests.md") and any(name in test for test in names_of_tests()):
            continue  # a `-k` word of tests.md's commands: part of the names of the tests it selects
        found = resolve(name)
        if not found:
            if name.split(".")[0] in EXTERNAL_NAMES or name in EXTERNAL_NAMES:
                external.add(name)
                continue
            wrong.append(f"{where}: `{text}` names {name}, which no module of the project defines")
            continue
        checked += 1
        function = name.split(".")[-1]
        accepted = code().signatures.get(function)
        if keywords and accepted is not None and not set(keywords) <= accepted:
            wrong.append(f"{where}: `{text}` passes {sorted(set(keywords) - accepted)} to {name}, which takes "
                         f"{sorted(accepted)}")
    assert checked > 150, f"only {checked} names checked: is the parser still reading the docs?"
    assert not wrong, "names the docs use as code that the code does not have:\n" + "\n".join(wrong)


def test_every_test_the_docs_name_exists():
    # docs/tests.md (and the labs) name tests in plain text: test_rule_pieces_hand_computed, test_x[param]
    wrong, seen = [], 0
    for unit in units():
        for match in re.finditer(r"(?<![\w/<])test_\w+(?![\w.<>*-])", unit.text):  # (not test_x.py, test_rule_*)
            seen += 1
            if match.group(0) not in names_of_tests():
                wrong.append(f"{unit.where(match.start())}: {match.group(0)}")
    assert seen > 50, f"only {seen} test names found in the docs: is the pattern still right?"
    assert not wrong, "tests the docs name that no test file defines:\n" + "\n".join(wrong)


def test_every_python_file_the_docs_name_exists():
    # a module split or renamed leaves its old name in the docs: `checks.py` (and the notebook: `course.ipynb`)
    others = {"core_algos.py": "verl's, in the authors' code", "train.py": "nanoGPT's"}
    wrong = [f"{unit.where(offset)}: {text}" for unit, offset, text in spans()
             if re.fullmatch(r"\w+\.(py|ipynb)", text) and text not in others and not (ROOT / text).is_file()]
    assert not wrong, "Python files the docs name that the project does not have:\n" + "\n".join(wrong)


def test_every_command_of_the_labs_runs_a_script_there_is_with_flags_it_takes():
    # the handout's and the key's commands, as a student copies them: the script exists (or the lab's heredoc
    # writes it just before), its flags parse (study.py's, and those after `--` each run's), its --variants are
    # study.py's, its --teachers folder holds the teachers of its seeds; and every lab starts at once: each
    # study.py command reuses the shipped teachers (--teachers teachers) or is the lab that trains its own
    import study
    R, _ = project()
    wrong, seen = [], 0
    for name in ("labs.md", "labs-key.md"):
        written = set()  # the files a heredoc of this doc writes (`cat > lab_flip.py <<'EOF'`)
        for unit, offset, words in commands():
            if unit.path.name != name or unit.kind != "code":
                continue
            where = f"{unit.where(offset)}: {' '.join(words)}"
            if words[:2] == ["cat", ">"]:
                written.add(words[2])
                continue
            if words[0] != "python" or not words[1].endswith(".py"):
                wrong.append(f"{where}: not a `python SCRIPT.py` command")
                continue
            seen += 1
            script, args = words[1], words[2:]
            if not (ROOT / script).is_file():
                wrong.append(f"{where}: no {script} in the project")
                continue
            own, runs = (args[:args.index("--")], args[args.index("--") + 1:]) if "--" in args else (args, [])
            parsers = [(script_parser("study") if script == "study.py" else R.build_parser(), own)]
            if script == "study.py":
                parsers.append((R.build_parser(actions=False), runs))
            for parser, given in parsers:
                with contextlib.redirect_stderr(io.StringIO()) as error:
                    try:
                        parsed = vars(parser.parse_args(given))
                    except SystemExit:
                        wrong.append(f"{where}: {error.getvalue().strip().splitlines()[-1]}")
                        parsed = None
                if parser is parsers[0][0] and parsed is not None and script == "study.py":
                    if parsed["script"] != str(ROOT / "retireopd.py") and parsed["script"] not in written:
                        wrong.append(f"{where}: --script {parsed['script']}: neither the project's nor a heredoc's")
                    if parsed["teachers"] is None and parsed["script"] == str(ROOT / "retireopd.py") \
                            and not parsed["build_teachers"]:
                        wrong.append(f"{where}: trains its own teachers (no --teachers teachers): the lab waits")
                    if parsed["base_from"] and not (ROOT / parsed["base_from"]).is_dir():
                        wrong.append(f"{where}: --base-from {parsed['base_from']}: no such folder")
                    for seed in parsed["seeds"] if parsed["teachers"] else []:
                        if not (ROOT / parsed["teachers"] / f"seed{seed}" / "retireopd" / "teacher").is_dir():
                            wrong.append(f"{where}: {parsed['teachers']} holds no teacher for seed {seed}")
                    assert set(parsed["variants"]) <= set(study.VARIANTS)  # (argparse's choices)
    assert seen >= 15, f"only {seen} commands found in the labs: is the parser still reading them?"
    assert not wrong, "commands of the labs that would not start as written:\n" + "\n".join(wrong)


# ------------------------------------------------------------------------------------------------------------
# 5. The study's tables: study.py's output, never a hand copy
# ------------------------------------------------------------------------------------------------------------
STUDY = ROOT / "docs" / "study.json"  # the study the docs report, as study.py recorded it (its study.json)
# A doc that keeps another study's printed table on purpose, and why.
OTHER_STUDIES = {"labs-key.md": "the first measurement's study, the one its labs' outcomes were measured against"}


def test_the_studys_tables_in_the_docs_are_what_study_py_prints_from_its_record():
    # every table with study.py's header (the per-seed table, the claims) is, line for line, what study.py's
    # format_table prints from docs/study.json: the numbers, the claims and their counts (study.claims)
    import json

    import study
    printed = study.format_table(json.loads(STUDY.read_text())["rows"])
    assert (ROOT / "docs" / "study.md").read_text() == printed + "\n", "docs/study.md is not study.py's output"
    printed = printed.splitlines()
    wrong, found = [], []
    for path in DOCS:
        if path.name in OTHER_STUDIES:
            continue
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines):
            if not line.startswith(("| seed | base+skills", "| claim | seeds")):
                continue
            table = list(itertools.takewhile(lambda text: text.startswith("|"), lines[n:]))
            expected = list(itertools.takewhile(lambda text: text.startswith("|"), printed[printed.index(line):])) \
                if line in printed else []
            found.append(path.name)
            if table != expected:
                wrong.append(f"{path.relative_to(ROOT)}:{n + 1}: " + next(
                    (f"{have!r} where study.py prints {want!r}" for have, want in zip(table, expected)
                     if have != want), f"{len(table)} lines where study.py prints {len(expected)}"))
    assert {"README.md", "running.md"} <= set(found), f"the study's tables were found only in {found}"
    assert not wrong, "tables that are not study.py's output of docs/study.json:\n" + "\n".join(wrong)
