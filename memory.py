"""Memory: the gauges each metrics.jsonl line reads (peak memory of an iteration, on a GPU or a CPU) and
the estimate printed before each phase, which counts every large term of a phase's peak. A leaf
beside the method.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch

import engine
import multigpu


# ==================================================================================================
# The gauges
# ==================================================================================================


def process_memory_gb(field_name: str = "VmRSS") -> Optional[float]:
    """This process's resident memory in GiB: VmRSS (now) or VmHWM (its peak), from Linux's /proc/self/status.
    Where there is no /proc: the peak from the standard library's getrusage (macOS); None where the platform
    gives no figure (the resident size now, on macOS; either, on Windows, which has no getrusage), never 0."""
    try:
        with open("/proc/self/status", encoding="utf-8") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    if field_name == "VmHWM":
        try:
            import resource
            # ru_maxrss is in bytes on macOS and in KiB on Linux and the BSDs (getrusage(2)): a unit, not a
            # capability, so the one place this project reads the platform's name
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**30 if sys.platform == "darwin" else 2**20)
        except ImportError:
            pass
    return None


def current_memory_gb(device: torch.device) -> Optional[float]:
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else process_memory_gb("VmRSS")


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:  # Linux: writing 5 to clear_refs resets the process's peak RSS (VmHWM) to its RSS
            with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
                f.write("5")
        except OSError:
            pass


def peak_memory_gb(device: torch.device) -> Optional[float]:
    """Peak memory since the last reset_peak_memory: CUDA max allocated on a GPU; on CPU the process's peak
    resident set (process_memory_gb: the process's peak so far where the platform has no reset; None where
    it gives no figure)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return process_memory_gb("VmHWM")


def memory_above(peak: Optional[float], base: Optional[float]) -> Optional[float]:
    """What a stage added to memory (GiB, at least 0), or None where either figure is missing."""
    return None if peak is None or base is None else max(peak - base, 0.0)


# ==================================================================================================
# The estimate, printed before each phase (and logged by retireopd.py's Run)
# ==================================================================================================


SKILL_BLOCK_TOKENS = 1024  # room for phase 1's skill block in the estimate's prompt width (a bound: 177 on ALFWorld)


