"""End-to-end runs of retireopd.py (main) with the tiny model: every --algo, on the built-in WebShop
catalogue and fixture ALFWorld games; the rule retiring, a fixed schedule, a saved teacher reused,
the final models' precision; which prompt each phase's rollouts and evaluations see; and the offline
demo, which must learn: GRPO learns the kitchen and unlearns it with the advantage's sign flipped, and
the demo tells the paper's story. The fast tier runs both phases once and phase 2 on each environment
(seconds each); the rest is slow (the demo: minutes)."""

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

import retireopd as R
from common import checkpoint_folders
import tiny as built_in_models  # (the name `tiny` is the fixture of the tiny model)
from conftest import small_cfg, FakeSuite, QUICK, needs_alfworld, run_cli, phases, comparable


# --- every --algo, end to end ------------------------------------------------------------------------


# in the fast tier: both phases once (retireopd on WebShop) and phase 2 alone on each environment
FAST_RUNS = {("retireopd", "webshop"), ("grpo", "webshop"), ("grpo", "alfworld")}


@pytest.mark.parametrize("algo,env", [
    pytest.param(algo, env, id=f"{algo}-{env}", marks=[*(() if (algo, env) in FAST_RUNS else [pytest.mark.slow]),
                                                        *([needs_alfworld] if env == "alfworld" else [])])
    for env in ("webshop", "alfworld") for algo in ("retireopd", "grpo", "skill-grpo", "opd", "grpo+opd")])
def test_every_algo_runs_to_completion(tmp_path, algo, env):
    # webshop: the built-in catalogue; alfworld: the fixture games, through the real engine
    run_dir, metrics, events = run_cli(tmp_path, algo, "--algo", algo, "--env", env)
    teacher_its = [("teacher", k) for k in range(3)]
    student_its = [("student", k) for k in range(3)]
    expected = {"grpo": student_its, "skill-grpo": teacher_its}.get(algo, teacher_its + student_its)
    assert phases(metrics) == expected
    assert json.loads((run_dir / "config.json").read_text())["algo"] == algo
    assert (run_dir / ("teacher" if algo == "skill-grpo" else "student") / "config.json").is_file()
    evals = R.read_jsonl(run_dir / "eval.jsonl")
    assert evals and all("overall" in e and e["seed"] == 12345 for e in evals)
    if algo == "skill-grpo":  # the teacher's report is with and without its skills
        assert {e["skills"] for e in evals if e["panel"] == "report"} == {True, False}
    # a validation after every iteration (--eval-every 1), and, as the authors' phase-1 and GRPO scripts
    # (val_before_train; their phase-2 scripts turn it off), one before the first update of a phase
    # without a teacher; the teacher's, as theirs, with its skills and without
    validations = [(e["phase"], e["iteration"], e["skills"]) for e in evals if e["panel"] == "validation"]
    teacher_validations = [("teacher", k, skills) for k in (-1, 0, 1, 2) for skills in (True, False)]
    grpo_validations = [("student", k, False) for k in (-1, 0, 1, 2)]
    assert validations == {"grpo": grpo_validations, "skill-grpo": teacher_validations}.get(
        algo, teacher_validations + grpo_validations[1:])
    assert all(bool(e.get("before_training")) == (e["iteration"] == -1) for e in evals if e["panel"] == "validation")
    retirements = [e for e in events if e["event"] == "retirement"]
    students = [m for m in metrics if m["phase"] == "student"]
    if algo in ("opd", "grpo+opd", "retireopd"):  # not retired (competence 0): the teacher scores every iteration
        assert not retirements and all(m["teacher_active"] and "gap" in m and m["opd_coef"] == 0.01 for m in students)
        assert all(m["criterion_valid"] for m in students[1:])  # W = 1: judged from the second block on
    if algo == "opd":  # pure distillation: no policy-gradient term at all
        assert all("pg_loss" not in m and m["loss"] == pytest.approx(0.01 * m["opd_loss"]) for m in students)
    if algo == "grpo":
        assert all(not m["teacher_active"] and "gap" not in m and m["opd_coef"] == 0.0 for m in students)
    assert events[-1]["event"] == "done"
    # the end-of-run split of the wall time: where this process's seconds went, stage by stage
    stages = {"grpo": ["start and base model", "phase 2"], "skill-grpo": ["start and base model", "phase 1"]}.get(
        algo, ["start and base model", "phase 1", "phase 2"])
    assert list(events[-1]["stages_s"]) == stages
    # (what follows the last stage, train's gc.collect of this long test process's heap among it, is in none:
    # 0.5 s of it was seen once on a 2-core machine)
    assert sum(events[-1]["stages_s"].values()) == pytest.approx(events[-1]["wall_s"], abs=1.0)


