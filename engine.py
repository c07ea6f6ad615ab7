"""Sampling from a Hugging Face causal LM the way on-policy RL needs it: `generate` answers a batch of
prompts in one call from the full distribution (temperature, top_k=0, top_p=1, no repetition penalty,
fp32 logits), keeps each sampled token's log-prob as the sampler saw it, and prefills the prompts in
sub-batches so that memory grows with --prefill-batch, not with B*G. retireopd.py's rollout calls it at
every turn; `autocast` is the precision every model call runs under. A leaf beside the method (nanochat's
engine.py is the precedent); under torchrun it runs on each process's whole copy of the policy.

Two samplers (--sampler): "eager", the reference, transformers' decode loop over a growing cache; "static",
a preallocated KV cache (bf16 on a GPU) and a bf16 copy of the policy, whose decode step transformers
compiles into CUDA graphs on a GPU (one eager step of a 28-layer model dispatches some 2,400 operators from
Python: measured, 65 ms at 8 rows as at 128 on an H200). On CPU both sample the same tokens.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional

import torch
import transformers
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import multigpu

class Sampled(NamedTuple):
    ids: list  # the response's token ids, ending in EOS unless cut
    hit_cap: bool  # cut at max_new_tokens without EOS
    logp: Optional[torch.Tensor] = None  # (len(ids),) fp32, CPU: log-prob of each token at sampling time


@torch.no_grad()
def generate(model, tokenizer, prompts: list, max_new_tokens: int, temperature: float,
             prefill_batch: int = 0, sampler: str = "eager") -> list:
    """Sample one response per prompt in one batched call. Returns [Sampled] in prompt order.

    The sampling settings are passed in full (temperature, top_k=0, top_p=1, no repetition
    penalty) and the logits are fp32 (fp32_output_head): the log-probs we train on are those of
    the distribution we sampled from. SampledTokenLogprobs keeps each token's log-prob as the
    sampler saw it, to compare with the scoring pass; prefill_cache prefills prefill_batch prompts
    per forward (0: all in one).

    sampler "eager" (the reference) decodes with transformers' growing cache, one Python-dispatched forward per
    token; "static" preallocates the cache (prefill_static_cache) and samples with a copy of the policy
    (static_sampling_copy), so that on a GPU generate compiles the decode step and replays it as CUDA graphs; on
    CPU nothing is compiled and its tokens are the eager path's. "auto": static on a GPU, eager on CPU.
    """
    pad = tokenizer.pad_token_id
    width = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    eos = eos_token_ids(model)
    sampling = transformers.GenerationConfig(
        do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
        top_k=0 if temperature > 0 else None, top_p=1.0 if temperature > 0 else None,
        repetition_penalty=1.0, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad)
    recorder = SampledTokenLogprobs()
    rows = len(prompts)
    static = samples_static(sampler, device)
    if static:  # a copy with bf16 Linear weights on a GPU, its decode attention packed; rows padded to a bucket
        model = static_sampling_copy(model)
        sampling.compile_config = compile_config() if device.type == "cuda" else None  # (CPU: nothing compiled)
        input_ids, attention_mask = pad_rows(input_ids, attention_mask, row_bucket(rows, device), pad)
    with autocast(device), fp32_output_head(model):
        if static:
            cache = prefill_static_cache(model, input_ids, attention_mask, prefill_batch,
                                         cache_length(width + max_new_tokens, device))
        else:
            split = 0 < prefill_batch < len(prompts) and width > 1
            cache = prefill_cache(model, input_ids, attention_mask, prefill_batch) if split else None
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=sampling,
                             logits_processor=transformers.LogitsProcessorList([recorder]), cache=cache)
    new_tokens = out[:rows, width:]
    logps = recorder.finish(out[:, width:])[:rows].float().cpu()
    responses = []
    for row, logp in zip(new_tokens.tolist(), logps):
        end = next((k for k, tok in enumerate(row) if tok in eos), None)
        n, cut = (end + 1, False) if end is not None else (len(row), True)
        responses.append(Sampled(row[:n], cut, logp[:n]))
    return responses


def use_tf32_head(device: torch.device) -> None:
    """On a GPU, fp32 matrix products run on the tensor cores in TF32. Under bf16 autocast the only fp32 product
    is the output head (fp32_output_head, token_logprobs): measured on an H200 at Qwen2.5-1.5B, TF32 changes its
    log-probs by 1.8e-4 on average (at most 1e-3), against a sampling-vs-scoring gap of 1.4e-2 that bf16
    autocast leaves anyway, and runs it 4.4 times as fast (docs/choices.md: Precision)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True


