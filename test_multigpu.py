"""multigpu.py: several processes, torchrun with 2 processes, gloo on CPU, FSDP2-sharded tiny models.
The sharded update equals the one-process update; a 2-process run and its resume after a kill (slow:
subprocesses); with one process, every helper changes nothing (fast)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import multigpu
import retireopd as R
from conftest import QUICK, comparable, phases


SHARDED_UPDATE = '''
"""One ppo_update (GRPO + OPD) of the tiny model on a fixed global batch of 7 turn-samples: in one
process (python), or sharded over the processes of torchrun, each holding its part of the batch."""
import random, sys
import torch
sys.path.insert(0, sys.argv[2])
import multigpu
import retireopd as R

torch.set_num_threads(1)
if multigpu.world_size() > 1:
    torch.distributed.init_process_group("gloo")
cfg = R.Config(model="tiny", env="webshop", token_budget=48, entropy_coef=0.001, kl_coef=0.0, ppo_epochs=2, lr=1e-3)
device = torch.device("cpu")
policy, _ = R.load_policy("tiny", device, torch.float32, seed=0)
teacher, _ = R.load_policy("tiny", device, torch.float32, seed=1)
teacher.requires_grad_(False)
rng = random.Random(7)  # the global batch: prompts and responses of different lengths
batch = [R.TurnSample(group=g, episode=g, prompt_ids=[rng.randrange(1000) for _ in range(rng.randrange(3, 20))],
                      response_ids=[rng.randrange(1000) for _ in range(rng.randrange(1, 9))], malformed=False)
         for g in range(7)]
for sample in batch:
    sample.teacher_prompt_ids = [5, 6] + sample.prompt_ids
advantages = [torch.full((len(s.response_ids),), a) for s, a in zip(batch, (1.0, -0.5, 0.3, -1.2, 0.8, 0.1, -0.4))]
mine = slice(0, 5) if multigpu.rank() == 0 else slice(5, 7)  # rank 0 holds 5 samples, rank 1 two
if multigpu.world_size() > 1:
    multigpu.shard(policy, device, R.score_tokens), multigpu.shard(teacher, device, R.score_tokens)
    batch, advantages = batch[mine], advantages[mine]
old_logp = R.response_logprobs(policy, batch, cfg)
teacher_logp = R.response_logprobs(teacher, batch, cfg, teacher_prompt=True)
optimizer = R.build_adamw(policy, cfg)
stats = R.ppo_update(policy, optimizer, batch, old_logp, advantages, cfg, mini_batch=3, teacher_logp=teacher_logp,
                     opd_coef=0.1, rng=random.Random(0))
weights = multigpu.full_state_dict(policy) or {k: v.detach() for k, v in policy.named_parameters()}
if multigpu.main_process():
    torch.save({"weights": weights, "stats": stats}, sys.argv[1])
multigpu.stop_processes()
multigpu.exit_at_once()  # (as retireopd.py ends under torchrun)
'''


def torchrun(*args, processes=2, timeout=600, **kwargs):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", *args]
    return subprocess.run(command, cwd=Path(__file__).parent, capture_output=True, text=True, timeout=timeout,
                          **kwargs)
    return done


@pytest.mark.slow
def test_the_sharded_update_is_the_one_process_update(tmp_path):
    script = tmp_path / "sharded_update.py"
    script.write_text(SHARDED_UPDATE)
    here = str(Path(__file__).parent)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "one.pt"), here], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-8000:]
    done = torchrun(str(script), str(tmp_path / "two.pt"), here)
    assert done.returncode == 0, done.stderr[-8000:]
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    # 7 samples, mini-batches of 3 drawn from the global batch, 2 epochs: 6 optimizer steps on both
    assert one["stats"]["optimizer_steps"] == two["stats"]["optimizer_steps"] == 6
    for key in ("loss", "pg_loss", "opd_loss", "entropy", "grad_norm", "approx_kl_old", "trained_tokens"):
        assert two["stats"][key] == pytest.approx(one["stats"][key], rel=1e-5, abs=1e-7), key
    assert one["weights"].keys() == two["weights"].keys()
    start = R.load_policy("tiny", torch.device("cpu"), torch.float32, seed=0)[0].state_dict()
    assert max(float((w - start[k]).abs().max()) for k, w in one["weights"].items()) > 3e-3  # 6 steps of lr 1e-3
    assert_the_same_weights(one["weights"], two["weights"])


def assert_the_same_weights(one: dict, two: dict) -> None:
    """The same update: equal up to the order of float sums. Not the keys' biases: their gradient is zero in
    exact arithmetic (a bias added to every key shifts every attention score of a query alike, which the
    softmax ignores), so AdamW turns rounding noise of either sign into steps of about lr (measured: 5e-3
    after 6 steps, 1.25e-5 apart between 1 and 2 processes on one CPU, within 1e-5 on another)."""
    compared = [key for key in one if not key.endswith("k_proj.bias")]
    assert len(compared) == len(one) - 2  # (the tiny model's two layers)
    for key in compared:
        assert torch.allclose(two[key], one[key], atol=1e-5), key


@pytest.mark.slow
def test_the_sharded_update_is_the_one_process_update_with_the_authors_aggregation(tmp_path):
    # groups of 2 rows are cut from the global mini-batch's order, so 2 processes form the same ones as 1
    script = SHARDED_UPDATE.replace('lr=1e-3)', 'lr=1e-3, loss_agg="authors", micro_batch_rows=2)')
    assert script != SHARDED_UPDATE
    (tmp_path / "authors.py").write_text(script)
    here = str(Path(__file__).parent)
    done = subprocess.run([sys.executable, str(tmp_path / "authors.py"), str(tmp_path / "one.pt"), here],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-8000:]
    done = torchrun(str(tmp_path / "authors.py"), str(tmp_path / "two.pt"), here)
    assert done.returncode == 0, done.stderr[-8000:]
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    for key in ("loss", "pg_loss", "opd_loss", "entropy", "grad_norm", "trained_tokens"):
        assert two["stats"][key] == pytest.approx(one["stats"][key], rel=1e-5, abs=1e-7), key
    assert_the_same_weights(one["weights"], two["weights"])
    (tmp_path / "exact.py").write_text(SHARDED_UPDATE)  # and the aggregation is not the exact one's
    done = subprocess.run([sys.executable, str(tmp_path / "exact.py"), str(tmp_path / "exact.pt"), here],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-8000:]
    assert abs(torch.load(tmp_path / "exact.pt")["stats"]["loss"] - one["stats"]["loss"]) > 1e-4


TORCHRUN_FLAGS = QUICK + ["--env", "webshop", "--batch-tasks", "2", "--mini-batch", "4", "--opd-mini-batch", "4",
                          "--eval-episodes", "5", "--eval-batch", "4"]  # panels of 5, in batches of 4: shares of
# 2+2, then 1+0


@pytest.mark.slow
def test_two_processes_run_retireopd_on_webshop(tmp_path):
    run_dir = tmp_path / "two"
    done = torchrun("retireopd.py", *TORCHRUN_FLAGS, "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr[-8000:]
    assert done.stdout.count("[retireopd] done in") == 1  # rank 0 alone prints
    metrics = R.read_jsonl(run_dir / "metrics.jsonl")
    assert phases(metrics) == [("teacher", k) for k in range(3)] + [("student", k) for k in range(3)]
    for m in metrics:  # the global count: B*G = 4 episodes of `turns` turns each, 2 on each process
        assert m["samples"] == round(m["turns"] * 2 * 2) and m["samples"] >= 4
    assert all(m["gap"] is not None for m in metrics if m["phase"] == "student")
    evaluations = R.read_jsonl(run_dir / "eval.jsonl")  # each of the whole panel: phase 1 before training and 3
    assert len(evaluations) == 2 * 4 + 1 + 3 + 1 and all(e["n"] == 5 for e in evaluations)  # times, with skills
    # and without; its report; phase 2's 3 validations; its report
    student = R.transformers.AutoModelForCausalLM.from_pretrained(run_dir / "student")
    assert type(student).__name__ == "Qwen2ForCausalLM"
    assert json.loads((run_dir / "student" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    (checkpoint,) = [c for c in sorted((run_dir / "checkpoints").iterdir()) if c.name.endswith("00002")][-1:]
    trainer = torch.load(checkpoint / "trainer.pt", weights_only=False)
    assert trainer["world_size"] == 2 and len(trainer["rng"]) == 2  # one sampling stream per process
    assert not torch.equal(trainer["rng"][0]["torch"], trainer["rng"][1]["torch"])
    assert set(trainer["optimizer"]["state"]) == {k for k, _ in student.named_parameters()}  # whole, by name


@pytest.mark.slow
def test_a_killed_two_process_run_resumes_as_if_never_stopped(tmp_path):
    flags = [*TORCHRUN_FLAGS, "--iterations", "5"]
    whole = tmp_path / "whole"
    assert torchrun("retireopd.py", *flags, "--run-dir", str(whole)).returncode == 0
    killed = tmp_path / "killed"
    process = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                "retireopd.py", *flags, "--run-dir", str(killed)], cwd=Path(__file__).parent,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "0-teacher-00001").is_dir() and time.time() < deadline:
        time.sleep(0.02)
    kill = subprocess.run(["pkill", "-9", "-f", f"run-dir {killed}"])  # the launcher and both workers at once
    assert kill.returncode == 0
    process.wait(timeout=60)
    assert not any(e["event"] == "done" for e in R.read_jsonl(killed / "events.jsonl"))
    one = subprocess.run([sys.executable, "retireopd.py", "--resume", str(killed)], cwd=Path(__file__).parent,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 1 and "written by 2 process(es)" in one.stderr.strip().splitlines()[-1]
    done = torchrun("retireopd.py", "--resume", str(killed))
    assert done.returncode == 0, done.stderr[-8000:]
    assert "resuming" in done.stdout
    # the same lines as the uninterrupted run: each process's RNG restored too
    assert comparable(R.read_jsonl(killed / "metrics.jsonl")) == comparable(R.read_jsonl(whole / "metrics.jsonl"))


def test_one_process_helpers_change_nothing():
    assert (multigpu.world_size(), multigpu.rank(), multigpu.main_process()) == (1, 0, True)
    tasks = list(range(8))
    assert multigpu.share_of_tasks(tasks) == tasks
    samples = [R.TurnSample(0, 0, [1], [2, 3], False), R.TurnSample(0, 1, [1], [4], False)]
    assert multigpu.global_batch(samples) == (0, [2, 1])
    idle = []
    assert list(multigpu.in_lockstep([[0], [1]], lambda: idle.append(1))) == [[0], [1]] and idle == []
    assert multigpu.sum_over_ranks(1, 2.5) == [1, 2.5] and multigpu.max_over_ranks(3) == 3 and multigpu.all_ranks(True)
    assert torch.equal(multigpu.cat_over_ranks([torch.ones(2), torch.zeros(1)]), torch.tensor([1.0, 1.0, 0.0]))
    model, _ = R.load_policy("tiny", torch.device("cpu"), torch.float32)
    assert multigpu.sampling_model(model) is model and multigpu.full_state_dict(model) is None and not multigpu.sharded(model)