def test_retireopd_retires_by_the_rule_then_trains_with_grpo_alone(tmp_path, monkeypatch):
    # The random tiny model never wins, so the rule's inputs are injected: a student validation
    # success of 0.5 (= S_T: competence 1.0) and a gap that never shrinks (K = 1.0 each iteration).
    real_evaluate, real_gap = R.evaluate, R.teacher_student_gap
    monkeypatch.setattr(R, "evaluate", lambda model, tok, suite, tasks, cfg, skills_in_prompt, desc: {
        **real_evaluate(model, tok, suite, tasks, cfg, skills_in_prompt, desc),
        **({} if skills_in_prompt else {"overall": 0.5})})
    monkeypatch.setattr(R, "teacher_student_gap", lambda *a: (1.0, real_gap(*a)[1]))
    teacher_calls, real_score = [], R.response_logprobs
    monkeypatch.setattr(R, "response_logprobs", lambda model, samples, cfg, teacher_prompt=False: (
        teacher_calls.append(teacher_prompt), real_score(model, samples, cfg, teacher_prompt))[1])
    run_dir, metrics, events = run_cli(tmp_path, "adaptive", "--env", "webshop", "--iterations", "4")
    (retirement,) = [e for e in events if e["event"] == "retirement"]
    # W = 1: block 0 sets the baselines at iteration 0; iteration 1 judges block 1: progress 0, competence 1
    assert retirement["rule"] == "adaptive" and retirement["retired_at"] == 2
    assert retirement["progress"] == 0.0 and retirement["competence"] == 1.0 and retirement["criterion_valid"]
    students = [m for m in metrics if m["phase"] == "student"]
    assert [m["teacher_active"] for m in students] == [True, True, False, False]
    assert [m["opd_coef"] for m in students] == [0.01, 0.01, 0.0, 0.0]
    assert [m["retired"] for m in students] == [False, True, True, True]
    assert all("gap" not in m and "t_teacher" not in m and "opd_loss" not in m for m in students[2:])
    assert teacher_calls.count(True) == 2  # the teacher scored phase-2 iterations 0 and 1 only
    assert json.loads((run_dir / "student" / "retireopd.json").read_text())["retired_at"] == 2


@pytest.mark.slow
def test_retire_at_n_is_a_fixed_schedule(tmp_path):
    _, metrics, events = run_cli(tmp_path, "fixed", "--env", "webshop", "--iterations", "4", "--retire-at", "3")
    (retirement,) = [e for e in events if e["event"] == "retirement"]
    assert retirement["rule"] == "fixed" and retirement["retired_at"] == 3
    students = [m for m in metrics if m["phase"] == "student"]
    assert [m["teacher_active"] for m in students] == [True, True, True, False]


