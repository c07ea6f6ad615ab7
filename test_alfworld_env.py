"""alfworld_env.py on the real alfworld/TextWorld engine: game discovery with alfworld's own filters,
the fixed panels, episodes on fixture games we write (a win exactly at the end, inadmissible commands,
the turn cap, an engine exception), memoised parsing, worker processes that play exactly as this
process, and the 24 real games of ../shared/alfworld replayed from their expert plans (skipped when
../shared or alfworld is absent). Slow: the replays."""

import json
import os
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest

import engine
import environments
import retireopd as R
from alfworld_env import (
    ALFWORLD_FIXTURE_GAMES, ALFWORLD_TASK_TYPES, AlfWorldDataError, AlfWorldEnv,
    alfworld_data_root, alfworld_eval_panel, alfworld_task_type, discover_alfworld_games,
    write_fixture_alfworld_games, _ALFWORLD_MEMO,
)
from conftest import ALFWORLD_MISSING, HAVE_ALFWORLD, QUICK, needs_alfworld, one_line_refusal, small_cfg


def _shared_alfworld():
    shared = os.environ.get("RETIREOPD_SHARED")
    base = Path(shared) if shared else Path(__file__).resolve().parent.parent / "shared"
    return base / "alfworld"


@pytest.fixture(scope="module")
def fixture_root(tmp_path_factory):
    if not HAVE_ALFWORLD:
        pytest.skip(ALFWORLD_MISSING)
    return write_fixture_alfworld_games(tmp_path_factory.mktemp("alfworld_fixture"))


def _load(game):
    with open(game) as f:
        return json.load(f)


def _walkthrough(game):
    return _load(game)["walkthrough"]


# --- pure helpers ------------------------------------------------------------------------------------


def test_task_types_constant_matches_alfworld_ids():
    assert ALFWORLD_TASK_TYPES == (
        "pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
        "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_two_obj_and_place")
    if HAVE_ALFWORLD:
        from alfworld.agents.environment.alfred_tw_env import TASK_TYPES
        assert tuple(TASK_TYPES[i] for i in range(1, 7)) == ALFWORLD_TASK_TYPES


@pytest.mark.parametrize("path,expected", [
    ("d/json_2.1.1/train/pick_cool_then_place_in_recep-Apple-None-CounterTop-14/trial_T1/"
     "game.tw-pddl", "pick_cool_then_place_in_recep"),
    ("pick_two_obj_and_place-Pan-None-CounterTop-14/trial_T1", "pick_two_obj_and_place"),
    ("look_at_obj_in_light-CD-None-DeskLamp-320/trial_x/game.tw-pddl", "look_at_obj_in_light"),
    ("x/pick_and_place_simple-Mug-None-SideTable-329/trial_T2/game.tw-pddl",
     "pick_and_place_simple"),
])
def test_task_type_from_path(path, expected):
    assert alfworld_task_type(path) == expected


@pytest.mark.parametrize("path", [
    "pick_and_place_with_movable_recep-Apple-Bowl-Fridge-1/trial_T1/game.tw-pddl",
    "some/other/folder/game.tw-pddl",
])
def test_task_type_unknown_raises(path):
    with pytest.raises(ValueError):
        alfworld_task_type(path)


def test_data_root_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "env"))
    assert alfworld_data_root(tmp_path / "flag") == tmp_path / "flag"
    assert alfworld_data_root() == tmp_path / "env"
    monkeypatch.delenv("ALFWORLD_DATA")
    assert alfworld_data_root() == Path.home() / ".cache" / "alfworld"


def test_missing_data_folder_is_a_clear_error(tmp_path):
    with pytest.raises(AlfWorldDataError) as err:
        discover_alfworld_games(tmp_path, "train")
    msg = str(err.value)
    assert "alfworld-download" in msg and "~/.cache/alfworld" in msg and "ALFWORLD_DATA" in msg
    assert str(tmp_path / "json_2.1.1" / "train") in msg and "not found" in msg
    assert isinstance(err.value, FileNotFoundError)


