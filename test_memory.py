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
    cfg = R.parse_config({"model": "random:Qwen2.5-1.5B", "env": "webshop", "run_dir": str(tmp_path)})
    assert (cfg.batch_tasks * cfg.group_size, cfg.prefill_batch, cfg.max_prompt_tokens) == (128, 16, 4096)
    cuda = memory.estimate_memory_gb(model, cfg, n_frozen=1, skill_tokens=1024, device=torch.device("cuda"))
    # prefill: 16 rows x 5120 tokens x (12*1536 + 6*8960 + 5120 mask) B = 6,333,399,040 B = 5.90 GiB
    assert cuda["prefill"] == 5.9
    # all 128 rows at once: 8x the rows, 47.19 GiB
    one_shot = memory.estimate_memory_gb(model, R.dataclasses.replace(cfg, prefill_batch=0), 1, 1024, torch.device("cuda"))
    assert one_shot["prefill"] == 47.19
    # fused AdamW on CUDA: no temporaries; the CPU loop: sqrt(v) and its quotient for the
    # 151936 x 1536 embedding, 2 x 4 x 233,373,696 B = 1.74 GiB
    cpu = memory.estimate_memory_gb(model, cfg, 1, 1024, torch.device("cpu"))
    assert (cuda["optimizer_temporaries"], cpu["optimizer_temporaries"]) == (0, 1.74)
    # the stages never overlap: resident + the largest (here the rollout)
    rollout = cuda["kv_cache"] + cuda["prefill"] + cuda["sampling"]
    assert cuda["peak_stage"] == "rollout" and rollout > cuda["activations"] + cuda["logits"]
    assert cuda["total"] == round(cuda["policy_and_adam"] + cuda["frozen_models"] + rollout, 2)
    run = R.Run(R.dataclasses.replace(cfg, run_dir=str(tmp_path)))
    run.log_memory_estimate(model, "phase 1", R.FrozenModels(reference=model), skill_tokens=1024)
    (event,) = R.read_jsonl(tmp_path / "events.jsonl")
    assert event["event"] == "memory_estimate" and event["gib"] == cpu
    text = memory.format_memory_estimate(cpu)
    assert f"{cpu['total']} GiB" in text and "prefill 5.9" in text and "optimizer_temporaries 1.74" in text


def test_memory_estimate_per_process_under_torchrun():
    model = _meta_model("Qwen2.5-1.5B")  # 1,543,714,304 parameters; the tied embedding 151936 x 1536
    cfg = R.parse_config({"model": "random:Qwen2.5-1.5B", "env": "webshop", "run_dir": "/tmp/unused"})
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
    assert four["total"] == round(5.75 + 1.44 + 3.31 + four["kv_cache"] + four["prefill"] + four["sampling"], 2)
    assert "per process of 4" in memory.format_memory_estimate(four) and "sampling_copy 3.31" in memory.format_memory_estimate(four)