@pytest.mark.slow
def test_saved_teacher_is_reused_and_models_load_by_folder(tmp_path):
    first, _, _ = run_cli(tmp_path, "first", "--algo", "skill-grpo", "--env", "webshop")
    stored = json.loads((first / "teacher" / "retireopd.json").read_text())
    validations = [m["val_success"] for m in R.read_jsonl(first / "metrics.jsonl")]
    assert stored["validations"] == validations[-2:] and stored["env"] == "webshop"
    assert stored["teacher_success"] == sum(validations[-2:]) / 2
    second, metrics, events = run_cli(tmp_path, "second", "--algo", "grpo+opd", "--env", "webshop",
                                      "--teacher", str(first / "teacher"))
    assert phases(metrics) == [("student", k) for k in range(3)]  # phase 1 skipped
    with pytest.raises(SystemExit, match="trained on webshop"):
        R.main(QUICK + ["--env", "alfworld", "--teacher", str(first / "teacher"), "--run-dir", str(tmp_path / "z")])
    for folder in (first / "teacher", second / "student"):  # final models: bf16, servable
        assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model, tok = R.load_policy(str(second / "student"), torch.device("cpu"), torch.float32)
    (ids, *_), = R.generate(model, tok, [R.encode_prompt(tok, "hello")], 4, 1.0)
    assert 1 <= len(ids) <= 4


