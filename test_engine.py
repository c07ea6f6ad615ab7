"""engine.py: sampling as on-policy RL needs it. generate samples from the full distribution whatever
the checkpoint's generation config says, left pads, flags answers cut at the cap, records each token's
log-prob as the sampler saw it (equal to the scoring pass's at temperature 1), and prefills in
sub-batches without changing a token; the GPU's numerics path (bf16 autocast, gradient
checkpointing) is checked on the CPU."""

import copy
import math
import random

import pytest
import torch

import engine
import retireopd as R
from conftest import small_cfg, FakeSuite


def test_sampling_is_full_distribution_despite_checkpoint_generation_config(tiny, tmp_path):
    model, tok = tiny
    # a checkpoint whose generation config would truncate and reshape the distribution
    model.generation_config.update(do_sample=True, top_k=2, top_p=0.1, temperature=0.05,
                                   repetition_penalty=3.0, min_p=0.5)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, loaded_tok = R.load_policy(str(tmp_path), torch.device("cpu"), torch.float32)
    assert loaded.generation_config.top_k is None and loaded.generation_config.temperature is None
    captured = {}
    original = loaded.generate

    def spy(**kwargs):  # record the processed scores next to the raw logits
        out = original(**kwargs, return_dict_in_generate=True, output_scores=True, output_logits=True)
        captured.update(scores=out.scores, logits=out.logits)
        return out.sequences

    loaded.generate = spy
    prompt = R.encode_prompt(loaded_tok, "anything")
    torch.manual_seed(0)
    R.generate(loaded, loaded_tok, [prompt] * 64, 3, 1.0)
    for scores, logits in zip(captured["scores"], captured["logits"]):
        assert torch.equal(scores, logits)  # no warper/processor touched the distribution
    # and the samples spread over many tokens (top_k=2 would allow two)
    sampled = R.generate(loaded, loaded_tok, [prompt] * 64, 1, 1.0)
    assert len({ids[0] for ids, *_ in sampled}) > 10
    # the old-policy log-probs of our forward pass equal the sampling distribution's
    responses = [ids for ids, *_ in R.generate(loaded, loaded_tok, [prompt] * 2, 3, 1.0)]
    captured_logp = torch.stack([torch.log_softmax(step[0], -1) for step in captured["logits"]])
    ours = R.sequence_logprobs(loaded, [prompt], [responses[0]], small_cfg())
    expected = captured_logp[torch.arange(len(responses[0])), torch.tensor(responses[0])]
    assert torch.allclose(ours, expected, atol=1e-4)