def test_empty_split_folder_is_an_error(tmp_path):
    (tmp_path / "json_2.1.1" / "train").mkdir(parents=True)
    with pytest.raises(AlfWorldDataError, match="no playable"):
        discover_alfworld_games(tmp_path, "train")


# --- fixture games -----------------------------------------------------------------------------------


@needs_alfworld
def test_fixture_writer_layout(fixture_root):
    task_types = {row[1] for row in ALFWORLD_FIXTURE_GAMES}
    assert {"pick_and_place_simple", "pick_cool_then_place_in_recep",
            "pick_clean_then_place_in_recep"} <= task_types
    trials = sorted((fixture_root / "json_2.1.1").glob("*/*/*"))
    assert len(trials) == len(ALFWORLD_FIXTURE_GAMES)
    for trial in trials:
        game = _load(trial / "game.tw-pddl")
        assert set(game) == {"pddl_domain", "grammar", "pddl_problem", "solvable", "walkthrough"}
        assert game["solvable"] is True and game["walkthrough"]
        assert "UNKNOWN GOAL" not in game["grammar"] and "(:goal" in game["pddl_problem"]
        traj = _load(trial / "traj_data.json")
        assert traj["task_type"] == alfworld_task_type(trial)
        assert traj["pddl_params"]["object_target"] == trial.parent.name.split("-")[1]
        assert traj["turk_annotations"]["anns"][0]["task_desc"]


