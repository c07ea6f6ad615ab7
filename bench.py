"""The GPU probe: what one iteration and one run of retireopd.py cost on this machine, measured with
random weights (no download, the `random:` shapes) and projected onto docs/cost.md's cases. A script beside
retireopd.py (nanoGPT's bench.py is the precedent); it takes retireopd.py's flags, prints its figures and
writes RUN_DIR/benchmark.json:

    python bench.py --run-dir runs/probe        # a GPU: random:Qwen2.5-1.5B at B*G = 128 (about 5 minutes)
    python bench.py --model random:Qwen2.5-3B --run-dir runs/probe-3b
    python bench.py --run-dir runs/probe        # a CPU: the tiny model at toy sizes (seconds)

It measures, for each sampler (engine.py: eager, static), the decode step at B*G rows with ALFWorld-like
and WebShop-like prompts and at 8 rows (the same figure at both batch sizes: the step is bound by the
CPU's dispatch, not the GPU), and the first call (a compile, a CUDA-graph capture); the prefill; the
scoring pass of the policy and of a frozen teacher; the update; the sampling-vs-scoring log-prob gap;
each stage's peak memory against memory.estimate_memory_gb. From these it projects an iteration and a
whole run (both phases, validations and reports) for ALFWorld and WebShop, upper bound and likely.
--versus-plain instead times our model calls against plain Hugging Face ones (the earlier benchmark).
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
from typing import NamedTuple, Optional

import torch

import common
import engine
import memory
import model_sources
import multigpu
import retireopd as R
import run_folder
import settings

MEASURABLE_PEAK_GB = 0.01  # the benchmark's memory floor: below it a peak is noise, not a measurement


# ==================================================================================================
# The probe: measured figures
# ==================================================================================================


class ProbeSizes(NamedTuple):
    rows: int  # the lock-step batch, B*G
    small_rows: int  # a small batch: the same ms per step as at `rows` means the step is bound by the CPU
    widths: tuple  # prompt tokens: ALFWorld-like (about 600), WebShop-like (about 2,000)
    short: int  # new tokens of two generates: the difference of their times is (long - short) decode steps
    long: int
    answer: int  # response tokens of the samples that are scored and updated
    skill_tokens: int  # the teacher's prompt is longer by a skill block (docs/cost.md: 177 on ALFWorld)


GPU_SIZES = ProbeSizes(rows=128, small_rows=8, widths=(600, 2000), short=4, long=36, answer=150, skill_tokens=177)
CPU_SIZES = ProbeSizes(rows=8, small_rows=2, widths=(40, 120), short=2, long=8, answer=8, skill_tokens=16)
SAMPLERS = ("eager", "static")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rounded(gib: Optional[float], digits: int = 2) -> Optional[float]:
    return None if gib is None else round(gib, digits)  # (None: a platform without the figure, memory.py)


def measure(device: torch.device, fn):
    """(fn's result, its seconds, its peak memory above what was allocated when it started, GiB, or None where
    the platform gives no figure)."""
    gc.collect()
    synchronize(device)
    base = memory.current_memory_gb(device)
    memory.reset_peak_memory(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start, memory.memory_above(memory.peak_memory_gb(device), base)


def random_prompts(rng: random.Random, vocabulary: int, rows: int, width: int) -> list:
    """Prompts of random token ids, `width` long to a quarter shorter (a batch is left padded to its longest)."""
    return [[rng.randrange(vocabulary) for _ in range(width - rng.randint(0, width // 4))] for _ in range(rows)]


def gap_statistics(samples: list, scored: list) -> dict:
    """|l^sample - l^old| over every token: the log-prob recorded while sampling against the scoring pass's."""
    differences = torch.cat([(s.sample_logp - old).abs() for s, old in zip(samples, scored)])
    return {"mean": float(differences.mean()), "p99": float(differences.quantile(0.99)),
            "max": float(differences.max())}