def test_gpu_numerics_path_on_cpu_bf16_autocast_and_gradient_checkpointing(tiny, monkeypatch):
    """What a GPU run does, checked here with CPU bf16 autocast standing in for CUDA's: the
    checkpointed update gives the plain update's gradient on every parameter (a checkpoint that
    silently cut the graph would leave layers without gradient), recomputation really happens,
    log-probs stay fp32, and a frozen fp32 copy scoring the same prompt gives D = 0 exactly."""
    model, tok = tiny
    bf16 = lambda device: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    monkeypatch.setattr(R, "autocast", bf16)  # the scoring forward
    monkeypatch.setattr(engine, "autocast", bf16)  # generate
    cfg = small_cfg(env="alfworld")
    torch.manual_seed(5)
    samples, _, _ = R.rollout(model, tok, FakeSuite(), [0, 0], cfg, group_size=2, skills_in_prompt=False,
                              with_teacher_prompts=False, temperature=1.0)
    prompts, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    frozen = copy.deepcopy(model).requires_grad_(False).eval()
    old = R.response_logprobs(model, samples, cfg)
    assert all(logp.dtype == torch.float32 for logp in old)
    frozen_logp = torch.cat(R.response_logprobs(frozen, samples, cfg))
    assert R.teacher_student_gap(torch.cat(old), frozen_logp, torch.ones_like(frozen_logp)) == (0.0, 0.0)

    def gradients(checkpointing):
        copied = copy.deepcopy(model)
        if checkpointing:
            copied.activation_checkpointing_enable()  # what main() does on a GPU
        copied.train()
        calls = []
        # a pre-hook on a module inside the layer: the checkpoint wraps the layer's forward, not its
        # hooks, and the recomputation stops as soon as it has what the backward needs
        copied.model.layers[0].mlp.register_forward_pre_hook(lambda *args: calls.append(1))
        logp, entropy = R.sequence_logprobs(copied, prompts, responses, cfg, with_entropy=True)
        assert logp.dtype == torch.float32
        (logp.sum() + 0.1 * entropy.sum()).backward()
        return {name: p.grad for name, p in copied.named_parameters()}, len(calls)

    plain, plain_calls = gradients(False)
    checkpointed, checkpointed_calls = gradients(True)
    assert (plain_calls, checkpointed_calls) == (1, 2)  # layer 0 recomputed in the backward pass
    assert set(plain) == set(checkpointed)
    for name, grad in checkpointed.items():
        assert grad is not None and grad.abs().sum() > 0, name
        assert torch.allclose(grad, plain[name], rtol=1e-3, atol=1e-6), name

    def update(checkpointing):  # the real update path: ppo_update puts the model in training mode
        copied = copy.deepcopy(model).eval()
        if checkpointing:
            copied.activation_checkpointing_enable()
        calls = []
        copied.model.layers[0].mlp.register_forward_pre_hook(lambda *args: calls.append(1))
        out = R.ppo_update(copied, torch.optim.SGD(copied.parameters(), lr=0.0), samples, old,
                           [torch.randn(len(r), generator=torch.Generator().manual_seed(k)) for k, r in enumerate(responses)],
                           R.dataclasses.replace(cfg, grad_clip=1e9), mini_batch=len(samples), rng=random.Random(0))
        return out["loss"], out["grad_norm"], len(calls)

    (loss_plain, norm_plain, calls_plain), (loss_ckpt, norm_ckpt, calls_ckpt) = update(False), update(True)
    assert calls_ckpt == 2 * calls_plain > 0
    assert loss_ckpt == pytest.approx(loss_plain, abs=1e-6) and norm_ckpt == pytest.approx(norm_plain, rel=1e-3)


def test_generate_left_pads_keeps_eos_flags_cut_and_records_each_tokens_logprob(tiny, monkeypatch):
    model, tok = tiny
    eos, pad = engine.eos_token_ids(model)[0], tok.pad_token_id
    new_tokens = torch.tensor([[11, 12, eos, pad], [13, 14, 15, 16]])

    undone_steps = [0]

    def fake_generate(input_ids, attention_mask, generation_config, logits_processor, cache):
        assert input_ids[1].tolist() == [pad, 8, 9] and attention_mask[1].tolist() == [0, 1, 1]
        assert cache is None  # two prompts, prefill_batch 0: generate prefills them itself
        for k in range(4):  # step k: the sampled token's logit is k, the other 19 of 20 are 0
            scores = torch.zeros(2, 20).scatter(1, new_tokens[:, k, None], float(k))
            logits_processor(torch.cat([input_ids, new_tokens[:, :k]], 1), scores)
        if undone_steps[0]:  # a deferred stop check runs one more step, then drops its token
            logits_processor(torch.cat([input_ids, new_tokens], 1), torch.zeros(2, 20))
        return torch.cat([input_ids, new_tokens], 1)

    monkeypatch.setattr(model, "generate", fake_generate)
    # log p of the step-k token = k - log(e^k + 19): 0 - log 20, 1 - log(e + 19), ...
    expected = torch.tensor([k - math.log(math.exp(k) + 19) for k in range(4)])
    for undone_steps[0] in (0, 1):
        out = R.generate(model, tok, [[5, 6, 7], [8, 9]], 4, 1.0)
        assert [(r.ids, r.hit_cap) for r in out] == [([11, 12, eos], False), ([13, 14, 15, 16], True)]
        assert torch.allclose(out[0].logp, expected[:3]) and torch.allclose(out[1].logp, expected)


