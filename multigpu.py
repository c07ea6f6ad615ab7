"""What several processes add to retireopd.py: torchrun, its process group, and FSDP2 shards.

`torchrun --nproc_per_node N retireopd.py ...` runs the same script in N processes, one GPU each (gloo
on CPU). Every rank plays its share of the B tasks, whole GRPO groups, so the advantages need nothing
from another rank; the policy, the teacher and the reference are sharded with FSDP2 (fully_shard);
each optimizer step is one update over the global mini-batch, the ranks' gradients summed; rank 0 alone
writes the run folder and prints. The method in retireopd.py calls this module only in its three
`if ddp:` steps; the code below its banner calls the gathering helpers, which with one process return
their input. A leaf: where it needs a function of the method, that is passed in.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
from datetime import timedelta
from typing import Iterator, Optional

import torch
import transformers

from common import pick_device


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun (read before the group exists, too)


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def main_process() -> bool:
    """Rank 0: the one process that writes the run folder and prints."""
    return rank() == 0


def start_processes(cfg) -> torch.device:
    """The training device; under torchrun also the process group (NCCL on GPUs, gloo on CPU), each
    rank on its own GPU, the other ranks' prints silenced, and rank 0's --run-dir on every rank."""
    device = pick_device(cfg.device)
    if world_size() == 1:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    # rank 0 alone writes a checkpoint (at 7B about 90 GB) while the others wait in the next collective:
    # a generous timeout, beyond NCCL's default 10 minutes
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                         timeout=timedelta(hours=2))
    if not main_process():
        sys.stdout = open(os.devnull, "w", encoding="utf-8")  # one voice: rank 0's (errors still reach stderr)
    cfg.run_dir = broadcast(cfg.run_dir)  # the default folder is named by the time: rank 0's
    return device


def stop_processes() -> None:
    if world_size() > 1 and torch.distributed.is_initialized():
        torch.distributed.barrier()  # no rank tears its connections down while another still uses them
        torch.distributed.destroy_process_group()


def exit_at_once() -> None:
    """Under torchrun, end this process now that its work is done and written (the logs are fsynced, the
    process group destroyed), without the interpreter's teardown: on CPU (gloo) about one launch in ten of
    two processes aborted there ("terminate called without an active exception", exit -6, after everything was
    saved); none in 24 launches that exit so. One process: nothing (a normal return)."""
    if world_size() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def barrier() -> None:
    """Wait for every rank (after rank 0 wrote something the others read)."""
    if world_size() > 1:
        torch.distributed.barrier()


def broadcast(value):
    """Rank 0's value on every rank (any picklable value)."""
    if world_size() == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(value) -> list:
    """[rank 0's value, rank 1's, ...] on every rank (small picklable values)."""
    if world_size() == 1:
        return [value]
    values = [None] * world_size()
    torch.distributed.all_gather_object(values, value)
    return values


def sum_over_ranks(*values: float) -> list:
    """Each value summed over the ranks (counts, and sums of per-token terms)."""
    return [sum(parts) for parts in zip(*gather_objects(values))]


def max_over_ranks(value: float) -> float:
    """The largest over the ranks: times (the slowest rank sets the pace), peak memory, counts of
    collective calls."""
    return max(gather_objects(value))


def all_ranks(flag: bool) -> bool:
    return all(gather_objects(bool(flag)))


def cat_over_ranks(tensors: list) -> torch.Tensor:
    """The 1-D tensors of every rank, concatenated in rank order (per-token statistics such as K)."""
    mine = torch.cat(tensors) if tensors else torch.zeros(0)
    return mine if world_size() == 1 else torch.cat(gather_objects(mine.detach().cpu()))


def share_of_tasks(tasks: list) -> list:
    """This rank's consecutive share of the iteration's tasks: whole GRPO groups (B % N == 0)."""
    per_rank = len(tasks) // world_size()
    return tasks[rank() * per_rank:(rank() + 1) * per_rank]


def global_batch(samples: list) -> tuple[int, list]:
    """(where this rank's samples start in the global batch, the response length of every sample
    in it). The global batch is the ranks' samples in rank order; one process: (0, its own)."""
    lengths = [len(s.response_ids) for s in samples]
    if world_size() == 1:
        return 0, lengths
    per_rank = gather_objects(lengths)
    return sum(len(part) for part in per_rank[:rank()]), [n for part in per_rank for n in part]


def in_lockstep(batches: list, idle_pass) -> Iterator:
    """This rank's micro-batches, then idle_pass() until it has made as many passes as the rank with
    the most: each forward and backward of a sharded model is collective (FSDP gathers the weights
    of every layer from all ranks), so every rank must make the same number."""
    passes = max_over_ranks(len(batches))  # agreed before any pass (one process: len(batches))
    yield from batches
    for _ in range(passes - len(batches)):
        idle_pass()