def decode_probe(model, tokenizer, cfg, sizes: ProbeSizes, sampler: str, rng: random.Random) -> dict:
    """Per shape (rows x prompt width): the first call's seconds (on a GPU the static sampler compiles or captures
    there), the decode step in ms (two generates of `short` and `long` new tokens: their difference over the
    steps between them), the prefill's tokens/s (what the short generate spent beyond its steps), the peak
    memory of the long one; at the first shape also the sampling-vs-scoring gap of its samples."""
    device = next(model.parameters()).device
    shapes = [(sizes.rows, sizes.widths[0]), (sizes.small_rows, sizes.widths[0]), (sizes.rows, sizes.widths[1])]
    result = {}
    for rows, width in shapes:
        prompts = random_prompts(rng, len(tokenizer), rows, width)

        def generate(new_tokens):
            torch.manual_seed(cfg.seed)
            return engine.generate(model, tokenizer, prompts, new_tokens, 1.0, prefill_batch=cfg.prefill_batch,
                                   sampler=sampler)

        _, first, _ = measure(device, lambda: generate(sizes.short))
        short, t_short, _ = measure(device, lambda: generate(sizes.short))
        long, t_long, peak = measure(device, lambda: generate(sizes.long))
        steps_short, steps_long = (max(len(s.ids) for s in out) for out in (short, long))
        ms = 1000 * (t_long - t_short) / max(steps_long - steps_short, 1)
        prefill_s = max(t_short - steps_short * ms / 1000, 1e-6)
        shape = {"first_call_s": round(first, 2), "ms_per_step": round(ms, 2),
                 "prefill_tokens_per_s": round(sum(map(len, prompts)) / prefill_s), "peak_gb": rounded(peak)}
        if not result:
            samples = [R.TurnSample(0, i, p, s.ids, False, sample_logp=s.logp) for i, (p, s) in enumerate(zip(prompts, long))]
            shape["gap"] = gap_statistics(samples, R.response_logprobs(model, samples, cfg))
        result[f"{rows}x{width}"] = shape
    return result