@pytest.mark.parametrize("numerics", ["fp32", "bf16-autocast"])
def test_old_logprobs_match_sampling_logits_for_mixed_prompt_lengths(tiny, monkeypatch, numerics):
    model, tok = tiny
    if numerics == "bf16-autocast":  # the GPU path, with CPU autocast standing in for CUDA's
        bf16 = lambda device: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
        monkeypatch.setattr(R, "autocast", bf16)  # the scoring forward
        monkeypatch.setattr(engine, "autocast", bf16)  # generate
    prompts = [R.encode_prompt(tok, "short"), R.encode_prompt(tok, "a much longer prompt " * 5)]
    captured, original = {}, model.generate

    def spy(**kwargs):
        out = original(**kwargs, return_dict_in_generate=True, output_logits=True)
        captured["logits"] = out.logits
        return out.sequences

    monkeypatch.setattr(model, "generate", spy)
    head_dtypes = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, o: head_dtypes.append(o.dtype))
    torch.manual_seed(0)
    try:
        responses = R.generate(model, tok, prompts, 5, 1.0)
    finally:
        hook.remove()
    assert set(head_dtypes) == {torch.float32}  # sampled from fp32 logits, as they are scored
    # bf16 autocast: the cached decode and the full scoring forward round differently in the body
    atol = 1e-4 if numerics == "fp32" else 5e-3
    for b, (ids, *_) in enumerate(responses):
        expected = torch.stack([torch.log_softmax(step[b], -1)[t] for step, t in zip(captured["logits"], ids)])
        assert torch.allclose(R.sequence_logprobs(model, [prompts[b]], [ids], small_cfg()), expected, atol=atol)


def test_generate_uses_the_given_temperature(tiny):
    model, tok = tiny
    torch.manual_seed(0)
    cold = R.generate(model, tok, [R.encode_prompt(tok, "anything")] * 64, 1, 0.01)
    assert len({ids[0] for ids, *_ in cold}) <= 2


