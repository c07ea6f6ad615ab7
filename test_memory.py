"""memory.py: the memory estimate printed before each phase, term by term at the real Qwen2.5 shapes
(on the meta device: no memory), in one process and per process under torchrun."""


import torch

import memory
import retireopd as R
import tiny as built_in_models  # (the name `tiny` is the fixture of the tiny model)


def _meta_model(alias):
    """The real architecture on the meta device: parameter counts and shapes, no memory."""
    shape = built_in_models.QWEN25_SHAPES[alias]
    with torch.device("meta"):
        return R.transformers.Qwen2ForCausalLM(R.transformers.Qwen2Config(**shape))


def test_memory_estimate_counts_the_prefill_and_the_optimizer_temporaries(tmp_path):
    model = _meta_model("Qwen2.5-1.5B")  # hidden 1536, intermediate 8960, 28 layers, 2 KV heads of 128
    cfg = R.parse_config({"model": "random:Qwen2.5-1.5B", "env": "webshop", "run_dir": str(tmp_path),
                          "eval_batch": 128})  # (validations as large as the rollout: see the evaluation test)
    assert (cfg.batch_tasks * cfg.group_size, cfg.prefill_batch, cfg.max_prompt_tokens) == (128, 16, 4096)
    cuda = memory.estimate_memory_gb(model, cfg, n_frozen=1, skill_tokens=1024, device=torch.device("cuda"))
    # the eager sampler's KV cache: 128 rows x (5120 + 512) positions x 29 layers (one more: each decode step's
    # concatenation copies one) x 2 KV heads x 128 x (4 B keys under autocast + 2 B values) = 29.91 GiB
    assert cuda["kv_cache"] == 29.91 and cuda["eval_kv_cache"] == 29.91
    # prefill: 16 rows x 5120 tokens x (12*1536 + 6*8960 + 5120 mask) B = 6,333,399,040 B = 5.90 GiB
    assert cuda["prefill"] == 5.9
    # all 128 rows at once: 8x the rows, 47.19 GiB
    one_shot = memory.estimate_memory_gb(model, R.dataclasses.replace(cfg, prefill_batch=0), 1, 1024, torch.device("cuda"))
    assert one_shot["prefill"] == 47.19
    # fused AdamW on CUDA: no temporaries; the CPU loop: sqrt(v) and its quotient for the
    # 151936 x 1536 embedding, 2 x 4 x 233,373,696 B = 1.74 GiB
    cpu = memory.estimate_memory_gb(model, cfg, 1, 1024, torch.device("cpu"))
    assert (cuda["optimizer_temporaries"], cpu["optimizer_temporaries"]) == (0, 1.74)
    # the stages never overlap: resident + the largest (here the rollout; the evaluation ties with it)
    rollout = cuda["kv_cache"] + cuda["prefill"] + cuda["sampling"]
    assert cuda["peak_stage"] == "rollout" and rollout > cuda["activations"] + cuda["logits"]
    assert rollout == cuda["eval_kv_cache"] + cuda["eval_prefill"] + cuda["eval_sampling"]
    assert cuda["total"] == round(cuda["policy_and_adam"] + cuda["frozen_models"] + rollout, 2)
    run = R.Run(R.dataclasses.replace(cfg, run_dir=str(tmp_path)))
    run.log_memory_estimate(model, "phase 1", R.FrozenModels(reference=model), skill_tokens=1024)
    (event,) = R.read_jsonl(tmp_path / "events.jsonl")
    assert event["event"] == "memory_estimate" and event["gib"] == cpu
    text = memory.format_memory_estimate(cpu)
    assert f"{cpu['total']} GiB" in text and "prefill 5.9" in text and "optimizer_temporaries 1.74" in text