def head_probe(model, cfg, sizes: ProbeSizes, rng: random.Random) -> Optional[dict]:
    """On a GPU: the output head's log-probs in fp32 against TF32 (engine.use_tf32_head), and ms per 1,000 tokens."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return None
    ids = torch.tensor([[rng.randrange(model.config.vocab_size) for _ in range(512)] for _ in range(8)], device=device)
    with torch.no_grad(), engine.autocast(device):
        hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state.flatten(0, 1)
    previous, out = torch.backends.cuda.matmul.allow_tf32, {}
    for tf32 in (False, True):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        with torch.no_grad():
            R.head_logprobs(hidden, ids.flatten(), model.get_output_embeddings(), cfg.logprob_chunk)
            out[tf32] = measure(device, lambda: R.head_logprobs(hidden, ids.flatten(), model.get_output_embeddings(),
                                                                 cfg.logprob_chunk))
    torch.backends.cuda.matmul.allow_tf32 = previous
    difference = (out[True][0] - out[False][0]).abs()
    per_1k = {name: round(1e6 * out[tf32][1] / len(difference), 3) for name, tf32 in (("fp32", False), ("tf32", True))}
    return {"ms_per_1k_tokens": per_1k, "difference_mean": float(difference.mean()),
            "difference_max": float(difference.max())}


def training_probe(model, tokenizer, cfg, sizes: ProbeSizes, rng: random.Random) -> dict:
    """B*G samples of an ALFWorld-like prompt and `answer` tokens: the scoring pass of the policy (l^old) and of a
    frozen teacher (--frozen-dtype, on prompts longer by a skill block), in tokens/s; then the update (one
    optimizer step over them, lr 0, after one untimed step that allocates AdamW's state), in s per 1,000 tokens."""
    device = next(model.parameters()).device
    prompts = random_prompts(rng, len(tokenizer), sizes.rows, sizes.widths[0])
    samples = [R.TurnSample(0, i, p, [rng.randrange(len(tokenizer)) for _ in range(sizes.answer)], False,
                            teacher_prompt_ids=[rng.randrange(len(tokenizer)) for _ in range(sizes.skill_tokens)] + p)
               for i, p in enumerate(prompts)]
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    teacher_tokens = sum(len(s.teacher_prompt_ids) + len(s.response_ids) for s in samples)
    old, t_old, peak_old = measure(device, lambda: R.response_logprobs(model, samples, cfg))
    with torch.device(device):
        teacher, _ = R.load_policy(cfg.model, device, getattr(torch, cfg.frozen_dtype), cfg.seed + 1)
    teacher.requires_grad_(False).eval()
    _, t_teacher, peak_teacher = measure(device, lambda: R.response_logprobs(teacher, samples, cfg, teacher_prompt=True))
    del teacher
    optimizer = R.build_adamw(model, dataclasses.replace(cfg, lr=0.0))  # lr 0: measure without moving
    advantages = [torch.ones(sizes.answer) for _ in samples]

    def update():
        return R.ppo_update(model, optimizer, samples, old, advantages, cfg, mini_batch=len(samples))

    _, _, peak_first = measure(device, update)  # (AdamW's moments and the gradients are allocated here)
    _, t_update, peak_update = measure(device, update)
    model.eval()
    return {"sequence_tokens": tokens, "scoring_tokens_per_s": {"policy": round(tokens / t_old),
                                                                 "teacher": round(teacher_tokens / t_teacher)},
            "update_s_per_1k_tokens": round(1000 * t_update / tokens, 4),
            "peak_gb": {"policy_scoring": rounded(peak_old), "teacher_scoring": rounded(peak_teacher),
                        "first_update": rounded(peak_first), "update": rounded(peak_update)}}


def memory_check(model, cfg, sizes: ProbeSizes, decode: dict, training: dict) -> dict:
    """Each stage's measured peak (above what was allocated before it) against memory.estimate_memory_gb's parts
    for the probe's own shapes: a rollout at B*G rows of the WebShop-like prompt, and the update (whose first step
    also allocates the gradients and AdamW's moments, 12 B/param, resident in a run)."""
    device = next(model.parameters()).device
    shape = f"{sizes.rows}x{sizes.widths[1]}"
    out = {}
    for sampler in SAMPLERS:
        probe_cfg = dataclasses.replace(cfg, max_prompt_tokens=sizes.widths[1], max_response_tokens=sizes.long,
                                        sampler=sampler, token_budget=cfg.token_budget)
        estimate = memory.estimate_memory_gb(model, probe_cfg, n_frozen=0, device=device)
        out[f"rollout_{sampler}"] = {"measured": decode[sampler][shape]["peak_gb"],
                                     "estimated": round(estimate["kv_cache"] + estimate["prefill"]
                                                        + estimate["sampling"], 2)}
    n_params = sum(p.numel() for p in model.parameters())
    out["first_update"] = {"measured": training["peak_gb"]["first_update"],
                           "estimated": round(estimate["activations"] + estimate["logits"]
                                              + 12 * n_params / 2**30, 2)}
    return out


# ==================================================================================================
# The probe: projected iterations and runs
# ==================================================================================================


class Workload(NamedTuple):
    """One row of docs/cost.md's table: what an iteration of B*G episodes does."""
    env: str
    case: str
    prompt: int  # the student's prompt, tokens (the mean over the shared games' expert replays)
    teacher_prompt: int  # with the skill block
    turns: float  # turns an episode plays, on average (each one a turn-sample)
    lockstep_turns: int  # turns the lock-step loop runs (to the last turn while any episode plays)
    answer: int  # tokens of an answer, on average
    longest_answer: int  # decode steps of a turn: the batch decodes to its longest answer
    env_s_per_turn: float  # stepping B*G = 128 episodes once (ALFWorld in one process; WebShop: negligible)
    env_reset_s: float  # resetting 128 episodes
    validation_panel: int
    report_panel: int


WORKLOADS = (
    Workload("alfworld", "upper bound", 373, 550, 50, 50, 512, 512, 1.9, 13.0, 140, 274),
    Workload("alfworld", "likely", 373, 550, 30, 50, 150, 400, 1.9, 13.0, 140, 274),
    Workload("webshop", "upper bound", 1010, 1157, 15, 15, 512, 512, 0.0, 0.0, 128, 500),
    Workload("webshop", "likely", 1010, 1157, 8, 15, 150, 400, 0.0, 0.0, 128, 500),
)


def step_ms(decode: dict, sizes: ProbeSizes, rows: int, width: int) -> float:
    """The decode step at `rows` x `width` cached positions, from the three measured shapes: linear in the width
    between the two B*G shapes, and in the rows from the small batch to B*G (extrapolated beyond)."""
    wide, narrow = sizes.widths[1], sizes.widths[0]
    at_rows = {w: decode[f"{sizes.rows}x{w}"]["ms_per_step"] for w in (narrow, wide)}
    full = at_rows[narrow] + (at_rows[wide] - at_rows[narrow]) * (width - narrow) / (wide - narrow)
    small = decode[f"{sizes.small_rows}x{narrow}"]["ms_per_step"]
    return max(small + (full - small) * (rows - sizes.small_rows) / (sizes.rows - sizes.small_rows), small, 0.0)


def project(decode: dict, training: dict, sizes: ProbeSizes, work: Workload, cfg) -> dict:
    """Seconds of one iteration by stage, and hours of a RetireOPD run (phase 1 and phase 2, --iterations each),
    for B*G = 128 episodes. Every turn decodes its longest answer at all 128 rows (an upper bound: episodes
    that ended stop playing, but a lock-step step costs about the same); the prefill runs every active
    prompt; each turn-sample is scored by the policy and by the reference (phase 1) or the teacher (phase 2,
    charged to the whole phase, as --algo grpo+opd pays it) and updated once. Validations every
    --eval-every iterations and a report at each phase's end play their panel in ceil(n / --eval-batch)
    lock-step batches; phase 1 validates twice (with and without skills) and once before training."""
    rows = 128
    prefill_rate = decode[f"{sizes.rows}x{sizes.widths[0]}"]["prefill_tokens_per_s"]
    scoring = training["scoring_tokens_per_s"]

    def rollout_s(prompt: int, episodes: int, turns: int) -> dict:
        ms = step_ms(decode, sizes, episodes, prompt + work.longest_answer // 2)
        return {"decode": turns * work.longest_answer * ms / 1000,
                "prefill": turns * episodes * prompt / prefill_rate,
                "env": (work.env_reset_s + turns * work.env_s_per_turn) * episodes / rows}

    def iteration_s(prompt: int, frozen_prompt: int) -> dict:
        samples = rows * work.turns
        tokens, frozen_tokens = samples * (prompt + work.answer), samples * (frozen_prompt + work.answer)
        return {**rollout_s(prompt, rows, work.lockstep_turns),
                "scoring": tokens / scoring["policy"] + frozen_tokens / scoring["teacher"],
                "update": tokens / 1000 * training["update_s_per_1k_tokens"]}

    def panel_s(panel: int, prompt: int) -> float:
        batches = -(-panel // cfg.eval_batch)
        return sum(sum(rollout_s(prompt, -(-panel // batches), work.lockstep_turns).values()) for _ in range(batches))

    validations = cfg.iterations // cfg.eval_every
    phase1 = iteration_s(work.teacher_prompt, work.teacher_prompt)  # the policy reads skills, and so its reference
    phase2 = iteration_s(work.prompt, work.teacher_prompt)  # the teacher reads skills
    eval1 = ((validations + 1) * (panel_s(work.validation_panel, work.teacher_prompt)
                                  + panel_s(work.validation_panel, work.prompt))
             + panel_s(work.report_panel, work.teacher_prompt))
    eval2 = validations * panel_s(work.validation_panel, work.prompt) + panel_s(work.report_panel, work.prompt)
    hours = [(cfg.iterations * sum(phase.values()) + evaluation) / 3600
             for phase, evaluation in ((phase1, eval1), (phase2, eval2))]
    return {"env": work.env, "case": work.case, "iteration_s": {k: round(v, 1) for k, v in phase2.items()},
            "iteration_total_s": round(sum(phase2.values()), 1), "evaluation_h": round((eval1 + eval2) / 3600, 2),
            "phase_h": [round(h, 2) for h in hours], "run_h": round(sum(hours), 1)}


def probe(cfg, sizes: ProbeSizes, run_dir: Path) -> dict:
    """The probe's report: the figures measured on this machine, each stage's memory, the projections. Each
    stage's figures are written to RUN_DIR/benchmark.json and printed as soon as they are measured."""
    device = common.pick_device(cfg.device)
    engine.use_tf32_head(device)  # as a run does
    with torch.device(device):  # (random weights initialised where they will live: seconds, not minutes)
        model, tokenizer = R.load_policy(cfg.model, device, torch.float32, cfg.seed)
    if cfg.gradient_checkpointing and device.type == "cuda":
        model.activation_checkpointing_enable()
    model.eval()
    rng = random.Random(cfg.seed)
    started = time.perf_counter()
    report = {"model": cfg.model, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "transformers": R.transformers.__version__, "sizes": sizes._asdict()}

    def measured(key: str, value) -> None:
        report[key] = value
        write_report(report, run_dir)
        print(f"[probe] {key}: {json.dumps(value)}", flush=True)

    measured("decode", {})
    for sampler in SAMPLERS:
        report["decode"][sampler] = decode_probe(model, tokenizer, cfg, sizes, sampler, rng)
        measured("decode", report["decode"])
    measured("head", head_probe(model, cfg, sizes, rng))
    measured("training", training_probe(model, tokenizer, cfg, sizes, rng))
    measured("memory", memory_check(model, cfg, sizes, report["decode"], report["training"]))
    report["projection"] = {sampler: [project(report["decode"][sampler], report["training"], sizes, work, cfg)
                                      for work in WORKLOADS] for sampler in SAMPLERS}
    report["probe_s"] = round(time.perf_counter() - started, 1)
    return report


def print_probe(report: dict, run_dir: Path) -> None:
    sizes = report["sizes"]
    print(f"GPU probe of {report['model']} on {report['device']} (torch {report['torch']}, transformers "
          f"{report['transformers']}; {report['probe_s']} s; also in {run_dir / 'benchmark.json'})")
    print("  decode, ms per step (first call s; prefill tokens/s; peak GiB)")
    for sampler, shapes in report["decode"].items():
        cells = "  ".join(f"{shape}: {s['ms_per_step']} ({s['first_call_s']} s; {s['prefill_tokens_per_s']}; "
                          f"{s['peak_gb']})" for shape, s in shapes.items())
        print(f"    {sampler:<7}{cells}")
    for sampler, shapes in report["decode"].items():
        gap = next(iter(shapes.values()))["gap"]
        print(f"  sampling-vs-scoring log-prob gap, {sampler}: mean {gap['mean']:.2e}, p99 {gap['p99']:.2e}, "
              f"max {gap['max']:.2e}")
    if report["head"]:
        head = report["head"]
        print(f"  output head, ms per 1k tokens: fp32 {head['ms_per_1k_tokens']['fp32']}, TF32 "
              f"{head['ms_per_1k_tokens']['tf32']}; TF32 - fp32 log-probs: mean {head['difference_mean']:.1e}, "
              f"max {head['difference_max']:.1e}")
    training = report["training"]
    print(f"  scoring, tokens/s: policy {training['scoring_tokens_per_s']['policy']}, teacher "
          f"{training['scoring_tokens_per_s']['teacher']}; update: {training['update_s_per_1k_tokens']} s per 1k "
          f"tokens ({sizes['rows']} samples, {training['sequence_tokens']} tokens)")
    print("  peak memory above the stage's start, GiB (measured / estimated): " + "; ".join(
        f"{stage} {m['measured']} / {m['estimated']}" for stage, m in report["memory"].items()))
    print("  projection for B*G = 128 (docs/cost.md): phase-2 iteration s (decode + prefill + env + scoring + update)"
          ", evaluation h, run h (both phases)")
    for sampler, rows in report["projection"].items():
        for row in rows:
            parts = " + ".join(f"{v:g}" for v in row["iteration_s"].values())
            print(f"    {sampler:<7}{row['env']:<9}{row['case']:<12} {row['iteration_total_s']:>7} s = {parts}; "
                  f"evaluation {row['evaluation_h']} h; run {row['run_h']} h")


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
            peaks[name].append(memory.memory_above(memory.peak_memory_gb(device), base))
    median = {name: statistics.median(t for t, _ in runs) for name, runs in timings.items()}
    peak = {name: None if None in v else statistics.median(v) for name, v in peaks.items()}
    tokens = {name: runs[-1][1] for name, runs in timings.items()}
    per_s = {name: tokens[name] / median[name] for name in median}
    report = {
        "model": cfg.model, "device": str(device), "sequences": len(prompts), "new_tokens": n_new,
        "tokens_per_s": {k: round(v, 1) for k, v in per_s.items()},
        "rollout_speed_ratio": round(per_s["ours_generate"] / per_s["plain_generate"], 3),
        "update_speed_ratio": round(per_s["ours_update"] / per_s["plain_update"], 3),
        "logprob_speed_ratio": round(median["plain_logprob"] / median["ours_logprob"], 3),
        "logprob_peak_gb": {k: rounded(v, 4) for k, v in peak.items()},
        # a ratio of two peaks near the measurement's noise (CPU resident-set changes) means
        # nothing, and can even be negative: none below the floor
        "logprob_memory_ratio": round(peak["ours_logprob"] / peak["plain_logprob"], 4)
        if None not in peak.values() and min(peak.values()) >= MEASURABLE_PEAK_GB else None,
    }
    return report


def write_report(report: dict, run_dir: Path) -> None:
    """RUN_DIR/benchmark.json, replaced whole (a new file renamed over it: never written through a link)."""
    common.write_text_atomically(run_dir / "benchmark.json", json.dumps(common.finite_json(report), indent=2))


def print_benchmark(report: dict, run_dir: Path) -> None:
    """Print the benchmark's table (tokens/s, medians) and write its report to RUN_DIR/benchmark.json."""
    write_report(report, run_dir)
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
    parser.description = ("The GPU probe: decode, prefill, scoring and update measured with random weights, each stage's "
                          "memory, and the projected hours of an iteration and a run (retireopd.py's flags: the model, "
                          "the batch, --eval-batch); the report goes to RUN_DIR/benchmark.json. Without --model: "
                          "random:Qwen2.5-1.5B on a GPU, the tiny model at toy sizes on CPU.")
    parser.add_argument("--versus-plain", action="store_true", help="instead, time our generate, update and log-probs "
                        "against plain Hugging Face calls on the same inputs (ratios > 1: ours is faster)")
    args = vars(parser.parse_args(argv))
    versus_plain = args.pop("versus_plain")
    if problem := settings.path_flag_problem(args):
        raise SystemExit(f"retireopd: {problem}")
    if multigpu.world_size() > 1:
        raise SystemExit("retireopd: the benchmark runs in one process: start it with python, not torchrun")
    on_gpu = common.pick_device(args.get("device", "auto")).type == "cuda"
    if not versus_plain:
        args.setdefault("model", "random:Qwen2.5-1.5B" if on_gpu else "tiny")
        args.setdefault("env", "webshop")  # (the probe plays no episode: the built-in catalogue needs no data)
    cfg = R.parse_config(args)
    if problem := model_sources.model_source_problem(cfg.model):
        raise SystemExit(f"retireopd: {problem}")
    run_folder.check_run_folder(cfg.run_dir, resuming=False)
    if versus_plain:
        print_benchmark(benchmark(cfg), Path(cfg.run_dir))
        return Path(cfg.run_dir)
    rows = cfg.batch_tasks * cfg.group_size
    sizes = GPU_SIZES._replace(rows=rows) if on_gpu else CPU_SIZES._replace(rows=min(rows, CPU_SIZES.rows))
    report = probe(cfg, sizes, Path(cfg.run_dir))
    write_report(report, Path(cfg.run_dir))
    print_probe(report, Path(cfg.run_dir))
    return Path(cfg.run_dir)


if __name__ == "__main__":
    main(sys.argv[1:])