def autocast(device: torch.device):
    """bf16 compute on GPU over fp32 master weights (docs/choices.md: Precision); plain fp32 on CPU. Under
    torchrun its cache of bf16 weight casts is off: it would keep every gathered layer's cast."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=multigpu.world_size() == 1)
    return contextlib.nullcontext()


@contextlib.contextmanager
def fp32_output_head(model):
    """Run the output head outside autocast: under bf16 autocast Hugging Face's generate would
    sample from bf16-rounded logits, while the log-probs we train on come from fp32 logits
    (token_logprobs). Only the last position goes through the head, so this costs nothing."""
    head = model.get_output_embeddings()

    def forward(hidden):
        with torch.autocast(hidden.device.type, enabled=False):
            return type(head).forward(head, hidden.to(head.weight.dtype)).float()

    head.forward = forward  # an instance attribute shadows the class's forward until deleted
    try:
        yield
    finally:
        del head.forward


class SampledTokenLogprobs(transformers.LogitsProcessor):
    """Records log pi(y_k | s, y_<k) of every token that generate samples, keeping only the
    previous step's (batch, vocab) log-softmax, never the (steps, batch, vocab) scores.

    At step k generate calls it with the fp32 scores of token k while input_ids end with token
    k-1: it gathers token k-1 from the log-softmax kept at step k-1, then keeps step k's; `finish`
    gathers the last token once generate has returned. Cost: one (batch, vocab) log-softmax and
    gather per step, beside generate's own softmax of the same scores.

    Position in the processor list (transformers 5.24, `_get_logits_processor`): the processors
    passed to generate come after the built-in logits processors (none is active with our
    settings: no repetition penalty, no bad words, no minimum length) and *before* the sampling
    warpers (temperature, top-k, top-p). The scores seen here are therefore the temperature-1
    distribution, which is the one sampled from in every training rollout (temperature 1 is
    enforced); at another temperature (evaluation) they are not the sampled distribution's.
    """

    def __init__(self):
        self.previous: Optional[torch.Tensor] = None  # (batch, vocab) log-softmax of the last step
        self.picked: list = []  # per step k: (batch,) log-prob of token k

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.previous is not None:
            self.picked.append(self.previous.gather(1, input_ids[:, -1:]).squeeze(1))
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        return scores  # the distribution is left untouched

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """(batch, steps) log-probs of new_tokens, the (batch, steps) ids generate appended. A
        step generate ran and then undid (its deferred stop check) is dropped."""
        steps = new_tokens.shape[1]
        if len(self.picked) < steps:  # the last step's token is only known now
            self.picked.append(self.previous.gather(1, new_tokens[:, len(self.picked), None]).squeeze(1))
        self.previous = None
        if len(self.picked) < steps:
            raise RuntimeError(f"generate made {steps} steps but showed the scores of {len(self.picked)}")
        return torch.stack(self.picked[:steps], dim=1)


def prefill_cache(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows_per_forward: int):
    """KV cache of input_ids[:, :-1] (all prompt columns but the last), built rows_per_forward
    rows at a time, so that the prefill's temporaries (one layer's activations for every prompt
    token in the forward) grow with rows_per_forward x width instead of B*G x width.

    input_ids, attention_mask: (batch, width), left padded. Positions are numbered as generate
    numbers them (count of real tokens before, 0 on padding). The sub-batch caches are joined
    along the batch dimension one layer at a time, each part freed as it is copied, so the join
    costs one layer's cache on top of the cache itself. model.generate, given the full input_ids
    and this cache, then runs only the last prompt column for all rows, and decodes on.
    """
    positions = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    parts = []
    for start in range(0, input_ids.shape[0], rows_per_forward):
        rows = slice(start, start + rows_per_forward)
        out = model.base_model(input_ids=input_ids[rows, :-1], attention_mask=attention_mask[rows, :-1],
                               position_ids=positions[rows, :-1], use_cache=True,
                               cache=transformers.DynamicCache(config=model.config))
        parts.append(out.cache)
        del out  # its last_hidden_state is not needed: generate recomputes the last column

    def joined_layers():
        for layer in range(len(parts[0].layers)):
            keys = torch.cat([part.layers[layer].keys for part in parts])
            values = torch.cat([part.layers[layer].values for part in parts])
            for part in parts:
                part.layers[layer].keys = part.layers[layer].values = None
            yield keys, values

    return transformers.DynamicCache(joined_layers(), config=model.config)



# --- the static path (--sampler static): a preallocated KV cache, so that on a GPU generate compiles its decode
# step and replays it as CUDA graphs instead of dispatching ~2,400 operators from Python at every token

class CastStaticLayer(transformers.cache_utils.StaticLayer):
    """A static cache layer that stores keys and values in its own dtype (bf16 on a GPU). Under bf16 autocast the
    keys leave RoPE in fp32, and SDPA casts them to bf16 at every step anyway: storing them in bf16 gives
    attention the same numbers, at half the memory and without a cast of the whole cache per step."""

    def update(self, key_states, value_states, *args, **kwargs):
        if self.is_initialized:
            key_states, value_states = key_states.to(self.keys.dtype), value_states.to(self.values.dtype)
        return super().update(key_states, value_states, *args, **kwargs)


PACKED_SDPA = "retireopd_packed_sdpa"  # the static copy's attention: sdpa, a decode step's heads packed


def packed_decode_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Hugging Face's sdpa attention, except a one-token query (a decode step) of a grouped-query model: its
    query heads are grouped under their key/value head, (batch, heads, 1, dim) -> (batch, kv_heads, groups,
    dim), so attention reads the cache once per key/value head. Under torch.compile transformers instead
    repeats the keys and values for every query head (repeat_kv), which copies the cache six times per
    layer and step for Qwen2.5-1.5B. The same products and sums, in the same precision."""
    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or groups == 1 or attention_mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    batch, heads, _, dim = query.shape
    out = torch.nn.functional.scaled_dot_product_attention(  # the mask (batch, 1, 1, length) serves every head
        query.reshape(batch, heads // groups, groups, dim), key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, 1, heads, dim), None  # (batch, kv_heads, groups, dim) is head-major already


transformers.AttentionInterface.register(PACKED_SDPA, packed_decode_sdpa)
transformers.masking_utils.AttentionMaskInterface.register(PACKED_SDPA, transformers.masking_utils.sdpa_mask)


def static_sampling_copy(model):
    """The model the static path samples with: multigpu.sampling_model's whole copy of the policy (bf16 Linear
    weights on a GPU, as autocast rounds them; fp32 on CPU), refreshed from the policy at every call (a few ms
    at 1.5B, against a turn's hundreds of decode steps), with packed_decode_sdpa for its attention."""
    copy = multigpu.sampling_model(model, whole_copy=True)
    if copy.config._attn_implementation != PACKED_SDPA:
        copy.set_attn_implementation(PACKED_SDPA)
    return copy


def samples_static(sampler: str, device: torch.device) -> bool:
    """--sampler: "static", or "auto" on a GPU, takes the static path; "eager", or "auto" on CPU, the reference."""
    return sampler == "static" or (sampler == "auto" and device.type == "cuda")


def kv_dtype(device: torch.device) -> torch.dtype:
    """The static cache's dtype: bf16 on a GPU (what attention reads under autocast), fp32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


SHAPES_COMPILED = 64  # decode shapes (row_bucket x cache_length) compiled per sampling copy: torch's default is 8


def compile_config() -> transformers.CompileConfig:
    """How generate compiles the static copy's decode step on a GPU: CUDA graphs ("reduce-overhead") of static
    shapes, one compile per shape (about 40 s at 1.5B on an H200), kept for the run. Not dynamic=True: a graph
    with symbolic shapes under CUDA graphs ran for minutes without finishing its first 44 steps on an H200,
    while each static shape compiled in 36-49 s (docs/cost.md: what was measured)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, SHAPES_COMPILED)
    return transformers.CompileConfig(dynamic=False)


def row_bucket(rows: int, device: torch.device) -> int:
    """The batch a static generate runs at: on a GPU the next power of two, at least 8 (each new shape costs a
    compile, so few shapes; a small batch is bound by dispatch, not by its rows); on CPU the rows themselves."""
    return max(8, 1 << (rows - 1).bit_length()) if device.type == "cuda" else rows


def cache_length(needed: int, device: torch.device, step: int = 512) -> int:
    """The static cache's length: on a GPU `needed` rounded up to a multiple of `step` (few shapes; with packed
    attention a decode step reads 28 kB per cached position at 1.5B, so a coarse step costs little); else
    `needed`."""
    return -(-needed // step) * step if device.type == "cuda" else needed


def pad_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: int, pad: int):
    """Append rows - len(input_ids) filler rows (one real token, the pad id), sampled and dropped."""
    extra = rows - input_ids.shape[0]
    if extra <= 0:
        return input_ids, attention_mask
    filler_ids = torch.full((extra, input_ids.shape[1]), pad, dtype=input_ids.dtype, device=input_ids.device)
    filler_mask = torch.zeros_like(filler_ids)
    filler_mask[:, -1] = 1
    return torch.cat([input_ids, filler_ids]), torch.cat([attention_mask, filler_mask])


def prefill_static_cache(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows_per_forward: int,
                         max_length: int):
    """A static cache of max_length positions holding input_ids[:, :-1], prefilled rows_per_forward rows at a
    time (prefill_cache's sub-batches, copied into the static tensors layer by layer); bf16 on a GPU."""
    device, config = input_ids.device, model.config
    dtype = kv_dtype(device)
    cache = transformers.Cache(layers=[CastStaticLayer(max_cache_len=max_length)
                                       for _ in range(config.num_hidden_layers)])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache.early_initialization(input_ids.shape[0], config.num_key_value_heads, head_dim, dtype, device)
    prompt = input_ids.shape[1] - 1
    if prompt > 0:
        positions = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        step = rows_per_forward if 0 < rows_per_forward < input_ids.shape[0] else input_ids.shape[0]
        for start in range(0, input_ids.shape[0], step):
            rows = slice(start, start + step)
            out = model.base_model(input_ids=input_ids[rows, :-1], attention_mask=attention_mask[rows, :-1],
                                   position_ids=positions[rows, :-1], use_cache=True,
                                   cache=transformers.DynamicCache(config=config))
            for layer, part in zip(cache.layers, out.cache.layers):
                layer.keys[rows, :, :prompt] = part.keys
                layer.values[rows, :, :prompt] = part.values
            del out
    for layer in cache.layers:
        layer.cumulative_length.fill_(prompt)
    return cache



def eos_token_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]

