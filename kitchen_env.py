"""The offline demo's kitchen (--env kitchen): six invented dishes, each cooked in two choices, with
the kitchen's skill notes, in the interface every environment of retireopd.py has:

    obs, info = env.reset()
    obs, reward, done, info = env.step(action)    # info: task, task_type, admissible, won

Each dish has a recipe of its own, a seasoning and a way to cook it, and nothing in the task says
which. The teacher's skills are the kitchen's notes, and like real strategy notes they are
incomplete: they name each dish's seasoning, never how to cook it. So the base model with skills
wins about 1 dish in 6 (it guesses the way to cook); phase 1's RL has to find the rest (the teacher
ends imperfect where it has not yet), and a student without notes must find both by trial (1 in 36
per dish) or learn them from the teacher. Pure Python, no other module of ours.
"""

from __future__ import annotations

import random
from typing import Optional

KITCHEN_INGREDIENTS = ("salt", "sugar", "pepper", "honey", "vinegar", "ginger")
KITCHEN_METHODS = ("boil", "bake", "fry", "chill", "roast", "steam")
KITCHEN_RECIPES = {"brask": ("honey", "fry"), "dorl": ("salt", "chill"), "fimble": ("pepper", "bake"),
                   "grue": ("sugar", "boil"), "nallow": ("vinegar", "roast"), "trisk": ("ginger", "steam")}


def kitchen_note(dish: str, ingredient: str) -> str:
    return f"Recipe for a {dish}: {ingredient.capitalize()} it, then cook it."


# The skills of the kitchen (what only the teacher sees, retireopd.py's skill_text): a general rule, and
# one note per dish that names its seasoning and not how to cook it.
KITCHEN_SKILLS = {
    "general": ["First season the dish as its note says, then cook it; a wrong choice ruins the dish. The "
                "notes do not say how to cook each dish."],
    **{dish: [kitchen_note(dish, ingredient)] for dish, (ingredient, _) in KITCHEN_RECIPES.items()},
}


def kitchen_dish(task: int, recipes: Optional[dict] = None) -> str:
    """A kitchen task is `dish index * 1000 + variant`; the variant only shuffles the order of the
    admissible actions, so that their position says nothing. Training variants 0-99, panels 500 on."""
    return sorted(recipes or KITCHEN_RECIPES)[task // 1000]


KITCHEN_PANEL = (8, 16)  # episodes per dish: validation (48), report (96); one episode moves them 0.02, 0.01


def kitchen_tasks(cap: Optional[int] = None) -> tuple[list, list, list]:
    """(training tasks, validation panel, report panel): 100 variants of each dish to train on, and
    the panels' own variants, every dish once, then every dish again (so that a cap at `cap` episodes,
    --eval-episodes, still covers every dish)."""
    dishes = range(len(KITCHEN_RECIPES))
    train = [d * 1000 + v for d in dishes for v in range(100)]
    validation = [d * 1000 + 500 + v for v in range(KITCHEN_PANEL[0]) for d in dishes][:cap]
    report = [d * 1000 + 500 + v for v in range(KITCHEN_PANEL[1]) for d in dishes][:cap]
    return train, validation, report


class KitchenEnv:
    """One dish in the kitchen: two decisions, an ingredient ("honey the brask") and a way to cook it
    ("fry the brask"), then the dish is served: won (reward 1) iff both were right; a wrong one ruins
    it, which shows only when it is served. An inadmissible command changes nothing. The commands
    name the dish just before the choice, as ALFWorld's name objects."""

    def __init__(self, task: int, recipes: Optional[dict] = None):
        self.recipes = recipes or KITCHEN_RECIPES
        self.task, self.dish = task, kitchen_dish(task, self.recipes)

    def _info(self, won: bool = False) -> dict:
        return {"task": f"cook a {self.dish}", "task_type": self.dish, "admissible": list(self.admissible),
                "won": won}

    def _offer(self, actions: list) -> None:
        self.admissible = list(actions)
        self.order.shuffle(self.admissible)

    def reset(self):
        self.seasoning, self.done = None, False
        self.order = random.Random(self.task)  # the admissible order of this task's two steps
        self._offer([f"{ingredient} the {self.dish}" for ingredient in KITCHEN_INGREDIENTS])
        return "You stand at the stove. The pot is empty.", self._info()

    def step(self, action: str):
        if self.done or action not in self.admissible:
            return "Nothing happens.", 0.0, self.done, self._info()
        choice = action.split()[0]
        if self.seasoning is None:
            self.seasoning = choice
            self._offer([f"{m} the {self.dish}" for m in KITCHEN_METHODS])
            return f"The {self.dish} is seasoned with {choice}.", 0.0, False, self._info()
        self.done, self.admissible = True, []
        if (self.seasoning, choice) == self.recipes[self.dish]:
            return f"The {self.dish} is ready!", 1.0, True, self._info(won=True)
        return f"The {self.dish} is ruined.", 0.0, True, self._info()
