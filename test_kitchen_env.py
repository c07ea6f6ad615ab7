"""kitchen_env.py: the offline demo's kitchen. Its rules one step at a time, notes that name only the
seasoning, and panels that cover every dish and are never trained on."""

from collections import Counter


import kitchen_env
import retireopd as R


def test_kitchen_rules_one_step_at_a_time():
    dorl = 1 * 1000 + 3  # sorted dishes: brask, dorl, ...; dorl is salted, then chilled
    episode = kitchen_env.KitchenEnv(dorl)
    observation, info = episode.reset()
    assert (info["task"], info["task_type"]) == ("cook a dorl", "dorl")
    assert sorted(info["admissible"]) == sorted(f"{i} the dorl" for i in kitchen_env.KITCHEN_INGREDIENTS)
    assert kitchen_env.KitchenEnv(dorl).reset()[1]["admissible"] == info["admissible"]  # one order per task
    assert any(kitchen_env.KitchenEnv(1000 + v).reset()[1]["admissible"] != info["admissible"] for v in range(8))
    assert episode.step("eat the dorl")[:3] == ("Nothing happens.", 0.0, False)  # inadmissible: nothing
    observation, reward, done, info = episode.step("salt the dorl")
    assert (reward, done, observation) == (0.0, False, "The dorl is seasoned with salt.")
    assert sorted(info["admissible"]) == sorted(f"{m} the dorl" for m in kitchen_env.KITCHEN_METHODS)
    observation, reward, done, info = episode.step("chill the dorl")
    assert (reward, done, info["won"], observation) == (1.0, True, True, "The dorl is ready!")
    assert episode.step("chill the dorl")[:3] == ("Nothing happens.", 0.0, True)  # served: nothing more
    for wrong in (("sugar the dorl", "chill the dorl"), ("salt the dorl", "fry the dorl")):
        ruined = kitchen_env.KitchenEnv(dorl)
        ruined.reset()
        observation, reward, done, info = ruined.step(wrong[0])  # a wrong seasoning shows only when served
        assert (reward, done, observation) == (0.0, False, f"The dorl is seasoned with {wrong[0].split()[0]}.")
        observation, reward, done, info = ruined.step(wrong[1])
        assert (reward, done, info["won"], observation) == (0.0, True, False, "The dorl is ruined.")


def test_kitchen_notes_name_the_seasoning_only_and_the_student_prompt_says_nothing():
    assert len(set(kitchen_env.KITCHEN_RECIPES.values())) == len(kitchen_env.KITCHEN_RECIPES)  # ignoring the dish cannot win all
    for k, (dish, (ingredient, method)) in enumerate(sorted(kitchen_env.KITCHEN_RECIPES.items())):
        skills = R.skill_text("kitchen", dish)
        assert f"{dish}: {ingredient.capitalize()} it" in skills  # the seasoning, as the recipe says
        assert not any(m in skills.lower() for m in kitchen_env.KITCHEN_METHODS)  # never the way to cook it
        observation, info = kitchen_env.KitchenEnv(k * 1000).reset()
        student = R.build_user_message("kitchen", info["task"], 0, [], observation, info["admissible"])
        assert ingredient.capitalize() not in student and method.capitalize() not in student


def test_kitchen_panels_cover_every_dish_and_are_not_trained_on():
    suite = R.TaskSuite(R.parse_config({"model": "tiny", "run_dir": "/tmp/unused"}))
    validation, report = kitchen_env.KITCHEN_PANEL
    assert Counter(suite.task_type(t) for t in suite.validation_panel) == Counter({d: validation for d in kitchen_env.KITCHEN_RECIPES})
    assert Counter(suite.task_type(t) for t in suite.report_panel) == Counter({d: report for d in kitchen_env.KITCHEN_RECIPES})
    assert len(suite.validation_panel) >= 48  # one episode moves a validation by at most 0.021
    assert not set(suite.train) & set(suite.report_panel) and set(suite.validation_panel) <= set(suite.report_panel)