def test_prefill_in_sub_batches_samples_the_same_tokens_and_logprobs(tiny):
    """prefill_batch < B*G: prompt[:-1] prefilled a few rows at a time into one joined cache, then
    generate runs only the last prompt column. Same seed -> the same tokens exactly (measured on
    CPU fp32), and the recorded log-probs to rounding (measured: <= 5e-7)."""
    model, tok = tiny
    prompts = [R.encode_prompt(tok, "go " * k + "north") for k in (1, 9, 3, 17, 5)]  # left padding
    forwards = []  # (rows, columns) of every forward through the transformer body
    hook = model.model.register_forward_pre_hook(
        lambda module, args, kwargs: forwards.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        runs = {}
        for prefill_batch in (0, 2, 5):  # 0 and 5 (= all rows) are generate's own one-shot prefill
            forwards.clear()
            torch.manual_seed(7)
            runs[prefill_batch] = (R.generate(model, tok, prompts, 10, 1.0, prefill_batch=prefill_batch),
                                   list(forwards))
    finally:
        hook.remove()
    width = max(map(len, prompts))
    (one_shot, one_shot_forwards), (split, split_forwards) = runs[0], runs[2]
    assert one_shot_forwards[0] == (5, width) and runs[5][1][0] == (5, width)
    assert split_forwards[:4] == [(2, width - 1), (2, width - 1), (1, width - 1), (5, 1)]
    assert all(shape == (5, 1) for shape in split_forwards[3:])
    assert [r.ids for r in split] == [r.ids for r in one_shot] == [r.ids for r in runs[5][0]]
    assert sum(len(r.ids) for r in one_shot) > len(prompts)  # more than one token per answer compared
    for a, b in zip(split, one_shot):
        assert torch.allclose(a.logp, b.logp, atol=2e-6, rtol=0)


def test_recorded_logprobs_are_the_scoring_passes_at_temperature_one(tiny):
    """The log-prob each token had when it was sampled equals the old-policy log-prob of the scoring
    pass (CPU fp32: gap < 1e-4; measured ~5e-7), with a split prefill too. At another temperature
    the recorder still sees the temperature-1 scores: in transformers 5.24 the processors given to
    generate run before the temperature warper."""
    model, tok = tiny
    prompts = [R.encode_prompt(tok, "short"), R.encode_prompt(tok, "a much longer prompt " * 5)] * 2
    cfg = small_cfg()
    for temperature, prefill_batch in ((1.0, 0), (1.0, 1), (0.5, 0)):
        torch.manual_seed(3)
        responses = R.generate(model, tok, prompts, 8, temperature, prefill_batch=prefill_batch)
        samples = [R.TurnSample(0, b, p, r.ids, False, sample_logp=r.logp) for b, (p, r) in enumerate(zip(prompts, responses))]
        gap = R.sampling_numerics(samples, R.response_logprobs(model, samples, cfg))
        assert sum(len(r.ids) for r in responses) > len(prompts)  # several tokens per answer compared
        assert gap["sample_logp_gap_max"] < 1e-4
    # hand-made: gaps 0.5 and 0.25 on one sample's two tokens, 0 on the other's
    made = [R.TurnSample(0, 0, [1], [2, 3], False, sample_logp=torch.tensor([-1.0, -2.0])),
            R.TurnSample(0, 1, [1], [4], False, sample_logp=torch.tensor([-3.0]))]
    assert R.sampling_numerics(made, [torch.tensor([-1.5, -1.75]), torch.tensor([-3.0])]) == {
        "sample_logp_gap_mean": 0.25, "sample_logp_gap_max": 0.5}
    assert R.sampling_numerics([R.TurnSample(0, 0, [1], [2], False)], [torch.tensor([-1.0])]) == {}


# --- the static sampler (--sampler static): CPU equality with the eager path ------------------------------


@pytest.fixture(scope="module")
def grouped():
    """A model with grouped-query attention (4 query heads over 2 key/value heads, as Qwen2.5 groups 6 over 2)
    and the real 151,936-token vocabulary: its decode steps take the packed attention."""
    model, tok = R.load_policy("random:small-vocab151k", torch.device("cpu"), torch.float32, seed=0)
    rng = random.Random(0)
    prompts = [[rng.randrange(len(tok)) for _ in range(rng.randint(5, 40))] for _ in range(6)]
    return model, tok, prompts


@pytest.mark.parametrize("temperature", [1.0, 0.5])
@pytest.mark.parametrize("prefill_batch", [0, 4])
def test_static_sampler_samples_the_eager_tokens_and_log_probs_on_cpu(grouped, temperature, prefill_batch):
    """Same seed, same tokens, log-probs equal within fp32 rounding, at temperature 1 (training) and 0.5
    (a validation): a static path that lost the temperature, or sampled from other logits, fails here."""
    model, tok, prompts = grouped
    out = {}
    for sampler in ("eager", "static"):
        torch.manual_seed(11)
        out[sampler] = engine.generate(model, tok, prompts, 10, temperature, prefill_batch=prefill_batch,
                                       sampler=sampler)
    for eager, static in zip(out["eager"], out["static"]):
        assert static.ids == eager.ids and static.hit_cap == eager.hit_cap
        assert torch.allclose(static.logp, eager.logp, atol=1e-5)
    if temperature == 1.0:  # and they are the scoring pass's log-probs (the temperature-1 distribution)
        scored = R.sequence_logprobs(model, prompts, [s.ids for s in out["static"]], small_cfg())
        assert torch.allclose(torch.cat([s.logp for s in out["static"]]), scored, atol=1e-5)
    copy = model.__dict__["sampling_copy"]  # the copy it sampled with: built once, packed attention
    assert copy.config._attn_implementation == engine.PACKED_SDPA and not model.config._attn_implementation == engine.PACKED_SDPA


def test_static_sampler_follows_the_policy_and_samples_from_fp32_logits(grouped, monkeypatch):
    """Under bf16 autocast (the GPU's numerics, on the CPU) the copy's logits are fp32: a head left in bf16
    gives scores that bf16 represents exactly. After an update the copy samples the updated policy."""
    model, tok, prompts = grouped
    model = copy.deepcopy(model)
    monkeypatch.setattr(engine, "autocast", lambda device: torch.autocast("cpu", dtype=torch.bfloat16))
    seen = []
    real_call = engine.SampledTokenLogprobs.__call__
    monkeypatch.setattr(engine.SampledTokenLogprobs, "__call__",
                        lambda self, ids, scores: (seen.append(scores.clone()), real_call(self, ids, scores))[1])
    engine.generate(model, tok, prompts, 4, 1.0, sampler="static")
    scores = torch.cat(seen)
    assert scores.dtype == torch.float32 and not torch.equal(scores, scores.bfloat16().float())
    with torch.no_grad():  # an "update": the next call's copy has the new weights
        model.model.norm.weight.mul_(3.0)
    out = {}
    for sampler in ("eager", "static"):
        torch.manual_seed(2)
        out[sampler] = engine.generate(model, tok, prompts, 6, 1.0, sampler=sampler)
    assert [s.ids for s in out["static"]] == [s.ids for s in out["eager"]]


def test_a_bf16_static_cache_gives_attention_the_same_numbers(grouped, monkeypatch):
    """Under bf16 autocast attention reads bf16 keys and values whatever the cache holds: a bf16 cache (the
    GPU's) and an fp32 one sample the same tokens with bit-identical log-probs."""
    model, tok, prompts = grouped
    monkeypatch.setattr(engine, "autocast", lambda device: torch.autocast("cpu", dtype=torch.bfloat16))
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        monkeypatch.setattr(engine, "kv_dtype", lambda device, dtype=dtype: dtype)
        torch.manual_seed(4)
        out[dtype] = engine.generate(model, tok, prompts, 8, 1.0, prefill_batch=4, sampler="static")
    for full, half in zip(out[torch.float32], out[torch.bfloat16]):
        assert full.ids == half.ids and torch.equal(full.logp, half.logp)


def test_packed_decode_attention_equals_attention_over_repeated_keys():
    torch.manual_seed(0)
    batch, kv_heads, groups, length, dim = 3, 2, 6, 17, 8
    query = torch.randn(batch, kv_heads * groups, 1, dim)
    key, value = torch.randn(batch, kv_heads, length, dim), torch.randn(batch, kv_heads, length, dim)
    mask = torch.rand(batch, 1, 1, length) > 0.3
    mask[..., -1] = True
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = groups, True
    packed, _ = engine.packed_decode_sdpa(module, query, key, value, mask, scaling=dim ** -0.5)
    repeated = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), attn_mask=mask)
    assert packed.shape == (batch, 1, kv_heads * groups, dim)  # (batch, query length, heads, dim), as sdpa's
    assert torch.allclose(packed, repeated.transpose(1, 2), atol=1e-6)


