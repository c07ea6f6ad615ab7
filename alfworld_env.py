"""ALFWorld for retireopd.py: the real alfworld/TextWorld text engine, one episode per object.

retireopd.py drives every environment through one small interface:

    obs, info = env.reset()
    obs, reward, done, info = env.step(action)    # info: task, task_type, admissible, won

Here: game discovery with alfworld's own filters, the fixed evaluation panels, `AlfWorldEnv` (one
episode on the engine), a pool of engines with memoised parsing (loading a game is the slow
part), worker processes that step games in parallel (--env-workers N), and the small fixture
games we write for the tests and the offline runs. None of it is part of the method: the training
loop only reads `info["won"]` and the admissible commands.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import multiprocessing
import os
import sys
import weakref
import warnings
from collections import OrderedDict, defaultdict
from pathlib import Path

# ----- ALFWorld through the real alfworld/TextWorld text engine ------------------------------------
# One `AlfWorldEnv` is one episode slot. It drives TextWorld's `PddlEnv` wrapped in alfworld's
# `AlfredDemangler(shuffle=False)` (object names such as "apple 1") and `AlfredInfos`, the same
# stack alfworld's `AlfredTWEnv` uses for its evaluation splits, but in-process and one game per
# object, so the training loop can step B*G episodes in lock-step.

ALFWORLD_TASK_TYPES = (  # alfworld's TASK_TYPES 1..6, in that order
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
# The skills of ALFWorld: short strategy notes per task type, written by us (the privileged information of
# self-OPD). Only the teacher sees them: in phase 1 while it trains, in phase 2 when it scores the student's
# tokens (retireopd.py, skill_text).
ALFWORLD_SKILLS = {
    "general": [
        "Read the task sentence first: note the object, any required treatment (clean, heat, cool, "
        "look under a lamp) and the target receptacle.",
        "Only use commands from the admissible list, copied exactly, including the object numbers.",
        "Search systematically: visit each likely receptacle once; open closed ones (drawer, cabinet, "
        "fridge, microwave) before looking inside, and do not revisit places you already checked.",
        "You can carry one object at a time. Take the object with 'take X from Y' before moving.",
        "Finish with 'move X to Y' at the target receptacle; the task ends as soon as it is satisfied.",
    ],
    "pick_and_place_simple": [
        "Find the object (countertops, tables, shelves, drawers, cabinets), take it, go to the "
        "target receptacle, open it if needed, and move the object there.",
    ],
    "look_at_obj_in_light": [
        "Find and take the object first, then find a desklamp or floorlamp (usually on a desk, "
        "sidetable or dresser), go there and 'use' the lamp while holding the object.",
    ],
    "pick_clean_then_place_in_recep": [
        "Take the object, go to a sinkbasin, 'clean X with sinkbasin N', then carry it to the "
        "target receptacle and move it there.",
    ],
    "pick_heat_then_place_in_recep": [
        "Take the object, go to the microwave, 'heat X with microwave 1' (no need to open it), then "
        "carry it to the target receptacle and move it there.",
    ],
    "pick_cool_then_place_in_recep": [
        "Take the object, go to the fridge, 'cool X with fridge 1' (no need to open it), then carry "
        "it to the target receptacle and move it there.",
    ],
    "pick_two_obj_and_place": [
        "You need two objects of the same kind but can carry one: take the first, put it in the "
        "target receptacle, then search the places you have not checked for the second one.",
    ],
}


ALFWORLD_DOWNLOAD_HINT = (
    "Get the games with `pip install alfworld==0.4.2 && alfworld-download`. It puts them in "
    "~/.cache/alfworld unless $ALFWORLD_DATA is set; point --alfworld-data (or $ALFWORLD_DATA) at "
    "the folder that holds json_2.1.1/."
)


class AlfWorldDataError(FileNotFoundError):
    """The ALFWorld game folder is missing or holds no playable game."""


# -----------------------------------------------------------------------------
# Game discovery
# -----------------------------------------------------------------------------

def alfworld_data_root(data_root=None):
    """The ALFWorld data root: `data_root` (--alfworld-data), else $ALFWORLD_DATA, else
    ~/.cache/alfworld (where `alfworld-download` puts the games). `~` and `$VARS` are expanded."""
    root = data_root or os.environ.get("ALFWORLD_DATA") or "~/.cache/alfworld"
    return Path(os.path.expanduser(os.path.expandvars(str(root))))


def _alfworld_task_type_or_none(path):
    """Task type from the nearest folder named `<task_type>-<Obj>-<MRecep>-<Recep>-<scene>`."""
    for part in reversed(Path(path).parts):
        head = part.split("-", 1)[0]
        if head in ALFWORLD_TASK_TYPES:
            return head
    return None


def alfworld_task_type(path):
    """Task type of a game (one of ALFWORLD_TASK_TYPES), read from its path, e.g.
    ".../pick_cool_then_place_in_recep-Apple-None-CounterTop-14/trial_T2019.../game.tw-pddl"."""
    task_type = _alfworld_task_type_or_none(path)
    if task_type is None:
        raise ValueError(f"no ALFWorld task type in the path {path!s}; expected a folder named "
                         f"'<task_type>-<Object>-<MRecep>-<Recep>-<scene>' with a task type in "
                         f"{ALFWORLD_TASK_TYPES}")
    return task_type


def _alfworld_game_is_solvable(game_path):
    try:
        with open(game_path, encoding="utf-8") as f:
            return json.load(f).get("solvable") is True
    except (OSError, ValueError, AttributeError):
        return False


def discover_alfworld_games(data_root=None, split="train"):
    """Sorted list of playable `game.tw-pddl` paths under `<root>/json_2.1.1/<split>`.

    A trial folder (`<task-folder>/<trial>/`) is kept under the rules of alfworld 0.4.2's
    `AlfredTWEnv.collect_game_files`: it holds `traj_data.json`; its path (below the split
    folder) contains neither "movable" nor "Sliced"; its task type is one of the six; it holds
    `game.tw-pddl`, whose JSON has `"solvable": true` (a missing key or an unreadable file is
    skipped too). The task type is read from the folder name, not from `traj_data.json` (the same
    value in ALFRED's layout), so discovery never parses the large trajectory files.
    Raises AlfWorldDataError if the split folder is missing or holds no playable game.
    """
    root = alfworld_data_root(data_root)
    split_dir = root / "json_2.1.1" / split
    if not split_dir.is_dir():
        raise AlfWorldDataError(f"ALFWorld split folder not found: {split_dir}. "
                                f"{ALFWORLD_DOWNLOAD_HINT}")
    games = []
    for dirpath, dirnames, filenames in os.walk(split_dir):
        dirnames.sort()
        if "traj_data.json" not in filenames or "game.tw-pddl" not in filenames:
            continue
        rel = os.path.relpath(dirpath, split_dir)
        if "movable" in rel or "Sliced" in rel:
            continue
        if _alfworld_task_type_or_none(rel) is None:
            continue
        game_path = os.path.join(dirpath, "game.tw-pddl")
        if _alfworld_game_is_solvable(game_path):
            games.append(game_path)
    if not games:
        raise AlfWorldDataError(f"no playable ALFWorld game (solvable game.tw-pddl + "
                                f"traj_data.json) under {split_dir}. {ALFWORLD_DOWNLOAD_HINT}")
    return sorted(games)


# -----------------------------------------------------------------------------
# Engine plumbing: a pool of engines and memoised parsing
# -----------------------------------------------------------------------------
# Each TextWorld `PddlEnv` loads its own private copy of fast-downward's 33 MB shared library
# (its planner state is global C state, so two games cannot share one copy). Copying and
# loading it takes ~0.1 s, so finished slots hand their engine back to a pool for the next one.

_ALFWORLD_ENGINE_POOL = []
_ALFWORLD_ENGINE_POOL_MAX = 512


def _alfworld_new_engine():
    import textworld
    from textworld.envs import PddlEnv
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
    infos = textworld.EnvInfos(won=True, admissible_commands=True)
    return AlfredInfos(AlfredDemangler(PddlEnv(infos), shuffle=False))


def _alfworld_acquire_engine():
    return _ALFWORLD_ENGINE_POOL.pop() if _ALFWORLD_ENGINE_POOL else _alfworld_new_engine()


def _alfworld_release_engine(engine, reusable=True):
    """Return an engine to the pool. An engine that raised is dropped instead; its library copy
    stays mapped (unloading it with fast_downward.close_lib makes Python segfault at exit)."""
    if reusable and len(_ALFWORLD_ENGINE_POOL) < _ALFWORLD_ENGINE_POOL_MAX:
        _ALFWORLD_ENGINE_POOL.append(engine)


class _AlfWorldParseMemo:
    """Memo tables for the pure, text-in/objects-out parsing steps TextWorld repeats.

    Measured on the 24 real games (2-core CPU): `fast_downward.pddl2sas` (PDDL -> SAS
    translation) is ~85 % of `reset()` and runs twice per state build, and a state is built at
    `load()` *and* at every `reset()`; `GameLogic` re-parses the grammar at every `load()`; every
    `step()` re-parses the same ~30 command/feedback templates and ~20 grammar conditions with a
    tatsu parser. Memoising them changes no output (a test checks identical text and admissible
    lists), makes load+reset of a cached game ~10x faster and steps ~2x faster. Translations,
    GameLogic objects and condition rules are shared read-only between engines; template parses
    are deep-copied because the caller attaches game state to them.
    """

    def __init__(self, max_games=64, max_templates=4096):
        self.max_games = max_games
        self.max_templates = max_templates
        self.sas = OrderedDict()      # (optimize, domain, problem) -> (task, sas)
        self.logic = OrderedDict()    # (domain, grammar) -> GameLogic
        self.templates = {}           # parser args -> parsed symbols (copied on use)
        self.conditions = {}          # grammar condition text -> textworld.logic.Rule
        self.stats = defaultdict(int)

    def _lru(self, table, key, build, limit, name):
        if key in table:
            table.move_to_end(key)
            self.stats[name + "_hits"] += 1
            return table[key]
        self.stats[name + "_misses"] += 1
        value = table[key] = build()
        while len(table) > limit:
            table.popitem(last=False)
        return value



_ALFWORLD_MEMO = _AlfWorldParseMemo()
_ALFWORLD_PATCH_DEPTH = [0]


@contextlib.contextmanager
def _alfworld_engine_calls(memoise=True):
    """Context for every call into the engine. Always restores `sys.argv`, which fast-downward's
    translator overwrites. With `memoise`, routes the four parsing steps through _ALFWORLD_MEMO
    for the duration of the call only (TextWorld looks them up as module attributes)."""
    saved_argv = sys.argv
    if not memoise or _ALFWORLD_PATCH_DEPTH[0] > 0:
        try:
            yield
        finally:
            sys.argv = saved_argv
        return
    import fast_downward
    import textworld.envs.pddl.logic as pddl_logic
    import textworld.envs.pddl.textgen as textgen
    orig_sas, orig_logic, orig_parse, orig_rule = (fast_downward.pddl2sas, pddl_logic.GameLogic,
                                                   textgen._parse_and_convert, textgen.Rule)
    memo = _ALFWORLD_MEMO

    def pddl2sas(domain, problem, verbose=False, optimize=False):
        return memo._lru(memo.sas, (bool(optimize), domain, problem),
                         lambda: orig_sas(domain, problem, verbose=verbose, optimize=optimize),
                         2 * memo.max_games, "sas")

    def game_logic(domain, grammar):
        return memo._lru(memo.logic, (domain, grammar),
                         lambda: orig_logic(domain=domain, grammar=grammar),
                         memo.max_games, "logic")

    def parse_and_convert(*args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        parsed = memo.templates.get(key)
        if parsed is None:
            parsed = orig_parse(*args, **kwargs)
            if len(memo.templates) >= memo.max_templates:
                return parsed
            memo.templates[key] = parsed
        return copy.deepcopy(parsed)  # the caller attaches engine state to what it gets

    class MemoRule:  # stands in for textworld.logic.Rule, which textgen uses only for this
        @staticmethod
        def parse_conjunctive_query(expr):
            rule = memo.conditions.get(expr)
            if rule is None:
                rule = orig_rule.parse_conjunctive_query(expr)
                if len(memo.conditions) < memo.max_templates:
                    memo.conditions[expr] = rule
            return rule

    _ALFWORLD_PATCH_DEPTH[0] += 1
    fast_downward.pddl2sas, pddl_logic.GameLogic = pddl2sas, game_logic
    textgen._parse_and_convert, textgen.Rule = parse_and_convert, MemoRule
    try:
        yield
    finally:
        fast_downward.pddl2sas, pddl_logic.GameLogic = orig_sas, orig_logic
        textgen._parse_and_convert, textgen.Rule = orig_parse, orig_rule
        _ALFWORLD_PATCH_DEPTH[0] -= 1
        sys.argv = saved_argv


# -----------------------------------------------------------------------------
# The environment adapter
# -----------------------------------------------------------------------------

class AlfWorldEnv:
    """One ALFWorld episode slot on the real text engine.

        env = AlfWorldEnv(gamefile, max_turns=50)
        obs, info = env.reset()                      # intro text with "Your task is to: ..."
        obs, reward, done, info = env.step(action)   # action: str, or None (a no-op)

    - `info`: {"task": the task sentence (after "Your task is to: "), "task_type",
      "admissible": sorted admissible commands without "help", "won", "turn", "error",
      "gamefile"}. `error` is None unless the engine raised.
    - `reward` is the engine's own, 1.0 on the step that wins, else 0.0 (retireopd.py reads only
      `won`: its R_i is --success-reward for a won episode). `done` when won or
      when `max_turns` turns were taken.
    - `action=None` is a no-op: the engine is not stepped, the last observation is returned
      again, and the turn counts. A well-formed but inadmissible command goes to the engine,
      which answers "Nothing happens." and changes nothing.
    - An engine exception (at load, reset or step) never propagates: the episode ends as a
      failure (done, won=False, reward 0) with the error text in `info["error"]`.
    - Steps after `done` change nothing and return reward 0.
    - `memoise` (default on) shares parsed games between slots; see _AlfWorldParseMemo.
    - `close()` (also called on garbage collection) hands the engine back to a pool.
    """

    def __init__(self, gamefile, max_turns=50, memoise=True):
        self.gamefile = str(gamefile)
        self.task_type = alfworld_task_type(self.gamefile)
        self.max_turns = int(max_turns)
        self.memoise = memoise
        self._engine = None
        self._loaded = False
        self.task = ""
        self.obs = ""
        self.admissible = []
        self.won = False
        self.done = True   # until reset()
        self.turn = 0
        self.error = None

    def _info(self):
        return {"task": self.task, "task_type": self.task_type, "admissible": list(self.admissible),
                "won": self.won, "turn": self.turn, "error": self.error,
                "gamefile": self.gamefile}

    def _read_state(self, state):
        self.obs = state.feedback
        self.admissible = [c for c in state["admissible_commands"] if c != "help"]
        self.won = bool(state["won"])

    def _fail(self, exc):
        self.error = f"{type(exc).__name__}: {exc}"
        self.won, self.done = False, True
        if self._engine is not None:  # its state is unknown: do not reuse it
            engine, self._engine, self._loaded = self._engine, None, False
            _alfworld_release_engine(engine, reusable=False)

    def reset(self):
        """Start (or restart) the episode. Returns (obs, info)."""
        self.turn, self.won, self.done, self.error = 0, False, False, None
        try:
            if self._engine is None:
                self._engine, self._loaded = _alfworld_acquire_engine(), False
            with _alfworld_engine_calls(self.memoise):
                if not self._loaded:
                    self._engine.load(self.gamefile)
                    self._loaded = True
                state = self._engine.reset()
            self._read_state(state)
        except Exception as exc:  # a broken game file must not stop the training loop
            self.obs, self.admissible, self.task = "", [], ""
            self._fail(exc)
            return self.obs, self._info()
        marker = "Your task is to: "
        self.task = self.obs.split(marker, 1)[1].strip() if marker in self.obs else ""
        return self.obs, self._info()

    def step(self, action):
        """One turn. Returns (obs, reward, done, info)."""
        if self.done:
            return self.obs, 0.0, True, self._info()
        self.turn += 1
        if action is not None:
            try:
                with _alfworld_engine_calls(self.memoise):
                    state, _, _ = self._engine.step(str(action))
                self._read_state(state)
            except Exception as exc:
                self._fail(exc)
                return self.obs, 0.0, True, self._info()
        if self.won or self.turn >= self.max_turns:
            self.done = True
        return self.obs, float(self.won), self.done, self._info()

    def close(self):
        """Hand the engine back to the pool (the env can be reset again afterwards)."""
        engine, self._engine, self._loaded = self._engine, None, False
        if engine is not None:
            _alfworld_release_engine(engine)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# -----------------------------------------------------------------------------
# Stepping many episodes: in this process, or in worker processes (--env-workers N)
# -----------------------------------------------------------------------------
# TextWorld is pure Python, so threads would take turns on the GIL: parallel stepping needs
# processes. Each worker owns the AlfWorldEnv of the episodes pinned to it and answers a batch
# of calls at a time. The rollout pins a task's G episodes to one worker, so that worker's memo
# parses the game once.

def _alfworld_worker(conn):
    """A worker process's loop: [(env_id, (gamefile, max_turns), method, args)] -> [results]."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    envs = {}
    while True:
        try:
            batch = conn.recv()
        except EOFError:  # the main process is gone
            return
        if batch is None:
            return
        replies = []
        for env_id, spec, method, args in batch:
            try:
                if method == "close":
                    env = envs.pop(env_id, None)
                    reply = env.close() if env is not None else None
                else:
                    env = envs.get(env_id) or envs.setdefault(env_id, AlfWorldEnv(*spec))
                    reply = getattr(env, method)(*args)
            except Exception as exc:  # sent back as a value: the caller decides what it means
                reply = RuntimeError(f"{type(exc).__name__}: {exc}")
            replies.append(reply)
        conn.send(replies)