def test_final_models_are_bf16_and_generate_checkpoints_keep_fp32(tiny, tmp_path):
    model, tok = tiny
    run = R.Run(small_cfg(run_dir=str(tmp_path)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    final = run.save_model(model, tok, "student", {"algo": "grpo"})
    config = json.loads((final / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    loaded = R.transformers.AutoModelForCausalLM.from_pretrained(final)
    assert loaded.dtype == torch.bfloat16
    for key, value in loaded.state_dict().items():  # the fp32 weights rounded to bf16, nothing else
        assert torch.equal(value, before[key].to(torch.bfloat16)), key
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()  # still tied
    # 2 B/param, the tied embedding once (a second copy would add 2 x 512 x 64 B); the header is small
    assert (final / "model.safetensors").stat().st_size < 2 * sum(p.numel() for p in model.parameters()) + 16_384
    tok_loaded = R.transformers.AutoTokenizer.from_pretrained(final)
    torch.manual_seed(0)
    (ids, _, logp), = R.generate(loaded, tok_loaded, [R.encode_prompt(tok_loaded, "hello")], 4, 1.0)
    assert 1 <= len(ids) <= 4 and logp.dtype == torch.float32 and bool((logp < 0).all())
    assert all(torch.equal(v, before[k]) and v.dtype == torch.float32 for k, v in model.state_dict().items())
    run.checkpoint(model, tok, {"phase": "student", "iteration": 0})  # resumable: the fp32 master weights
    resumable = R.transformers.AutoModelForCausalLM.from_pretrained(checkpoint_folders(run.dir)[-1])
    assert resumable.dtype == torch.float32
    assert all(torch.equal(v, before[k]) for k, v in resumable.state_dict().items())


def test_a_bf16_saved_teacher_loaded_in_fp32_gives_zero_discrepancy_only_against_the_same_weights(tiny, tmp_path):
    """Phase 2 loads the teacher from its bf16 folder into --frozen-dtype float32: the teacher is
    then the bf16-rounded model, exactly. Against the same weights D = 0 exactly; against the fp32
    weights it was rounded from, D is small but not 0 (the cost of servable final models)."""
    model, tok = tiny
    R.Run(small_cfg(run_dir=str(tmp_path))).save_model(model, tok, "teacher")
    teacher, _ = R.load_policy(str(tmp_path / "teacher"), torch.device("cpu"), torch.float32)
    assert teacher.dtype == torch.float32
    rounded_student = copy.deepcopy(model).to(torch.bfloat16).to(torch.float32)
    cfg = small_cfg(env="alfworld")
    torch.manual_seed(0)
    samples, _, _ = R.rollout(model, tok, FakeSuite(), [0, 0], cfg, group_size=2, skills_in_prompt=False,
                              with_teacher_prompts=False, temperature=1.0)
    teacher_logp = torch.cat(R.response_logprobs(teacher, samples, cfg))
    for student, zero in ((rounded_student, True), (model, False)):
        student_logp = torch.cat(R.response_logprobs(student, samples, cfg))
        _, discrepancy = R.teacher_student_gap(student_logp, teacher_logp, torch.ones_like(student_logp))
        assert (discrepancy == 0.0) == zero
        assert discrepancy < 1e-5  # measured: ~1.5e-7 on the tiny model


@pytest.mark.slow
def test_evaluation_does_not_change_the_training_trajectory(tmp_path):
    _, with_eval, _ = run_cli(tmp_path, "a", "--env", "webshop", "--algo", "grpo", "--window", "3", "--eval-every", "1")
    _, without, _ = run_cli(tmp_path, "b", "--env", "webshop", "--algo", "grpo", "--window", "3", "--eval-every", "2")
    assert [("val_success" in m) for m in without] == [False, True, True]  # every 2nd, and the last
    strip = lambda ms: [{k: v for k, v in m.items() if k != "val_success"} for m in comparable(ms)]  # noqa: E731
    assert strip(with_eval) == strip(without)


@pytest.mark.slow
def test_zero_kl_coef_never_loads_the_reference_and_phase_two_with_a_teacher_has_none(tmp_path, monkeypatch):
    loads, real = [], R.load_policy
    monkeypatch.setattr(R, "load_policy", lambda name, *a, **k: (loads.append(Path(name).name), real(name, *a, **k))[1])
    run_cli(tmp_path, "nokl", "--env", "webshop", "--algo", "grpo", "--kl-coef", "0")
    assert loads == ["tiny"]          # the student only
    loads.clear()
    run_dir, metrics, _ = run_cli(tmp_path, "retire", "--env", "webshop")
    # phase 1: the policy and its KL reference; phase 2: the student and the teacher, no reference
    assert loads == ["tiny", "tiny", "tiny", "teacher"]
    assert all("kl_ref" in m for m in metrics if m["phase"] == "teacher")
    assert all("kl_ref" not in m and "t_reference" not in m for m in metrics if m["phase"] == "student")


# --- which prompt each phase sees --------------------------------------------------------------------


@pytest.mark.slow
def test_skills_in_phase_one_prompts_and_evals_and_S_T_over_last_window(tmp_path, monkeypatch):
    # every rollout: (phase, inside an evaluation?, skills_in_prompt, with_teacher_prompts)
    seen, now = [], {"phase": None, "evaluating": False}
    real_rollout, real_evaluate, real_phase = R.rollout, R.evaluate, R.train_phase

    def rollout(*args, **kwargs):
        seen.append((now["phase"], now["evaluating"], kwargs["skills_in_prompt"], kwargs["with_teacher_prompts"]))
        return real_rollout(*args, **kwargs)

    def evaluate(*args, **kwargs):
        now["evaluating"] = True
        try:
            return real_evaluate(*args, **kwargs)
        finally:
            now["evaluating"] = False

    def train_phase(phase, *args, **kwargs):
        now["phase"] = phase
        validations = real_phase(phase, *args, **kwargs)
        # the teacher's validations as if it had learnt: S_T = mean of the last two = 0.75
        # (all three: 0.583; the last: 1.0; --teacher-success: 0.5)
        return [0.25, 0.5, 1.0] if phase == "teacher" else validations

    monkeypatch.setattr(R, "rollout", rollout)
    monkeypatch.setattr(R, "evaluate", evaluate)
    monkeypatch.setattr(R, "train_phase", train_phase)
    trained, real_update = [], R.ppo_update
    monkeypatch.setattr(R, "ppo_update", lambda model, opt, samples, *a, **k: (
        trained.append("Skills for this task" in built_in_models.build_tiny_tokenizer(R.prompt_format()).decode(samples[0].prompt_ids)),
        real_update(model, opt, samples, *a, **k))[1])
    run_dir, _, _ = run_cli(tmp_path, "skills", "--env", "webshop", "--window", "2")
    assert trained == [True] * 3 + [False] * 3          # phase 1 trains on s_t^T, phase 2 on s_t
    # Skill-GRPO: the teacher plays with its skills; the student plays without them, and its
    # rollouts also build s_t^T for the teacher (active throughout: competence 0, never retired)
    assert [(phase, p, t) for phase, evaluating, p, t in seen if not evaluating] == (
        [("teacher", True, False)] * 3 + [("student", False, True)] * 3)
    evals = R.read_jsonl(run_dir / "eval.jsonl")
    # phase 1 validates before training and at every validation with skills (S_T reads these) and
    # without, as the authors do; its report is with skills; the student never sees them
    teacher_evals = [(e["iteration"], e["panel"], e["skills"]) for e in evals if e["phase"] == "teacher"]
    assert teacher_evals == [(k, "validation", skills) for k in (-1, 0, 1, 2) for skills in (True, False)] + [
        (2, "report", True)]
    assert {e["skills"] for e in evals if e["phase"] == "student"} == {False}
    assert json.loads((run_dir / "teacher" / "retireopd.json").read_text())["teacher_success"] == 0.75


# --- the offline demo: a run that learns -------------------------------------------------------------


def demo_episodes(model, tok, suite, tasks, cfg):
    _, episodes, _ = R.rollout(model, tok, suite, tasks, cfg, group_size=1, skills_in_prompt=False,
                               with_teacher_prompts=False, temperature=cfg.eval_temperature)
    return sum(e.won for e in episodes) / len(episodes)


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    """The demo's warm-started base model (RUN_DIR/tiny_base of `--model tiny`), built once."""
    cfg = R.parse_config({"model": "tiny", "run_dir": str(tmp_path_factory.mktemp("base") / "run")})
    return Path(R.warm_started_tiny_base(R.Run(cfg), torch.device("cpu"), cfg.warm_start))


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, tiny_base):
    """The README's demo, `python retireopd.py --model tiny` (seed 0), run once for the tests below,
    in a folder that already holds its base model (the warm start is deterministic: the same one)."""
    run_dir = tmp_path_factory.mktemp("demo") / "run"
    shutil.copytree(tiny_base, run_dir / "tiny_base")
    R.main(["--model", "tiny", "--run-dir", str(run_dir)])
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("sign", [1, -1], ids=["grpo", "grpo-with-the-advantage-sign-flipped"])
def test_grpo_learns_the_kitchen_and_fails_with_the_advantage_sign_flipped(tiny_base, tmp_path, monkeypatch, sign):
    # cleanRL's habit: the algorithm must learn. From the warm-started base, GRPO alone (no teacher)
    # on two dishes: validation success rises by a clear margin in 16 iterations. The same run with
    # the sign of every advantage flipped must not learn (the check that the test can fail).
    real = R.grpo_advantages
    monkeypatch.setattr(R, "grpo_advantages", lambda *a, **k: sign * real(*a, **k))
    cfg = R.parse_config({"model": "tiny", "run_dir": str(tmp_path), "iterations": 16, "eval_every": 2,
                          "save_every": 0})
    model, tok = R.load_policy(str(tiny_base), torch.device("cpu"), torch.float32)
    suite = R.TaskSuite(cfg)
    suite.train = [t for t in suite.train if t // 1000 in (0, 1)]  # brask and dorl
    suite.validation_panel = [d * 1000 + 500 + v for d in (0, 1) for v in range(8)]
    before = demo_episodes(model, tok, suite, suite.validation_panel, cfg)
    R.train_phase("student", model, tok, suite, cfg, R.Run(cfg), skills_in_prompt=False,
                  frozen=R.FrozenModels())
    after = demo_episodes(model, tok, suite, suite.validation_panel, cfg)
    print(f"GRPO on two dishes, advantage sign {sign:+d}: validation {before} -> {after}")
    if sign == 1:  # measured here: 0.06 -> 0.50 (flipped: 0.0 -> 0.0)
        assert after >= before + 0.25, (before, after)
    else:
        assert after <= before, (before, after)


@pytest.mark.slow
def test_demo_tells_the_story(demo_run):
    # What held on every seed of 0-4 in both studies (docs/running.md: two machines whose phase 2 took other
    # paths, ten runs), so whichever path this CPU's floats take: skills alone are not a teacher, phase 1 makes
    # one, the student starts far below it, the authors' rule retires the teacher, and the student ends at
    # rho * S_T or above, the competence the rule asked of it. That the retired student *passes* its teacher
    # is a claim over seeds, which study.py counts (5 of 5 on one machine, 4 of 5 on the other, where seed 2's
    # rule fired only at the last iteration): no single run asserts it. Never one seed's numbers.
    evals = R.read_jsonl(demo_run / "eval.jsonl")
    before = {e["skills"]: e["overall"] for e in evals if e.get("before_training") and e["phase"] == "teacher"}
    teacher_val = [e["overall"] for e in evals if e["phase"] == "teacher" and e["panel"] == "validation"
                   and e["skills"] and not e.get("before_training")]
    student_val = [e["overall"] for e in evals if e["phase"] == "student" and e["panel"] == "validation"]
    report = {(e["phase"], e["skills"]): e for e in evals if e["panel"] == "report"}
    s_t = json.loads((demo_run / "teacher" / "retireopd.json").read_text())["teacher_success"]
    rho = json.loads((demo_run / "config.json").read_text())["rho"]
    (retirement,) = [e for e in R.read_jsonl(demo_run / "events.jsonl") if e["event"] == "retirement"]
    assert before[True] <= 0.3 and before[False] <= 0.1     # 1. the base model: notes help a little
    assert s_t == sum(teacher_val[-2:]) / 2                  # 2. S_T, recorded
    assert s_t >= before[True] + 0.15                        #    phase 1 makes the teacher
    assert s_t <= 5 / 6                                      #    which ends imperfect (it is short)
    assert student_val[0] <= s_t / 2                         # 3. the student starts far below it
    assert retirement["rule"] == "adaptive" and retirement["criterion_valid"]  # 4. by the authors' rule
    assert retirement["progress"] <= 0 and retirement["competence"] >= rho - R.ROUNDING
    metrics = R.read_jsonl(demo_run / "metrics.jsonl")
    after = [m for m in metrics if m["phase"] == "student" and m["iteration"] >= retirement["retired_at"]]
    assert all(not m["teacher_active"] and m["opd_coef"] == 0 for m in after)  # (none if it fired at the last)
    assert report[("student", False)]["overall"] >= rho * s_t  # 5. the student ends at its teacher's level


@pytest.mark.slow
def test_demo_retirement_is_the_rule_applied_to_the_logged_numbers(demo_run):
    # re-derive the decision from metrics.jsonl alone: blocks of W gaps, judged at validations
    cfg = json.loads((demo_run / "config.json").read_text())
    s_t = json.loads((demo_run / "teacher" / "retireopd.json").read_text())["teacher_success"]
    window, blocks, pending, judged, previous, decided = cfg["window"], [], [], 0, None, None
    for m in (m for m in R.read_jsonl(demo_run / "metrics.jsonl") if m["phase"] == "student" and "gap" in m):
        pending.append(m["gap"])
        if len(pending) == window:
            blocks.append(sum(pending) / window)
            pending = []
        if "val_success" in m and judged < len(blocks):
            if previous is not None:
                progress = (previous[0] - blocks[judged]) / previous[0]
                competence = (m["val_success"] + previous[1]) / (2 * s_t)
                assert m["progress"] == pytest.approx(progress) and m["competence"] == pytest.approx(competence)
                if decided is None and progress <= cfg["alignment_threshold"] and competence >= cfg["rho"] - 1e-9:
                    decided = m["iteration"]
            previous, judged = (blocks[judged], m["val_success"]), judged + 1
    (retirement,) = [e for e in R.read_jsonl(demo_run / "events.jsonl") if e["event"] == "retirement"]
    assert decided is not None and retirement["decided_after_iteration"] == decided
    assert retirement["retired_at"] == decided + 1