def test_memory_estimate_per_process_under_torchrun():
    model = _meta_model("Qwen2.5-1.5B")  # 1,543,714,304 parameters; the tied embedding 151936 x 1536
    cfg = R.parse_config({"model": "random:Qwen2.5-1.5B", "env": "webshop", "run_dir": "/tmp/unused",
                          "eval_batch": 128})
    one = memory.estimate_memory_gb(model, cfg, 1, 1024, torch.device("cuda"))
    four = memory.estimate_memory_gb(model, cfg, 1, 1024, torch.device("cuda"), processes=4)
    assert (one["processes"], one["sampling_copy"], one["gathered"]) == (1, 0, 0)  # one process: as before
    # weights, gradient and AdamW moments sharded: 16 B x 1,543,714,304 / 4 = 6,174,857,216 B = 5.75 GiB
    # (no bf16 weight copy: autocast's cache is off); the frozen model's 4 B/param / 4 = 1.44 GiB
    assert (four["policy_and_adam"], four["frozen_models"]) == (5.75, 1.44)
    # the sampling copy, whole on every rank: 2 B x 1,310,253,056 Linear weights + 4 B x 233,461,248 others
    # (embedding, norms) = 3,554,351,104 B = 3.31 GiB (4 B/param on CPU: 5.75)
    assert four["sampling_copy"] == 3.31
    assert memory.estimate_memory_gb(model, cfg, 1, 1024, torch.device("cpu"), processes=4)["sampling_copy"] == 5.75
    # gathered in a forward/backward, weights and gradients in fp32: 8 B x (2 layers x 46,797,824 + the root's
    # 233,375,232: embedding and final norm) = 2,615,767,040 B = 2.44 GiB
    assert four["gathered"] == 2.44
    # each rank plays 128 / 4 = 32 episodes: a quarter of the KV cache (7.48 GiB), the same 16-row prefill
    assert four["kv_cache"] == round(one["kv_cache"] / 4, 2) == 7.48 and four["prefill"] == one["prefill"]
    assert four["eval_kv_cache"] == 7.48  # and a quarter of each validation batch
    assert four["total"] == round(5.75 + 1.44 + 3.31 + four["kv_cache"] + four["prefill"] + four["sampling"], 2)
    assert "per process of 4" in memory.format_memory_estimate(four) and "sampling_copy 3.31" in memory.format_memory_estimate(four)


def test_memory_estimate_knows_the_evaluation_batch_and_the_static_sampler():
    model = _meta_model("Qwen2.5-1.5B")
    cfg = R.parse_config({"model": "random:Qwen2.5-1.5B", "env": "webshop", "run_dir": "/tmp/unused"})
    assert cfg.eval_batch == 256 and cfg.sampler == "eager"
    cuda = torch.device("cuda")
    eager = memory.estimate_memory_gb(model, cfg, 1, 1024, cuda)
    # a validation of 256 episodes: twice the rollout's KV cache (2 x 29.91) and sampling tensors, the same prefill
    assert (eager["eval_kv_cache"], eager["eval_prefill"]) == (59.81, eager["prefill"])
    assert eager["peak_stage"] == "evaluation" and eager["sampling_copy"] == 0
    assert eager["total"] == round(eager["policy_and_adam"] + eager["frozen_models"] + eager["eval_kv_cache"]
                                   + eager["eval_prefill"] + eager["eval_sampling"], 2)
    assert "evaluation: eval_kv_cache 59.81" in memory.format_memory_estimate(eager)
    # --eval-batch 64: two batches of 64 per 128-task panel, half the rollout's cache; the rollout is the peak again
    small = memory.estimate_memory_gb(model, R.dataclasses.replace(cfg, eval_batch=64), 1, 1024, cuda)
    assert small["eval_kv_cache"] == 14.95 and small["peak_stage"] == "rollout"
    # the static sampler on a GPU: keys and values in bf16, no extra layer: 128 rows x 5632 positions (a multiple
    # of 512 already) x 28 layers x 2 KV heads x 128 x 2 (K, V) x 2 B = 20,669,530,112 B = 19.25 GiB; and its
    # sampling copy, 2 B per Linear weight + 4 B for the rest = 3.31 GiB, resident
    static = memory.estimate_memory_gb(model, R.dataclasses.replace(cfg, sampler="static"), 1, 1024, cuda)
    assert (static["kv_cache"], static["sampling_copy"]) == (19.25, 3.31)
    # 100 rows are run as 128 (engine.row_bucket)
    assert memory.estimate_memory_gb(model, R.dataclasses.replace(cfg, sampler="static", eval_batch=100), 1, 1024,
                                     cuda)["eval_kv_cache"] == 19.25
    # auto: static on a GPU, eager on CPU (fp32 keys + bf16 values)
    auto = R.dataclasses.replace(cfg, sampler="auto")
    assert memory.estimate_memory_gb(model, auto, 1, 1024, cuda)["kv_cache"] == 19.25
    assert memory.estimate_memory_gb(model, auto, 1, 1024, torch.device("cpu"))["kv_cache"] == 29.91
