"""Every environment behind one interface, and the episodes the rollout plays in lock-step.

retireopd.py drives every environment the same way, so its rollout loop does not care which one it plays:

    observation, info = env.reset()
    observation, reward, done, info = env.step(action)

where info carries "task", "task_type" (the skill key), "admissible" and "won". The reward slot is the
environment's own (ALFWorld 1 on a win, WebShop the purchase score, the kitchen 1 on a win); training
reads only `won` (R_i, turn_scores). Every answer steps the environment, a malformed one with what
project_action sends (mostly an inadmissible string, which changes nothing). The environments are
alfworld_env.py (the real engine), webshop_env.py (WebShop in pure Python) and kitchen_env.py (the
offline demo's); each keeps its skill notes, the privileged information of self-OPD, beside it.

Here: `TaskSuite` (a benchmark's training pool, its two fixed panels, an episode factory) and the
episodes' side of the rollout (`EpisodeState`; `start_episodes`, `step_episodes`, `close_episodes`,
which reach ALFWorld's worker processes with --env-workers). None of it is part of the method.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import alfworld_env  # ALFWorld's engine machinery (alfworld itself is imported only when a game is played)
import kitchen_env  # the offline demo's kitchen
import webshop_env  # WebShop's catalogue, search engine and reward, in pure Python


@dataclass
class EpisodeState:
    """What the rollout loop tracks of one episode: its environment, what the prompt shows, its turns."""
    env: Any
    group: int
    index: int = 0  # i: its place among the iteration's episodes
    task: str = ""
    task_type: str = ""
    observation: str = ""
    admissible: list = field(default_factory=list)
    history: list = field(default_factory=list)  # (observation, action) pairs
    samples: list = field(default_factory=list)  # its TurnSamples, one per turn
    turns: int = 0
    won: bool = False
    done: bool = False
    error: Optional[str] = None


def env_calls(calls: list) -> list:
    """[(env, method, args)] -> their results, in order; an exception is returned in place of its
    result, not raised. Envs in ALFWorld worker processes run in parallel; the others one by one."""
    results, remote, local = [None] * len(calls), {}, []
    for k, (env, method, args) in enumerate(calls):
        if isinstance(env, alfworld_env.RemoteAlfWorldEnv):
            remote.setdefault(env.workers, []).append((k, (env.worker, env.env_id, env.spec, method, args)))
        else:
            local.append(k)
    for workers, batch in remote.items():
        for (k, _), result in zip(batch, workers.run([call for _, call in batch])):
            results[k] = result
    for k in local:
        env, method, args = calls[k]
        try:
            results[k] = getattr(env, method)(*args)
        except Exception as exc:
            results[k] = exc
    return results


def start_episodes(episodes: list) -> None:
    """Reset every episode's environment (in parallel with --env-workers). A task whose reset fails (an
    exception, or an error the environment reports) is an error: the episode ends with no turn, so it
    is never trained on, and it is counted (env_errors); evaluate leaves it out of the success rate."""
    for episode, result in zip(episodes, env_calls([(e.env, "reset", ()) for e in episodes])):
        error = repr(result) if isinstance(result, Exception) else result[1].get("error")
        if error:
            episode.done, episode.error = True, f"reset: {error}"
            continue
        episode.observation, info = result
        episode.task, episode.task_type, episode.admissible = info["task"], info["task_type"], info["admissible"]


def step_episodes(actions: list, active: list, max_turns: int) -> None:
    """Step each (episode, action); then every active episode at max_turns is done."""
    results = env_calls([(episode.env, "step", (action,)) for episode, action in actions])
    for (episode, action), result in zip(actions, results):
        if isinstance(result, Exception):
            episode.done, episode.error = True, f"step: {result!r}"
            continue
        observation, _, env_done, info = result
        episode.history.append((episode.observation, action))
        episode.observation, episode.admissible = observation, info["admissible"]
        episode.won, episode.done = bool(info["won"]), bool(env_done or info["won"])
        if info.get("error"):
            episode.error = info["error"]
    for episode in active:
        if episode.turns >= max_turns:
            episode.done = True


def close_episodes(episodes: list) -> None:
    """Hand engines back (to this process's pool, or the worker's)."""
    env_calls([(e.env, "close", ()) for e in episodes if hasattr(e.env, "close")])


class TaskSuite:
    """The tasks of one benchmark: a training pool, two fixed panels, an episode factory.

    validation_panel: what the retirement rule and S_T read, every --eval-every iterations (the
    in-distribution split: ALFWorld's 140 valid_seen games; WebShop's first 128 validation
    goals). report_panel: the full evaluation at the end of each phase (ALFWorld valid_seen +
    valid_unseen; WebShop all validation goals). ALFWorld tasks are game files, WebShop tasks goal
    indices (the seed-233 split of webshop_env). --eval-episodes caps both panels.
    """

    def __init__(self, cfg):
        self.cfg, self.workers = cfg, None
        cap = cfg.eval_episodes
        if cfg.env == "alfworld":
            root = alfworld_env.alfworld_data_root(cfg.alfworld_data)
            splits = ("valid_seen", "valid_unseen")
            if cfg.alfworld_data == "fixtures":  # our own tiny games, written into the run folder
                root = alfworld_env.write_fixture_alfworld_games(Path(cfg.run_dir) / "alfworld_fixtures")
                splits = ("valid_seen",)  # the fixtures have no valid_unseen split
            self.root = root
            self.train = alfworld_env.discover_alfworld_games(root, "train")
            self.validation_panel = alfworld_env.alfworld_eval_panel(root, ("valid_seen",), max_episodes=cap)
            self.report_panel = alfworld_env.alfworld_eval_panel(root, splits, max_episodes=cap)
            if cfg.env_workers > 0:
                self.workers = alfworld_env.AlfWorldWorkers(cfg.env_workers)
        elif cfg.env == "kitchen":
            self.train, self.validation_panel, self.report_panel = kitchen_env.kitchen_tasks(cap)
        else:
            self.shop = webshop_env.WebShop(data_dir=cfg.webshop_data, reward_mode=cfg.webshop_reward)
            self.train = list(self.shop.train_goal_indices)
            validation_goals = list(self.shop.valid_goal_indices)
            self.validation_panel = validation_goals[:128][:cap]
            self.report_panel = validation_goals[:cap]

    def task_type(self, task) -> str:
        if self.cfg.env == "alfworld":
            return alfworld_env.alfworld_task_type(task)
        if self.cfg.env == "kitchen":
            return kitchen_env.kitchen_dish(task)
        category = self.shop.goals[task]["category"]
        return webshop_env.SKILL_CATEGORY.get(category, category)  # its raw categories -> our skill blocks

    def new_episode(self, task, slot: int = 0):
        """A fresh episode of `task`. With --env-workers, `slot` (the rollout passes the task's
        group) picks the worker process that will own it."""
        if self.cfg.env == "webshop":
            return webshop_env.WebShopAdapter(self.shop, task)
        if self.cfg.env == "kitchen":
            return kitchen_env.KitchenEnv(task)
        if self.workers is not None:
            worker = slot % len(self.workers.processes)
            return alfworld_env.RemoteAlfWorldEnv(self.workers, worker, task, self.cfg.max_turns)
        return alfworld_env.AlfWorldEnv(task, max_turns=self.cfg.max_turns)

    def close(self):
        if self.workers is not None:
            self.workers.close()