def estimate_memory_gb(model, cfg, n_frozen: int, skill_tokens: int = 0,
                       device: Optional[torch.device] = None, processes: Optional[int] = None) -> dict:
    """Rough start-up estimate of a phase's peak accelerator memory, printed before it runs (GiB),
    per process: `processes` ranks under torchrun (default: this run's, world_size()).

    Always resident: the trained policy's fp32 master weights + fp32 gradient + two fp32 AdamW
    moments (16 B/param), plus autocast's bf16 copy of the weights (2 B/param); the frozen
    teacher/reference, 4 or 2 B/param (--frozen-dtype). On top of that, the largest of four
    stages that never overlap (each frees its tensors before the next begins):
      rollout: the KV cache of the lock-step batch at full length (eager sampler: keys fp32 under
        autocast, values bf16, plus one layer, the copy each decode step's concatenation makes;
        static sampler: keys and values in engine.kv_dtype, the rows and the length rounded up as
        engine.row_bucket and engine.cache_length round them); the
        prefill's temporaries, for prefill_batch rows (all B*G when 0) of the widest prompt:
        one layer's working set per token (fp32 residual stream, its norm and the attention
        output, 12 B per hidden unit; three bf16 MLP tensors, 6 B per intermediate unit) and
        the boolean attention mask (width^2 B per row); sampling: three fp32 (B*G, vocab)
        tensors per decode step (generate's logits and softmax, our log-softmax).
      evaluation: the same for a lock-step batch of --eval-batch episodes (a validation or report).
      forward/backward: with gradient checkpointing one fp32 hidden state per layer per token
        of a micro-batch plus one layer's working set; log-probs: one chunk of
        vocabulary-sized fp32 logits and their softmax.
      optimizer step: AdamW's temporaries: none when fused (CUDA), about one fp32 copy of the
        parameters for the multi-tensor path (not used), two of the largest parameter's size for
        the CPU loop.
    With N > 1 processes (FSDP2): the 16 B/param and the frozen models are divided by N, and
    autocast keeps no weight copy (its cache is off: the bf16 casts live one layer at a time; without
    gradient checkpointing backward keeps every layer's, 2 B/param);
    each rank plays B*G/N episodes; and two parts are whole on every rank: the sampling copy of
    the policy (sampling_model: 2 B per Linear weight and 4 B per other weight on a GPU, 4 B on
    CPU) and, during a forward or backward, the gathered weights and gradients (fp32) of two
    decoder layers (the one computing and the one prefetched) and of the root (embeddings, lm_head).
    The static sampler holds the same sampling copy in one process too.
    device: where the run trains (default: the model's), which decides the AdamW path.
    """
    device = device or next(model.parameters()).device
    processes = processes or multigpu.world_size()
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    shape = model.config
    hidden, intermediate, layers = shape.hidden_size, shape.intermediate_size, shape.num_hidden_layers
    frozen_bytes = 2 if cfg.frozen_dtype == "bfloat16" else 4
    per_layer_token = hidden * 4 * (1 if cfg.gradient_checkpointing else 24)
    activations = cfg.token_budget * (per_layer_token * layers + 6 * intermediate * 2)
    sequences = cfg.batch_tasks * cfg.group_size // processes
    eval_sequences = -(-cfg.eval_batch // processes)  # (each rank plays its share of a batch)
    head_dim = hidden // shape.num_attention_heads
    prompt_width = cfg.max_prompt_tokens + skill_tokens
    static = engine.samples_static(cfg.sampler, device)
    kv_per_token = shape.num_key_value_heads * head_dim

    def kv_cache(rows: int) -> int:
        if static:  # keys and values in kv_dtype, rows and length rounded up (the shapes the decode step runs at)
            length = engine.cache_length(prompt_width + cfg.max_response_tokens, device)
            size = torch.tensor([], dtype=engine.kv_dtype(device)).element_size()
            return engine.row_bucket(rows, device) * length * layers * kv_per_token * 2 * size
        return rows * (prompt_width + cfg.max_response_tokens) * (layers + 1) * kv_per_token * (4 + 2)

    def prefill(rows: int) -> int:
        prefill_rows = min(cfg.prefill_batch or rows, rows)
        return prefill_rows * prompt_width * (12 * hidden + 6 * intermediate + prompt_width)
    largest = max(p.numel() for p in params) // processes
    if device.type == "cuda":  # build_adamw: fused on CUDA
        optimizer_temporaries = 0
    else:  # torch's per-parameter loop on CPU: sqrt(v) and its quotient, for the largest parameter
        optimizer_temporaries = 2 * 4 * largest
    sampling_copy = gathered = 0
    if processes > 1 or static:
        head = model.get_output_embeddings()
        linear = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head
                     for p in m.parameters())
        sampling_copy = 2 * linear + 4 * (n_params - linear) if device.type == "cuda" else 4 * n_params
    if processes > 1:
        layer = sum(p.numel() for p in model.base_model.layers[0].parameters())
        gathered = 8 * (2 * layer + n_params - layers * layer)
    bf16_casts = 0 if cfg.gradient_checkpointing else 2 * n_params  # (sharded: kept for backward, whole)
    parts = dict(policy_and_adam=(18 * n_params if processes == 1 else 16 * n_params / processes + bf16_casts),
                 frozen_models=frozen_bytes * n_params * n_frozen / processes, sampling_copy=sampling_copy,
                 kv_cache=kv_cache(sequences), prefill=prefill(sequences),
                 sampling=3 * sequences * shape.vocab_size * 4, eval_kv_cache=kv_cache(eval_sequences),
                 eval_prefill=prefill(eval_sequences), eval_sampling=3 * eval_sequences * shape.vocab_size * 4,
                 activations=activations, logits=cfg.logprob_chunk * shape.vocab_size * 12, gathered=gathered,
                 optimizer_temporaries=optimizer_temporaries)
    gib = {k: round(v / 2**30, 2) for k, v in parts.items()}
    stages = {"rollout": gib["kv_cache"] + gib["prefill"] + gib["sampling"],
              "evaluation": gib["eval_kv_cache"] + gib["eval_prefill"] + gib["eval_sampling"],
              "forward_backward": gib["activations"] + gib["logits"] + gib["gathered"],
              "optimizer_step": gib["optimizer_temporaries"]}
    gib["peak_stage"] = max(stages, key=stages.get)
    resident = gib["policy_and_adam"] + gib["frozen_models"] + gib["sampling_copy"]
    gib["total"] = round(resident + stages[gib["peak_stage"]], 2)
    gib["params_millions"] = round(n_params / 1e6, 2)
    gib["processes"] = processes
    return gib


def format_memory_estimate(memory: dict) -> str:
    """One line: the total, what stays resident, and each stage with its parts (the largest first)."""
    stages = {"rollout": ("kv_cache", "prefill", "sampling"),
              "evaluation": ("eval_kv_cache", "eval_prefill", "eval_sampling"),
              "forward_backward": ("activations", "logits", "gathered"), "optimizer_step": ("optimizer_temporaries",)}
    order = sorted(stages, key=lambda stage: stage != memory["peak_stage"])
    described = [f"{stage}: " + " + ".join(f"{part} {memory[part]}" for part in stages[stage]
                                           if part != "gathered" or memory[part]) for stage in order]
    copy = f" + sampling_copy {memory['sampling_copy']}" if memory["sampling_copy"] else ""
    per_rank = f" per process of {memory['processes']}" if memory["processes"] > 1 else ""
    return (f"{memory['total']} GiB{per_rank} = policy_and_adam {memory['policy_and_adam']} + frozen_models "
            f"{memory['frozen_models']}{copy} + the largest stage ({'; '.join(described)}); "
            f"{memory['params_millions']}M parameters")


def print_memory_estimate(policy, cfg, phase: str, n_frozen: int, skill_tokens: int = 0) -> dict:
    """Print the memory estimate of a phase before it allocates anything heavy; returns it (to log)."""
    device = next(policy.parameters()).device
    memory = estimate_memory_gb(policy, cfg, n_frozen, skill_tokens, device)
    print(f"[retireopd] {phase} memory estimate: {format_memory_estimate(memory)}")
    if device.type == "cuda":
        available = torch.cuda.get_device_properties(device).total_memory / 2**30
        if memory["total"] > 0.95 * available:
            print(f"[retireopd] WARNING: the estimate exceeds this GPU's {available:.0f} GiB: lower "
                  "--eval-batch, --token-budget, --max-prompt-tokens or --batch-tasks, or set --kl-coef 0")
    return memory
