"""Sampling from a Hugging Face causal LM the way on-policy RL needs it: `generate` answers a batch of
prompts in one call from the full distribution (temperature, top_k=0, top_p=1, no repetition penalty,
fp32 logits), keeps each sampled token's log-prob as the sampler saw it, and prefills the prompts in
sub-batches so that memory grows with --prefill-batch, not with B*G. retireopd.py's rollout calls it at
every turn; `autocast` is the precision every model call runs under. A leaf beside the method (nanochat's
engine.py is the precedent); under torchrun it runs on each process's whole copy of the policy.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional

import torch
import transformers

import multigpu

class Sampled(NamedTuple):
    ids: list  # the response's token ids, ending in EOS unless cut
    hit_cap: bool  # cut at max_new_tokens without EOS
    logp: Optional[torch.Tensor] = None  # (len(ids),) fp32, CPU: log-prob of each token at sampling time


@torch.no_grad()
def generate(model, tokenizer, prompts: list, max_new_tokens: int, temperature: float,
             prefill_batch: int = 0) -> list:
    """Sample one response per prompt in one batched call. Returns [Sampled] in prompt order.

    The sampling settings are passed in full (temperature, top_k=0, top_p=1, no repetition
    penalty) and the logits are fp32 (fp32_output_head): the log-probs we train on are those of
    the distribution we sampled from. SampledTokenLogprobs keeps each token's log-prob as the
    sampler saw it, to compare with the scoring pass; prefill_cache prefills prefill_batch prompts
    per forward (0: all in one).
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
    with autocast(device), fp32_output_head(model):
        split = 0 < prefill_batch < len(prompts) and width > 1
        cache = prefill_cache(model, input_ids, attention_mask, prefill_batch) if split else None
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=sampling,
                             logits_processor=transformers.LogitsProcessorList([recorder]), cache=cache)
    new_tokens = out[:, width:]
    logps = recorder.finish(new_tokens).float().cpu()
    responses = []
    for row, logp in zip(new_tokens.tolist(), logps):
        end = next((k for k, tok in enumerate(row) if tok in eos), None)
        n, cut = (end + 1, False) if end is not None else (len(row), True)
        responses.append(Sampled(row[:n], cut, logp[:n]))
    return responses


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




def eos_token_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]