@needs_alfworld
def test_discovery_filters_like_alfworld(fixture_root, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(fixture_root, root)
    train = root / "json_2.1.1" / "train"
    good = sorted(str(p) for p in train.glob("*/*/game.tw-pddl"))
    assert len(good) == 6
    src = Path(good[0]).parent

    def clone(folder, drop=None, edit=None):
        dst = train / folder / "trial_x"
        shutil.copytree(src, dst)
        if drop:
            (dst / drop).unlink()
        if edit:
            game = _load(dst / "game.tw-pddl")
            edit(game)
            (dst / "game.tw-pddl").write_text(json.dumps(game))

    clone("pick_and_place_with_movable_recep-Apple-Bowl-Fridge-1")
    clone("pick_heat_then_place_in_recep-AppleSliced-None-Fridge-1")
    clone("pick_and_place_simple-Mug-None-Desk-2", drop="traj_data.json")
    clone("pick_and_place_simple-Mug-None-Desk-3", drop="game.tw-pddl")
    clone("pick_and_place_simple-Mug-None-Desk-4", edit=lambda g: g.update(solvable=False))
    clone("pick_and_place_simple-Mug-None-Desk-5", edit=lambda g: g.pop("solvable"))
    clone("unknown_task-Mug-None-Desk-6")
    corrupt = train / "pick_and_place_simple-Mug-None-Desk-7" / "trial_x"
    corrupt.mkdir(parents=True)
    (corrupt / "game.tw-pddl").write_text("{not json")
    (corrupt / "traj_data.json").write_text("{}")
    clone("pick_and_place_simple-Mug-None-Desk-8")           # a valid extra game: found
    found = discover_alfworld_games(root, "train")
    extra = str(train / "pick_and_place_simple-Mug-None-Desk-8" / "trial_x" / "game.tw-pddl")
    assert found == sorted(good + [extra])
    assert discover_alfworld_games(root, "train") == found      # deterministic
    assert len(discover_alfworld_games(root, "valid_seen")) == 3


@needs_alfworld
def test_eval_panel(fixture_root, tmp_path):
    with pytest.warns(UserWarning, match="valid_unseen"):
        panel = alfworld_eval_panel(fixture_root)
    assert panel == sorted(discover_alfworld_games(fixture_root, "valid_seen")) and len(panel) == 3
    with pytest.warns(UserWarning):
        assert alfworld_eval_panel(fixture_root, max_episodes=2) == panel[:2]
    both = alfworld_eval_panel(fixture_root, splits=("valid_seen", "train"))
    assert both == sorted(both) and len(both) == 9
    assert both[0].split(os.sep)[-4] == "train"     # sorted by path: train < valid_seen
    with pytest.raises(AlfWorldDataError):
        alfworld_eval_panel(tmp_path)


@needs_alfworld
def test_capped_eval_panel_covers_every_task_type(fixture_root, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(fixture_root, root)
    seen = root / "json_2.1.1" / "valid_seen"
    # a second pick_and_place_simple game that sorts before the other types' games
    shutil.copytree(seen / "pick_and_place_simple-Book-None-Desk-906", seen / "pick_and_place_simple-Book-None-Desk-916")
    full = alfworld_eval_panel(root, splits=("valid_seen",))
    assert [alfworld_task_type(g) for g in full] == ["pick_and_place_simple"] * 2 + [
        "pick_clean_then_place_in_recep", "pick_cool_then_place_in_recep"]
    capped = alfworld_eval_panel(root, splits=("valid_seen",), max_episodes=3)
    assert capped == [full[0], full[2], full[3]]        # one per type, not the first three
    assert alfworld_eval_panel(root, splits=("valid_seen",), max_episodes=4) == full
    assert alfworld_eval_panel(root, splits=("valid_seen",), max_episodes=1) == [full[0]]


@needs_alfworld
def test_reset_gives_task_and_admissible(fixture_root):
    for game in discover_alfworld_games(fixture_root, "train"):
        traj = _load(Path(game).parent / "traj_data.json")
        env = AlfWorldEnv(game)
        obs, info = env.reset()
        sentence = traj["turk_annotations"]["anns"][0]["task_desc"]
        assert info["task"] == sentence[0].lower() + sentence[1:]
        assert obs.startswith("-= Welcome to TextWorld, ALFRED! =-")
        assert obs.rstrip().endswith("Your task is to: " + info["task"])
        assert info["task_type"] == traj["task_type"] == alfworld_task_type(game)
        assert "help" not in info["admissible"]
        assert {"look", "inventory"} <= set(info["admissible"])
        assert any(a.startswith("go to ") for a in info["admissible"])
        assert info["won"] is False and info["error"] is None and info["turn"] == 0
        env.close()


@needs_alfworld
def test_walkthrough_wins_exactly_at_the_end(fixture_root):
    games = (discover_alfworld_games(fixture_root, "train")
             + discover_alfworld_games(fixture_root, "valid_seen"))
    assert len(games) == len(ALFWORLD_FIXTURE_GAMES)
    for game in games:
        env = AlfWorldEnv(game, max_turns=50)
        _, info = env.reset()
        actions = _walkthrough(game)
        for k, action in enumerate(actions):
            assert action in info["admissible"], (game, action)
            obs, reward, done, info = env.step(action)
            last = k == len(actions) - 1
            assert info["won"] is last and done is last, (game, action)
            assert reward == (1.0 if last else 0.0)
            assert "Nothing happens." not in obs
        assert info["turn"] == len(actions)
        # a finished episode ignores further steps
        obs2, reward, done, info2 = env.step("look")
        assert (obs2, reward, done, info2["turn"]) == (obs, 0.0, True, len(actions))


@needs_alfworld
def test_inadmissible_command_changes_nothing(fixture_root):
    game = discover_alfworld_games(fixture_root, "train")[0]
    env = AlfWorldEnv(game)
    _, info0 = env.reset()
    bad = "take unicorn 1 from shelf 1"
    assert bad not in info0["admissible"]
    obs, reward, done, info = env.step(bad)
    assert obs == "Nothing happens."
    assert info["admissible"] == info0["admissible"]
    assert (reward, done, info["won"], info["turn"]) == (0.0, False, False, 1)
    for action in _walkthrough(game):     # the state is unchanged: the walkthrough still wins
        _, reward, done, info = env.step(action)
    assert info["won"] and reward == 1.0 and done


@needs_alfworld
def test_turn_cap(fixture_root):
    game = discover_alfworld_games(fixture_root, "train")[0]
    env = AlfWorldEnv(game, max_turns=3)
    env.reset()
    dones = [env.step("look")[2] for _ in range(3)]
    assert dones == [False, False, True]
    obs, reward, done, info = env.step(_walkthrough(game)[0])
    assert done and reward == 0.0 and info["turn"] == 3 and not info["won"]
    _, info = env.reset()                   # a reset starts a new episode in the same slot
    assert info["turn"] == 0 and env.step("look")[2] is False


@needs_alfworld
def test_malformed_answer_is_a_counted_noop(fixture_root):
    game = discover_alfworld_games(fixture_root, "train")[1]
    actions = _walkthrough(game)
    env = AlfWorldEnv(game, max_turns=len(actions) + 2)
    env.reset()
    obs1, _, _, info1 = env.step(actions[0])
    obs2, reward, done, info2 = env.step(None)
    assert obs2 == obs1 and info2["admissible"] == info1["admissible"]
    assert (reward, done, info2["won"], info2["turn"]) == (0.0, False, False, 2)
    for action in actions[1:]:              # state unchanged: the rest of the walkthrough wins
        _, reward, done, info = env.step(action)
    assert info["won"] and reward == 1.0 and done and info["turn"] == len(actions) + 1
    env2 = AlfWorldEnv(game, max_turns=2)   # no-ops count toward the turn cap
    env2.reset()
    assert [env2.step(None)[2] for _ in range(2)] == [False, True]


@needs_alfworld
def test_engine_exception_ends_episode_as_failure(fixture_root, tmp_path, monkeypatch):
    game = discover_alfworld_games(fixture_root, "train")[0]
    env = AlfWorldEnv(game)
    obs0, _ = env.reset()

    def broken_step(command):
        raise RuntimeError("engine exploded")

    monkeypatch.setattr(env._engine, "step", broken_step)
    obs, reward, done, info = env.step("look")
    assert done and reward == 0.0 and info["won"] is False
    assert "engine exploded" in info["error"] and "RuntimeError" in info["error"]
    assert obs == obs0
    assert env.step("look")[2] is True      # stays finished, never raises
    # a corrupt game file fails at reset, also without raising
    bad = tmp_path / "pick_and_place_simple-Mug-None-Desk-1" / "trial_x" / "game.tw-pddl"
    bad.parent.mkdir(parents=True)
    bad.write_text(json.dumps({"pddl_domain": "(define", "grammar": "", "pddl_problem": "",
                               "solvable": True}))
    env_bad = AlfWorldEnv(bad)
    obs, info = env_bad.reset()
    assert info["error"] and info["won"] is False and env_bad.done
    assert env_bad.step("look")[1:3] == (0.0, True)
    # the pool hands out a working engine afterwards
    env3 = AlfWorldEnv(game)
    env3.reset()
    assert env3.step(_walkthrough(game)[0])[3]["error"] is None


@pytest.mark.slow
@needs_alfworld
def test_memoised_engine_gives_identical_text(fixture_root, monkeypatch):
    argv = ["retireopd.py", "--model", "tiny"]
    monkeypatch.setattr(sys, "argv", list(argv))
    for game in discover_alfworld_games(fixture_root, "train"):
        runs = []
        for memoise in (False, True, True):
            env = AlfWorldEnv(game, memoise=memoise)
            obs, info = env.reset()
            trace = [(obs, info["admissible"])]
            for action in ["look", "inventory", "take unicorn 1 from shelf 1"] + _walkthrough(game):
                obs, _, _, info = env.step(action)
                trace.append((obs, info["admissible"], info["won"]))
            runs.append(trace)
            env.close()
        assert runs[0] == runs[1] == runs[2], game
    assert sys.argv == argv                  # fast-downward's translator overwrites sys.argv
    assert _ALFWORLD_MEMO.stats["sas_hits"] > 0 and _ALFWORLD_MEMO.stats["logic_hits"] > 0
    assert _ALFWORLD_MEMO.conditions
    # the engine calls leave TextWorld's own functions in place
    import fast_downward
    import fast_downward.interface
    import textworld.logic
    import textworld.envs.pddl.logic as pddl_logic
    import textworld.envs.pddl.textgen as textgen
    assert fast_downward.pddl2sas is fast_downward.interface.pddl2sas
    assert textgen.Rule is textworld.logic.Rule
    assert pddl_logic.GameLogic.__name__ == "GameLogic" and isinstance(pddl_logic.GameLogic, type)
    assert textgen._parse_and_convert.__module__ == textgen.__name__
    # the memo hands out copies: its own parsed templates never hold a game's state
    assert _ALFWORLD_MEMO.templates
    for symbols in _ALFWORLD_MEMO.templates.values():
        assert all(not getattr(sym, "context", None) for sym in symbols)


@needs_alfworld
def test_group_members_are_independent(fixture_root):
    game = discover_alfworld_games(fixture_root, "train")[1]
    actions = _walkthrough(game)
    group = [AlfWorldEnv(game) for _ in range(3)]
    starts = [env.reset() for env in group]
    assert starts[0] == starts[1] == starts[2]
    for action in actions:                   # member 0 plays, member 1 only looks, 2 idles
        _, _, _, info0 = group[0].step(action)
        _, _, _, info1 = group[1].step("look")
    assert info0["won"] and not info1["won"]
    assert group[2].step(None)[3]["admissible"] == starts[2][1]["admissible"]
    for action in actions:
        _, reward, _, info2 = group[2].step(action)
    assert info2["won"] and reward == 1.0


@pytest.mark.slow
@needs_alfworld
def test_env_workers_play_exactly_like_this_process(fixture_root, tiny, monkeypatch):
    """--env-workers: the same episodes, turn for turn, when worker processes own the games; a
    task's G episodes share a worker; a dead worker is a clear error, not a hang."""
    model, tok = tiny
    games = discover_alfworld_games(fixture_root, "train")
    walkthroughs = {}
    for game in games:
        _, info = AlfWorldEnv(game).reset()
        walkthroughs[info["task"]] = _walkthrough(game)
    turn = [0]

    def scripted(m, t, prompts, n, temp, **_):  # each game's walkthrough, one step per turn
        answers = []
        for prompt in prompts:
            task = t.decode(prompt).split("Your task: ", 1)[1].split("\n", 1)[0]
            steps = walkthroughs[task]
            action = steps[turn[0]] if turn[0] < len(steps) else "look"
            answers.append(engine.Sampled(t(f"<think>x</think><action>{action}</action><|im_end|>")["input_ids"], False))
        turn[0] += 1
        return answers

    monkeypatch.setattr(R, "generate", scripted)
    longest = max(map(len, walkthroughs.values()))

    def play(workers):
        cfg = small_cfg(env="alfworld", alfworld_data=str(fixture_root), max_turns=longest + 1,
                        env_workers=workers)
        with pytest.warns(UserWarning, match="valid_unseen"):  # the fixtures have no such split
            suite = R.TaskSuite(cfg)
        turn[0] = 0
        try:
            samples, episodes, _ = R.rollout(model, tok, suite, games, cfg, group_size=2, skills_in_prompt=False,
                                             with_teacher_prompts=False, temperature=1.0)
            if workers:
                assert [e.env.worker for e in episodes] == [g % workers for g in range(len(games)) for _ in range(2)]
                suite.workers.processes[1].kill()
                suite.workers.processes[1].join()
                with pytest.raises(RuntimeError, match=r"worker 1 died .*--resume"):
                    environments.env_calls([(e.env, "reset", ()) for e in episodes])
                with pytest.raises(RuntimeError, match="unusable"):  # never a stale answer
                    episodes[0].env.reset()
        finally:
            suite.close()
        return ([(s.episode, s.prompt_ids, s.response_ids, s.score) for s in samples],
                [(e.task, e.observation, e.history, e.admissible, e.won, e.turns, e.error) for e in episodes])

    here, there = play(0), play(2)
    assert all(won for *_, won, _, _ in here[1]) and len(here[1]) == 2 * len(games)
    assert there == here


# --- the real games of ../shared ---------------------------------------------------------------------


def _real_games():
    root = _shared_alfworld()
    manifest = root / "manifest.jsonl"
    if not HAVE_ALFWORLD or not manifest.is_file():
        return root, []
    return root, [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()]


REAL_ROOT, REAL_GAMES = _real_games()


needs_real = pytest.mark.skipif(not REAL_GAMES, reason="../shared/alfworld is absent" if HAVE_ALFWORLD else ALFWORLD_MISSING)


@needs_real
def test_real_games_discovery():
    found = discover_alfworld_games(REAL_ROOT, "valid_seen")
    assert len(found) == 24
    assert found == sorted(str(REAL_ROOT / g["gamefile"]) for g in REAL_GAMES)
    with pytest.warns(UserWarning):
        assert alfworld_eval_panel(REAL_ROOT) == found
    with pytest.warns(UserWarning):
        capped = alfworld_eval_panel(REAL_ROOT, max_episodes=12)
    assert sorted(Counter(alfworld_task_type(g) for g in capped).values()) == [2] * 6


@pytest.mark.slow
@needs_real
@pytest.mark.parametrize("record", REAL_GAMES, ids=[g["path"].split("/")[2] for g in REAL_GAMES])
def test_real_game_expert_replay_wins(record):
    env = AlfWorldEnv(REAL_ROOT / record["gamefile"], max_turns=50)
    assert env.task_type == record["task_type"]
    obs, info = env.reset()
    assert obs == record["initial_observation"]
    assert "Your task is to: " + info["task"] == record["task"]
    assert len(info["admissible"]) == record["n_admissible_at_reset"] - 1   # without "help"
    actions = record["expert_actions"]
    for k, action in enumerate(actions):
        # the recorded expert sometimes sends "help": hidden from the list, still executed
        assert action in info["admissible"] or action == "help"
        obs, reward, done, info = env.step(action)
        last = k == len(actions) - 1
        assert info["won"] is last and done is last and info["error"] is None
    assert reward == 1.0 and obs == record["final_feedback"]
    env.close()


@pytest.mark.slow
@needs_alfworld
def test_broken_alfworld_games_through_the_real_engine(tmp_path):
    import alfworld_env
    root = alfworld_env.write_fixture_alfworld_games(tmp_path / "games")
    valid = alfworld_env.discover_alfworld_games(root, "valid_seen")
    broken = json.dumps({"pddl_domain": "(define", "grammar": "", "pddl_problem": "", "solvable": True})
    Path(valid[0]).write_text(broken)  # one game of the panel that the engine cannot load
    flags = QUICK + ["--env", "alfworld", "--alfworld-data", str(root), "--algo", "grpo", "--iterations", "1",
                     "--eval-episodes", "3"]
    R.main(flags + ["--run-dir", str(tmp_path / "one")])
    first = R.read_jsonl(tmp_path / "one" / "eval.jsonl")[0]
    assert first["env_errors"] == 1 and first["n"] == 2  # before: n 3, the broken game a "failure"
    for game in valid[1:]:
        Path(game).write_text(broken)
    one_line_refusal(flags + ["--run-dir", str(tmp_path / "all")],
                     "every episode of the student validation \\(3 tasks\\) failed to start")


@needs_alfworld
def test_fixture_games_are_written_anew_never_through_a_link(tmp_path, fixture_root):
    """A run rewrites its fixture games at every start: a link or a hard link left at a game's name is
    replaced, and what it pointed to is untouched (before: write_text wrote through both)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("another user's file\n")
    games = sorted(fixture_root.rglob("game.tw-pddl"))
    out = tmp_path / "alfworld_fixtures"
    shutil.copytree(fixture_root, out)
    first, second = (out / game.relative_to(fixture_root) for game in games[:2])
    first.unlink()
    first.symlink_to(victim)
    second.unlink()
    os.link(victim, second)
    write_fixture_alfworld_games(out)
    assert victim.read_text() == "another user's file\n" and os.stat(victim).st_nlink == 1
    assert not first.is_symlink() and first.read_text() == games[0].read_text()
    assert second.read_text() == games[1].read_text()