def shard(model, device: torch.device, score_tokens):
    """FSDP2: every decoder layer, then the rest (embeddings, final norm, lm_head), sharded over the
    ranks. The scoring forward (score_tokens(model, ...): the base model, then our lm_head chunks) is
    registered as a forward of the sharded model, so that FSDP gathers the root's weights for it and
    reduces their gradients; model.generate is never called on it (sampling_model).

    The ranks' gradients are summed, not averaged (FSDP's default): each rank's loss is its own
    samples' part of the global mini-batch's token-mean (ppo_update), so their sum is the gradient of
    that mean, as one process computes it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
    mesh = init_device_mesh(device.type, (world_size(),))
    for layer in model.base_model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in (*model.base_model.layers, model):
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # (a plain sum: no averaging op, no pre-scaling)
    model.score_tokens = functools.partial(score_tokens, model)
    register_fsdp_forward_method(model, "score_tokens")
    gathered_forward = model.score_tokens

    def score_tokens_then_reshard(*args):
        scored = gathered_forward(*args)
        if not torch.is_grad_enabled():  # no backward follows: FSDP would keep the root's weights gathered,
            model.reshard()  # and a later training step reduced wrong gradients for them
        return scored

    model.score_tokens = score_tokens_then_reshard  # what sequence_logprobs calls on a sharded model
    return model


def sharded(model) -> bool:
    return hasattr(model, "score_tokens")  # set by shard


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value: gathered from every rank's shard (collective) when sharded."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def full_state_dict(model) -> Optional[dict]:
    """The sharded model's whole weights as CPU tensors on rank 0 (every rank takes part, one
    parameter at a time); None for a model that is not sharded (save_pretrained reads it itself).
    Qwen2 has no persistent buffers, and a tied lm_head is saved once, as save_pretrained does."""
    if not sharded(model):
        return None
    gathered = {}
    for name, parameter in model.named_parameters():
        value = full_tensor(parameter.detach())
        if main_process():
            gathered[name] = value.cpu()
    return gathered


@torch.no_grad()
def sampling_model(policy, whole_copy: bool = False):
    """The model that generates: the policy itself; when sharded, or when asked (whole_copy: engine.py's static
    sampler, in one process too), a whole copy of its weights on this rank, refreshed from the policy now (when
    sharded, collective: every rank calls it at the same point). A copy is returned as it is.

    Why a copy: generating with the sharded policy gathers every layer's weights at every decode
    step (at 7B, 30 GB of fp32 weights per token step); the copy costs one gather per iteration. On
    a GPU it holds the Linear layers in bf16, the values autocast computes with, and the rest in
    fp32, so it samples exactly as the one-process policy does under autocast: about 2 B/param (and a
    compiled decode step reads bf16 weights instead of casting every fp32 weight at every step)."""
    if policy.__dict__.get("is_sampling_copy") or not (sharded(policy) or whole_copy):
        return policy
    device = next(policy.parameters()).device
    replica = policy.__dict__.get("sampling_copy")  # a plain attribute: not a submodule, not in state_dict
    if replica is None:  # (its random init must not draw from the run's RNG: a resume builds it later)
        with torch.device(device), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            replica = transformers.AutoModelForCausalLM.from_config(  # (its own config: from_config sets dtype)
                copy.deepcopy(policy.config), dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
        head = replica.get_output_embeddings()
        in_bf16 = {id(p) for m in replica.modules() if isinstance(m, torch.nn.Linear) and m is not head
                   for p in m.parameters()}
        for parameter in replica.parameters():  # (on CPU all are fp32 already)
            if id(parameter) not in in_bf16:
                parameter.data = parameter.data.float()
        for name, buffer in policy.named_buffers():  # rotary frequencies, as the policy computed them
            replica.get_buffer(name).copy_(buffer)
        replica.generation_config = policy.generation_config
        replica.__dict__["is_sampling_copy"] = True
        policy.__dict__["sampling_copy"] = replica.requires_grad_(False).eval()
    shards = dict(policy.named_parameters())
    for name, parameter in replica.named_parameters():
        parameter.copy_(full_tensor(shards[name].detach()))
    return replica


def optimizer_state(model, optimizer) -> dict:
    """AdamW's state for a checkpoint; when sharded, whole (gathered) on rank 0, keyed by parameter name."""
    if not sharded(model):
        return optimizer.state_dict()
    if not optimizer.state:  # no step taken yet (the same on every rank): torch would take a hidden one here
        return {}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                               cpu_offload=True))


def load_optimizer_state(model, optimizer, state: dict) -> None:
    """The inverse of optimizer_state: each rank takes its shard of the whole state."""
    if not sharded(model):
        optimizer.load_state_dict(state)
        return
    if not state:  # saved before any step: a fresh AdamW
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True))