class AlfWorldWorkers:
    """N worker processes (started with "spawn": safe after CUDA, no forked engine state)."""

    def __init__(self, n: int):
        context = multiprocessing.get_context("spawn")
        self.conns, self.processes = [], []
        for _ in range(n):
            parent, child = context.Pipe()
            process = context.Process(target=_alfworld_worker, args=(child,), daemon=True)
            process.start()
            child.close()
            self.conns.append(parent)
            self.processes.append(process)
        self.ids = itertools.count()
        self.broken = None  # why the pipes can no longer be trusted, once they cannot
        self.close = weakref.finalize(self, AlfWorldWorkers._shut_down, self.conns, self.processes)

    def run(self, calls: list) -> list:
        """[(worker, env_id, spec, method, args)] -> results in order: one message per worker,
        sent to all of them before any answer is read, so they work in parallel."""
        if self.broken:
            raise RuntimeError(f"ALFWorld workers unusable: {self.broken}")
        by_worker = defaultdict(list)
        for k, (worker, *call) in enumerate(calls):
            by_worker[worker].append((k, tuple(call)))
        results, worker = [None] * len(calls), None
        try:
            for worker, items in by_worker.items():
                self.conns[worker].send([call for _, call in items])
            for worker, items in by_worker.items():
                replies = self.conns[worker].recv()
                if len(replies) != len(items):
                    raise EOFError
                for (k, _), reply in zip(items, replies):
                    results[k] = reply
        except (EOFError, OSError):  # a worker died (a crash in the engine's C code, a kill)
            self.processes[worker].join(timeout=1)
            self.broken = (f"ALFWorld worker {worker} died (exit code "
                           f"{self.processes[worker].exitcode}); continue the run with --resume RUN_DIR")
            raise RuntimeError(self.broken) from None
        except BaseException:  # e.g. Ctrl-C between a send and its answer: replies are now stale
            self.broken = "a batch of calls was interrupted"
            raise
        return results

    @staticmethod
    def _shut_down(conns, processes):
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for conn, process in zip(conns, processes):
            process.join(timeout=2)
            if process.is_alive():
                process.terminate()
            conn.close()


