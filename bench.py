"""Time our model calls against the plain Hugging Face ones, on the same inputs: the rollout's
generation, the update (ppo_update) and the log-probs (response_logprobs), with the log-probs' peak
memory. A script beside retireopd.py (nanoGPT's bench.py is the precedent); it takes retireopd.py's
flags, and writes RUN_DIR/benchmark.json:

    python bench.py --model random:small-vocab151k --run-dir runs/bench
    python bench.py --model Qwen2.5-1.5B --env webshop --run-dir runs/bench-1.5b     # on a GPU

Ratios > 1 mean ours is faster (time); the memory ratio is ours / plain (< 1 is leaner).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

import checks
import common
import engine
import memory
import multigpu
import retireopd as R

MEASURABLE_PEAK_GB = 0.01  # the benchmark's memory floor: below it a peak is noise, not a measurement


def benchmark(cfg, repeats: int = 3) -> dict:
    """Time our rollout generation, update and log-probs against the plain Hugging Face calls on
    the same inputs (interleaved repetitions, medians), with peak memory for the log-probs.

    Ratios > 1 mean ours is faster (time) / leaner (memory is ours / plain: < 1 is leaner).
    """
    device = common.pick_device(cfg.device)
    model, tokenizer = R.load_policy(cfg.model, device, torch.float32, cfg.seed)
    if cfg.gradient_checkpointing and device.type == "cuda":
        model.activation_checkpointing_enable()
    rng = random.Random(cfg.seed)
    words = ["go to cabinet", "open drawer", "take mug", "click[b0fsh00001]", "search[red shoes]"]
    prompts = [R.encode_prompt(tokenizer, R.build_user_message(
        "alfworld", "put a clean mug in the coffeemachine", 0, [], "You arrive at countertop 1. " * rng.randint(2, 20),
        [f"{rng.choice(words)} {k}" for k in range(rng.randint(5, 40))]))
        for _ in range(cfg.batch_tasks * cfg.group_size)]
    n_new = cfg.max_response_tokens
    samples = [R.TurnSample(0, i, p, [rng.randrange(len(tokenizer)) for _ in range(n_new)], False)
               for i, p in enumerate(prompts)]
    timings: dict = {name: [] for name in ("ours_generate", "plain_generate", "ours_update",
                                           "plain_update", "ours_logprob", "plain_logprob")}
    peaks = {"ours_logprob": [], "plain_logprob": []}
    optimizer = R.build_adamw(model, dataclasses.replace(cfg, lr=0.0))  # lr 0: measure without moving

    def plain_generate():
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts], device=device)
        with engine.autocast(device):
            out = model.generate(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long(),
                                 do_sample=True, max_new_tokens=n_new, top_k=0, top_p=1.0,
                                 pad_token_id=tokenizer.pad_token_id)
        return int((out[:, width:] != tokenizer.pad_token_id).sum())

    def plain_batch():
        width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        ids = torch.full((len(samples), width), tokenizer.pad_token_id, device=device)
        for b, s in enumerate(samples):
            ids[b, : len(s.prompt_ids) + n_new] = torch.tensor(s.prompt_ids + s.response_ids)
        return ids, (ids != tokenizer.pad_token_id).long()

    def plain_logprobs(ids, mask):  # the naive path: full (batch, seq, vocab) float32 log-softmax
        with engine.autocast(device):
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        return torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)

    def plain_update():
        model.train()
        ids, mask = plain_batch()
        logp = plain_logprobs(ids, mask)
        (-(logp * mask[:, 1:]).sum() / mask.sum()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return int(mask.sum())

    def time_stage(name, fn):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        timings[name].append((time.perf_counter() - start, result))

    old = [torch.zeros(n_new) for _ in samples]
    advantages = [torch.ones(n_new) for _ in samples]
    for _ in range(repeats):
        model.eval()
        time_stage("ours_generate", lambda: sum(len(r.ids) for r in engine.generate(
            model, tokenizer, prompts, n_new, 1.0, prefill_batch=cfg.prefill_batch)))
        time_stage("plain_generate", plain_generate)
        time_stage("ours_update", lambda: R.ppo_update(model, optimizer, samples, old, advantages, cfg,
                                                     mini_batch=cfg.mini_batch)["trained_tokens"])
        time_stage("plain_update", plain_update)
        for name, fn in (("ours_logprob", lambda: R.response_logprobs(model, samples, cfg)),
                         ("plain_logprob", lambda: plain_logprobs(*plain_batch()))):
            gc.collect()
            base = memory.current_memory_gb(device)
            memory.reset_peak_memory(device)
            with torch.no_grad():
                time_stage(name, lambda: (fn(), len(samples) * n_new)[1])
            peaks[name].append(memory.peak_memory_gb(device) - base)
    median = {name: statistics.median(t for t, _ in runs) for name, runs in timings.items()}
    peak = {name: statistics.median(v) for name, v in peaks.items()}
    tokens = {name: runs[-1][1] for name, runs in timings.items()}
    per_s = {name: tokens[name] / median[name] for name in median}
    report = {
        "model": cfg.model, "device": str(device), "sequences": len(prompts), "new_tokens": n_new,
        "tokens_per_s": {k: round(v, 1) for k, v in per_s.items()},
        "rollout_speed_ratio": round(per_s["ours_generate"] / per_s["plain_generate"], 3),
        "update_speed_ratio": round(per_s["ours_update"] / per_s["plain_update"], 3),
        "logprob_speed_ratio": round(median["plain_logprob"] / median["ours_logprob"], 3),
        "logprob_peak_gb": {k: round(v, 4) for k, v in peak.items()},
        # a ratio of two peaks near the measurement's noise (CPU resident-set changes) means
        # nothing, and can even be negative: none below the floor
        "logprob_memory_ratio": round(peak["ours_logprob"] / peak["plain_logprob"], 4)
        if min(peak.values()) >= MEASURABLE_PEAK_GB else None,
    }
    return report


def print_benchmark(report: dict, run_dir: Path) -> None:
    """Print the benchmark's table (tokens/s, medians) and write its report to RUN_DIR/benchmark.json."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "benchmark.json").write_text(json.dumps(report, indent=2))
    speed = report["tokens_per_s"]
    print(f"benchmark of {report['model']} on {report['device']} (tokens/s, medians; "
          f"also in {run_dir / 'benchmark.json'})\n"
          f"  {'stage':<10}{'ours':>12}{'plain':>12}{'ours/plain':>12}")
    for stage, ratio in (("generate", "rollout_speed_ratio"), ("update", "update_speed_ratio"),
                         ("logprob", "logprob_speed_ratio")):
        print(f"  {stage:<10}{speed['ours_' + stage]:>12.0f}{speed['plain_' + stage]:>12.0f}"
              f"{report[ratio]:>12.2f}")
    peak, ratio = report["logprob_peak_gb"], report["logprob_memory_ratio"]
    print(f"  log-prob peak memory (GiB): ours {peak['ours_logprob']}, plain {peak['plain_logprob']}, "
          + (f"ratio {ratio}" if ratio is not None else
             f"no ratio: a peak below {MEASURABLE_PEAK_GB} GiB is too small to measure (use a model with "
             "the real vocabulary, e.g. random:small-vocab151k)"))


def main(argv: Optional[list] = None) -> Path:
    parser = R.build_parser(actions=False)
    parser.prog = "bench.py"
    parser.description = ("Time our rollout generation, update and log-probs against the plain Hugging Face calls, "
                          "with retireopd.py's flags (the model, the batch, the answer length); the report goes to "
                          "RUN_DIR/benchmark.json. Ratios > 1: ours is faster.")
    args = vars(parser.parse_args(argv))
    if multigpu.world_size() > 1:
        raise SystemExit("retireopd: the benchmark runs in one process: start it with python, not torchrun")
    cfg = R.parse_config(args)
    if problem := checks.model_source_problem(cfg.model):
        raise SystemExit(f"retireopd: {problem}")
    checks.check_run_folder(cfg.run_dir, resuming=False)
    print_benchmark(benchmark(cfg), Path(cfg.run_dir))
    return Path(cfg.run_dir)


if __name__ == "__main__":
    main(sys.argv[1:])