def test_static_shapes_are_few_on_a_gpu_and_exact_on_cpu():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [engine.row_bucket(n, cuda) for n in (1, 8, 9, 32, 33, 128, 137)] == [8, 8, 16, 32, 64, 128, 256]
    assert [engine.cache_length(n, cuda) for n in (1, 512, 513, 2560)] == [512, 512, 1024, 2560]
    assert engine.compile_config().dynamic is False and torch._dynamo.config.recompile_limit >= engine.SHAPES_COMPILED
    assert (engine.row_bucket(37, cpu), engine.cache_length(999, cpu)) == (37, 999)
    ids, mask = engine.pad_rows(torch.tensor([[5, 6, 7]]), torch.tensor([[0, 1, 1]]), 3, pad=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 0], [0, 0, 0]] and mask.tolist() == [[0, 1, 1], [0, 0, 1], [0, 0, 1]]


def test_a_static_generate_pads_its_rows_and_returns_the_callers(grouped, monkeypatch):
    """On a GPU the rows are padded to a bucket (engine.row_bucket); filler rows are sampled and dropped."""
    model, tok, prompts = grouped
    monkeypatch.setattr(engine, "row_bucket", lambda rows, device: rows + 5)
    out = engine.generate(model, tok, prompts, 5, 1.0, sampler="static")
    assert len(out) == len(prompts)
    scored = R.sequence_logprobs(model, prompts, [s.ids for s in out], small_cfg())
    assert torch.allclose(torch.cat([s.logp for s in out]), scored, atol=1e-5)