class RemoteAlfWorldEnv:
    """An AlfWorldEnv that lives in a worker process: the same reset/step/close, one call at a
    time; retireopd.env_calls batches the calls of many of them."""

    def __init__(self, workers: AlfWorldWorkers, worker: int, gamefile, max_turns: int):
        self.workers, self.worker = workers, worker
        self.env_id, self.spec = next(workers.ids), (str(gamefile), max_turns)

    def call(self, method: str, *args):
        result = self.workers.run([(self.worker, self.env_id, self.spec, method, args)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def reset(self):
        return self.call("reset")

    def step(self, action):
        return self.call("step", action)

    def close(self):
        return self.call("close")


# -----------------------------------------------------------------------------
# Evaluation panels
# -----------------------------------------------------------------------------

def alfworld_eval_panel(data_root=None, splits=("valid_seen", "valid_unseen"), max_episodes=None):
    """The fixed evaluation panel: the games of `splits`, sorted by path (so valid_seen before
    valid_unseen). A missing split is skipped with a warning if another split has games; if none
    has, AlfWorldDataError.

    Capped (`max_episodes`), it takes the games round-robin over the task types (each type's
    games in sorted order), so that a small panel still covers every type; the first N in
    sorted order would all be `look_at_obj_in_light`. The chosen games are returned sorted.
    """
    games, problems = [], []
    for split in splits:
        try:
            games += discover_alfworld_games(data_root, split)
        except AlfWorldDataError as exc:
            problems.append(str(exc))
    if not games:
        raise AlfWorldDataError("no ALFWorld evaluation games: " + " | ".join(problems))
    for problem in problems:
        warnings.warn(f"skipping an ALFWorld evaluation split: {problem}")
    games = sorted(games)
    if max_episodes is None or max_episodes >= len(games):
        return games
    by_type = defaultdict(list)
    for game in games:
        by_type[alfworld_task_type(game)].append(game)
    queues = [by_type[t] for t in sorted(by_type)]
    chosen = []
    for rank in range(max(len(q) for q in queues)):
        chosen += [q[rank] for q in queues if rank < len(q)]
    return sorted(chosen[:max_episodes])


# -----------------------------------------------------------------------------
# Fixture games written by the project (tests, demo, `--model tiny`)
# -----------------------------------------------------------------------------
# Tiny one-room games in ALFWorld's own format, played by the same engine: our PDDL problems,
# alfworld's domain (alfred.pddl) and grammar (alfred.twl2) from the installed wheel.
# Each row: (split, task_type, object, where the object lies, target receptacle).
# The task's helper receptacle: clean -> SinkBasin, heat -> Microwave, cool -> Fridge,
# look -> a SideTable with a DeskLamp (the target), two -> a Drawer holding the second object.

ALFWORLD_FIXTURE_GAMES = (
    ("train", "pick_and_place_simple", "Mug", "CounterTop", "SideTable"),
    ("train", "look_at_obj_in_light", "CD", "Shelf", "DeskLamp"),
    ("train", "pick_clean_then_place_in_recep", "Cloth", "CounterTop", "Cabinet"),
    ("train", "pick_heat_then_place_in_recep", "Egg", "Fridge", "DiningTable"),
    ("train", "pick_cool_then_place_in_recep", "Apple", "Cabinet", "CounterTop"),
    ("train", "pick_two_obj_and_place", "Pencil", "Shelf", "Desk"),
    ("valid_seen", "pick_and_place_simple", "Book", "Shelf", "Desk"),
    ("valid_seen", "pick_clean_then_place_in_recep", "Plate", "DiningTable", "Cabinet"),
    ("valid_seen", "pick_cool_then_place_in_recep", "Tomato", "CounterTop", "DiningTable"),
)
_ALFWORLD_OPENABLE = {"Cabinet", "Drawer", "Fridge", "Microwave"}
_ALFWORLD_HELPER = {  # task type -> (helper receptacle, verb, ability fact, goal fact)
    "pick_clean_then_place_in_recep": ("SinkBasin", "clean", "cleanable", "isClean"),
    "pick_heat_then_place_in_recep": ("Microwave", "heat", "heatable", "isHot"),
    "pick_cool_then_place_in_recep": ("Fridge", "cool", "coolable", "isCool")}
_ALFWORLD_SENTENCE = {"pick_and_place_simple": "put a {o} in {r}",
                      "look_at_obj_in_light": "look at {o} under the {r}",
                      "pick_clean_then_place_in_recep": "put a clean {o} in {r}",
                      "pick_heat_then_place_in_recep": "put a hot {o} in {r}",
                      "pick_cool_then_place_in_recep": "put a cool {o} in {r}",
                      "pick_two_obj_and_place": "put two {o} in {r}"}
# types the domain names as constants (they must be declared objects of every problem)
_ALFWORLD_CONST_TYPES = ("SinkBasinType - rtype", "MicrowaveType - rtype", "FridgeType - rtype",
                         "KnifeType - otype", "ButterKnifeType - otype", "DeskLampType - otype")


def _alfworld_receptacle_id(name):
    # ALFRED ids are "<Name>|x|y|z"; the demangler turns "Sink|..|SinkBasin" into "sinkbasin N"
    return "Sink_bar_1_bar_SinkBasin" if name == "SinkBasin" else f"{name}_bar_1"


def alfworld_fixture_problem(task_type, obj, source, target):
    """PDDL problem, task sentence and winning action list of one fixture game."""
    o, src, tgt = obj.lower(), source.lower(), target.lower()
    helper = _ALFWORLD_HELPER.get(task_type)
    recs = [source, target]
    if helper:
        recs.insert(1, helper[0])
    if task_type == "look_at_obj_in_light":
        recs[1] = "SideTable"              # the lamp is an object standing on a side table
    if task_type == "pick_two_obj_and_place":
        recs.insert(1, "Drawer")
    # objects: (id, type, receptacle); the demangler numbers same-name ids in reverse sort
    # order, so Pencil_bar_2 becomes "pencil 1" and Pencil_bar_1 "pencil 2".
    objs = [(f"{obj}_bar_2" if task_type == "pick_two_obj_and_place" else f"{obj}_bar_1",
             obj, source)]
    if task_type == "pick_two_obj_and_place":
        objs.append((f"{obj}_bar_1", obj, "Drawer"))
    if task_type == "look_at_obj_in_light":
        objs.append(("DeskLamp_bar_1", "DeskLamp", "SideTable"))
    loc = {r: f"loc_bar_{i + 1}_bar_0_bar_0_bar_0" for i, r in enumerate(recs)}
    decl = ["agent1 - agent", "loc_bar_0_bar_0_bar_0_bar_0 - location"]
    decl += [f"{loc[r]} - location" for r in recs]
    decl += [f"{_alfworld_receptacle_id(r)} - receptacle" for r in recs]
    decl += [f"{i} - object" for i, _, _ in objs]
    decl += sorted({f"{r}Type - rtype" for r in recs} | {f"{t}Type - otype" for _, t, _ in objs}
                   | set(_ALFWORLD_CONST_TYPES))
    init = ["(atLocation agent1 loc_bar_0_bar_0_bar_0_bar_0)"]
    for r in recs:
        rid = _alfworld_receptacle_id(r)
        init += [f"(receptacleType {rid} {r}Type)", f"(receptacleAtLocation {rid} {loc[r]})"]
        init += [f"(openable {rid})"] if r in _ALFWORLD_OPENABLE else []
        init += [f"(canContain {r}Type {obj}Type)"]
    for i, t, r in objs:
        init += [f"(objectType {i} {t}Type)", f"(inReceptacle {i} {_alfworld_receptacle_id(r)})",
                 f"(objectAtLocation {i} {loc[r]})"]
        init += ["(toggleable DeskLamp_bar_1)"] if t == "DeskLamp" else [f"(pickupable {i})"]
        init += [f"({helper[2]} {i})"] if helper else []
    typed = f"(objectType ?o {obj}Type) (receptacleType ?r {target}Type)"
    if task_type == "look_at_obj_in_light":
        goal = ("(and (exists (?ot - object ?r - receptacle ?a - agent ?l - location) (and "
                "(objectType ?ot DeskLampType) (toggleable ?ot) (isToggled ?ot) "
                "(receptacleAtLocation ?r ?l) (atLocation ?a ?l) (inReceptacle ?ot ?r))) "
                f"(exists (?o - object ?a - agent) (and (objectType ?o {obj}Type) (holds ?a ?o))))")
    elif task_type == "pick_two_obj_and_place":
        goal = ("(exists (?r - receptacle ?o - object ?o2 - object) (and (not (= ?o ?o2)) "
                f"{typed} (objectType ?o2 {obj}Type) (inReceptacle ?o ?r) (inReceptacle ?o2 ?r)))")
    else:
        extra = f" ({helper[2]} ?o) ({helper[3]} ?o)" if helper else ""
        goal = f"(exists (?r - receptacle ?o - object) (and (inReceptacle ?o ?r) {typed}{extra}))"
    problem = "(define (problem fixture)\n(:domain alfred)\n(:objects\n  {}\n)\n(:init\n  {}\n)\n" \
              "(:goal {})\n)\n".format("\n  ".join(decl), "\n  ".join(init), goal)

    def go(r, opened=()):
        openable = r in {x.lower() for x in _ALFWORLD_OPENABLE} and r not in opened
        return [f"go to {r} 1"] + ([f"open {r} 1"] if openable else [])

    actions = go(src) + [f"take {o} 1 from {src} 1"]
    if helper:
        actions += go(helper[0].lower(), opened=(helper[0].lower(),)) + \
            [f"{helper[1]} {o} 1 with {helper[0].lower()} 1"]
    if task_type == "look_at_obj_in_light":
        actions += ["go to sidetable 1", "use desklamp 1"]
    else:
        actions += go(tgt, opened=(src,)) + [f"move {o} 1 to {tgt} 1"]
    if task_type == "pick_two_obj_and_place":
        actions += go("drawer") + [f"take {o} 2 from drawer 1"]
        actions += go(tgt) + [f"move {o} 2 to {tgt} 1"]
    sentence = _ALFWORLD_SENTENCE[task_type].format(o=o, r=tgt)
    return problem, sentence, actions


def _alfworld_wheel_data():
    """alfworld's domain (alfred.pddl) and grammar (alfred.twl2), read from the installed wheel
    without importing alfworld (whose import creates ~/.cache/alfworld)."""
    import importlib.util
    spec = importlib.util.find_spec("alfworld")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the ALFWorld fixture games need the alfworld package: "
                          "pip install alfworld==0.4.2")
    data = Path(list(spec.submodule_search_locations)[0]) / "data"
    return (data / "alfred.pddl").read_text(encoding="utf-8"), (data / "alfred.twl2").read_text(encoding="utf-8")


def write_fixture_alfworld_games(out_root):
    """Write ALFWORLD_FIXTURE_GAMES as an $ALFWORLD_DATA-style tree under `out_root`:
    json_2.1.1/<split>/<task_type>-<Obj>-None-<Recep>-<n>/trial_fixture/{game.tw-pddl,
    traj_data.json}. The winning action list is the game's "walkthrough". Returns out_root."""
    domain, grammar = _alfworld_wheel_data()
    out_root = Path(out_root)
    for n, (split, task_type, obj, source, target) in enumerate(ALFWORLD_FIXTURE_GAMES):
        problem, sentence, actions = alfworld_fixture_problem(task_type, obj, source, target)
        trial = (out_root / "json_2.1.1" / split / f"{task_type}-{obj}-None-{target}-{900 + n}"
                 / "trial_fixture")
        trial.mkdir(parents=True, exist_ok=True)
        game = {"pddl_domain": domain, "grammar": grammar.replace("UNKNOWN GOAL", sentence),
                "pddl_problem": problem, "solvable": True, "walkthrough": actions}
        _write_new_file(trial / "game.tw-pddl", json.dumps(game))
        annotation = sentence[0].upper() + sentence[1:] + "."
        traj = {"task_type": task_type,
                "pddl_params": {"object_target": obj, "parent_target": target,
                                "toggle_target": target if target == "DeskLamp" else "",
                                "mrecep_target": "", "object_sliced": False},
                "turk_annotations": {"anns": [{"task_desc": annotation}]}}
        _write_new_file(trial / "traj_data.json", json.dumps(traj))
    return out_root


def _write_new_file(path, text):
    """path.write_text(text) into a run folder: whatever held the name is unlinked (a link or a hard link
    goes, what it pointed to is untouched), and the file is created anew with O_EXCL (common.create_file)."""
    from common import create_file
    with os.fdopen(create_file(path), "w", encoding="utf-8") as f:
        f.write(text)
