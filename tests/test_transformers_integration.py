"""``attn_implementation="fmha_ops"`` in Hugging Face transformers: tiny random-weight models built from each
architecture's config (no download), against ``attn_implementation="eager"`` with the same weights.

Checked per architecture (Llama, Qwen 3, Mistral with a sliding window, Gemma 2 with softcap, Gemma 3 with sliding
and full layers and softcap, GPT-OSS with sinks and windows, DeepSeek-V3 with q/k head dim 192 and value head dim 128): float32
logits of a left-padded batch (at the tokens, not the padding) and of sequences packed into rows (position_ids);
greedy ``generate()`` token-identical with the dynamic and the static cache, and ``generate_batch`` (continuous
batching on transformers' paged cache) token-identical to eager's ``generate`` per prompt; every call hands the
kernels a structured mask (causal / local / block-diagonal), never a dense bias. On the CPU the selector picks the
reference op; ``test_triton_ops_through_models`` forces the Triton forward and decoders (interpreter, float16).
``gpu``: the same in bfloat16 on the H200, where the Triton / FA4 ops run.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")
import fmha_ops.integrations.transformers as fmha_hf  # noqa: E402  (registers the implementations)
from tests.conftest import DEVICE  # noqa: E402

VOCAB = 128
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _config(arch: str):
    from transformers import (DeepseekV3Config, Gemma2Config, Gemma3TextConfig, GptOssConfig, LlamaConfig,
                              MistralConfig, Qwen3Config)

    if arch == "llama":
        return LlamaConfig(**SMALL)
    if arch == "qwen3":
        return Qwen3Config(**SMALL, head_dim=16)
    if arch == "mistral":
        return MistralConfig(**SMALL, sliding_window=5)
    if arch == "gemma3":
        return Gemma3TextConfig(**{**SMALL, "num_hidden_layers": 3}, head_dim=16, sliding_window=5,
                                attn_logit_softcapping=5.0,
                                layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    if arch == "gemma2":  # attention softcap (Gemma 3's is off by default) and a query scale of its own
        return Gemma2Config(**SMALL, head_dim=16, sliding_window=5, attn_logit_softcapping=5.0,
                            query_pre_attn_scalar=24)
    if arch == "gpt-oss":
        # max_position_embeddings: the default's, which its YaRN rope scaling is consistent with
        return GptOssConfig(**{**SMALL, "max_position_embeddings": 131072}, head_dim=16, sliding_window=5,
                            num_local_experts=4, num_experts_per_tok=2,
                            layer_types=["sliding_attention", "full_attention"])
    if arch == "deepseek-v3":
        return DeepseekV3Config(**{**SMALL, "num_key_value_heads": 4}, q_lora_rank=32, kv_lora_rank=32,
                                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=4,
                                num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32,
                                first_k_dense_replace=1, n_shared_experts=1)
    raise ValueError(arch)


ARCHS = ["llama", "qwen3", "mistral", "gemma2", "gemma3", "gpt-oss", "deepseek-v3"]


def _models(arch: str, dtype=torch.float32, device=DEVICE):
    """(eager model, fmha_ops model) with the same random weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)  # one config each: from_config sets the implementation on the config it is given
    eager = AutoModelForCausalLM.from_config(_config(arch), attn_implementation="eager", dtype=dtype).to(device).eval()
    ours = AutoModelForCausalLM.from_config(_config(arch), attn_implementation="fmha_ops", dtype=dtype).to(device)
    ours.eval().load_state_dict(eager.state_dict())
    assert (eager.config._attn_implementation, ours.config._attn_implementation) == ("eager", "fmha_ops")
    if arch == "gpt-oss":  # sinks that matter (the config initializes them to small values)
        with torch.no_grad():
            for a, b in zip(eager.modules(), ours.modules()):
                if hasattr(a, "sinks"):
                    a.sinks.normal_(0.0, 2.0)
                    b.sinks.copy_(a.sinks)
    return eager, ours


@pytest.fixture
def masks(monkeypatch):
    """The attn_bias of every memory_efficient_attention call the integration makes while the test runs."""
    seen = []
    call = fmha_hf.memory_efficient_attention

    def spy(q, k, v, attn_bias=None, **kwargs):
        seen.append(attn_bias)
        return call(q, k, v, attn_bias, **kwargs)
    monkeypatch.setattr(fmha_hf, "memory_efficient_attention", spy)
    return seen


def _structured_only(masks: list) -> None:
    """Every mask is None or one of the library's structured masks (no tensor bias), and there were calls."""
    assert masks and not any(isinstance(m, torch.Tensor) for m in masks), [type(m).__name__ for m in masks]


def _left_padded_batch(device=DEVICE):
    """Two sequences, 11 and 7 tokens, the second left-padded: input_ids and attention_mask (2, 11)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 11), generator=g)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :4] = 0
    ids[1, :4] = 0
    return ids.to(device), mask.to(device)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_left_padded(arch, masks):
    eager, ours = _models(arch)
    ids, mask = _left_padded_batch()
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=mask).logits
        got = ours(input_ids=ids, attention_mask=mask).logits
        single = ours(input_ids=ids[:1]).logits  # no padding: the structured causal / window masks, no packing
    tokens = mask.bool()
    assert torch.allclose(got[tokens], want[tokens], atol=2e-5, rtol=1e-4), (got[tokens] - want[tokens]).abs().max()
    assert torch.allclose(single, want[:1], atol=2e-5, rtol=1e-4)
    _structured_only(masks)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generate_token_identical(arch, cache, masks):
    """8 new tokens after an 11-token prompt: past the 5-token windows (sliding layers' caches wrap)."""
    eager, ours = _models(arch)
    ids, mask = _left_padded_batch()
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation=cache)
    want = eager.generate(input_ids=ids, attention_mask=mask, **kwargs)
    got = ours.generate(input_ids=ids, attention_mask=mask, **kwargs)
    assert torch.equal(got, want)
    _structured_only(masks)


#: the architectures whose layers are all full attention: continuous batching's decode-only steps read its paged
#: cache in place (transformers keeps that path off where a layer slides a window, and for DeepSeek-V3's latent cache)
PAGED_DECODE_ARCHS = {"llama", "qwen3"}


@pytest.fixture
def paged_decodes(monkeypatch):
    """The query shapes of every flash_attn_with_kvcache call the integration makes while the test runs."""
    seen = []
    call = fmha_hf.flash_attn_with_kvcache

    def spy(q, *args, **kwargs):
        seen.append(tuple(q.shape))
        return call(q, *args, **kwargs)
    monkeypatch.setattr(fmha_hf, "flash_attn_with_kvcache", spy)
    return seen


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_batch_continuous_batching(arch, masks, paged_decodes):
    """transformers' continuous batching on its paged cache (16-token pages, 12 tokens a step: prompts prefilled in
    chunks beside other requests' decode steps) gives eager's greedy tokens for each prompt alone; every call that
    prefills is one block-diagonal (bottom-right causal or local) call over the step's sequences, and where every layer
    is full attention the decode-only steps read and append to the paged cache in place (flash_attn_with_kvcache:
    one query token per sequence)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    eager, ours = _models(arch)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], list(range(20, 40))]
    config = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    batching = ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=12, page_size=16, return_logprobs=True)
    got = ours.generate_batch(prompts, generation_config=config, continuous_batching_config=batching)
    assert ours.config._attn_implementation == "fmha_ops"
    for i, prompt in enumerate(prompts):
        want = eager.generate(input_ids=torch.tensor([prompt], device=DEVICE), max_new_tokens=6, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
        assert got[f"req_{i}"].generated_tokens == want[0, len(prompt):].tolist(), i
        with torch.no_grad():  # the chosen tokens' log-probabilities (greedy tokens alone miss small errors)
            logprobs = eager(input_ids=want).logits[0, len(prompt) - 1:-1].log_softmax(-1)
        logprobs = logprobs.gather(1, want[0, len(prompt):, None])[:, 0]
        assert torch.allclose(torch.tensor(got[f"req_{i}"].logprobs, device=DEVICE), logprobs, atol=1e-4), i
    assert all(isinstance(m, fmha_hf.ab.BlockDiagonalMask) for m in masks) and len(masks) >= 4
    if arch in PAGED_DECODE_ARCHS:
        assert len(paged_decodes) >= 2 * ours.config.num_hidden_layers and {s[1] for s in paged_decodes} == {1}
    else:
        assert not paged_decodes


def test_paged_decode_step_matches_the_gathered_cache():
    """A decode-only continuous-batching step as transformers passes it on its paged cache (block_table, k_cache,
    v_cache: pages in any order, -1 past a sequence's pages): the new tokens land in their slots, nothing else in
    the cache changes, and the output is the same step's on the cache gathered into sequences (cu_seq_lens_q /
    cu_seq_lens_k), with GQA, sinks (s_aux), a sliding window and Kv != K."""
    g = torch.Generator().manual_seed(4)
    hq, hkv, d, dv, page, pages = 4, 2, 48, 32, 8, 12
    lengths = [13, 1, 8, 17]  # per sequence, with its new token
    k_cache, v_cache = torch.randn(pages, page, hkv, d, generator=g), torch.randn(pages, page, hkv, dv, generator=g)
    table = torch.full((len(lengths), 3), -1, dtype=torch.int32)
    free = torch.randperm(pages, generator=g).tolist()
    for i, n in enumerate(lengths):
        for j in range(-(-n // page)):
            table[i, j] = free.pop()
    q = torch.randn(1, hq, len(lengths), d, generator=g)  # BHMK, as transformers hands them over
    k, v = torch.randn(1, hkv, len(lengths), d, generator=g), torch.randn(1, hkv, len(lengths), dv, generator=g)
    cu_q = torch.arange(len(lengths) + 1, dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    module = torch.nn.Module().eval()
    options = dict(scaling=d ** -0.5, sliding_window=5, s_aux=torch.randn(hq, generator=g) * 2, cu_seq_lens_q=cu_q,
                   cu_seq_lens_k=cu_k)
    caches = k_cache.clone(), v_cache.clone()
    out, _ = fmha_hf.attention(module, q, k, v, None, block_table=table, k_cache=k_cache, v_cache=v_cache, **options)
    # each sequence's cache slots, in token order (pages * page + offset); its last one holds the new token
    slots = [torch.cat([table[i, j] * page + torch.arange(page) for j in range(-(-n // page))])[:n]
             for i, n in enumerate(lengths)]
    new_slots = torch.stack([s[-1] for s in slots])
    for cache, before, new in ((k_cache, caches[0], k), (v_cache, caches[1], v)):
        flat, flat_before = cache.view(pages * page, hkv, -1), before.view(pages * page, hkv, -1)
        assert torch.equal(flat[new_slots], new[0].transpose(0, 1))
        rest = torch.ones(pages * page, dtype=torch.bool)
        rest[new_slots] = False
        assert torch.equal(flat[rest], flat_before[rest])
    keys, values = (c.view(pages * page, hkv, -1)[torch.cat(slots)].transpose(0, 1)[None] for c in (k_cache, v_cache))
    want, _ = fmha_hf.attention(module, q, keys, values, None, **options)
    assert out.shape == (1, len(lengths), hq, dv)
    assert torch.allclose(out, want, atol=1e-5, rtol=1e-5), (out - want).abs().max()


@pytest.mark.parametrize("arch", ["llama", "gemma3", "deepseek-v3"])
def test_packed_sequences(arch, masks):
    """Sequences packed into batch rows (position_ids restarting, no attention mask, no cache, as padding-free
    training feeds them): eager's logits, through one block-diagonal call per layer."""
    eager, ours = _models(arch)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (2, 20), generator=g).to(DEVICE)
    positions = torch.tensor([[*range(7), *range(4), *range(9)], [*range(12), *range(8)]], device=DEVICE)
    with torch.no_grad():
        want = eager(input_ids=ids, position_ids=positions, use_cache=False).logits
        got = ours(input_ids=ids, position_ids=positions, use_cache=False).logits
        alone = eager(input_ids=ids[:1, 7:11], position_ids=positions[:1, 7:11], use_cache=False).logits
    assert torch.allclose(want[0, 7:11], alone[0], atol=2e-5, rtol=1e-4)  # the packing is real
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (got - want).abs().max()
    assert all(isinstance(m, fmha_hf.ab.BlockDiagonalMask) for m in masks) and masks


@pytest.mark.parametrize("arch", ["gpt-oss", "gemma2", "deepseek-v3"])
def test_triton_ops_through_models(arch):
    """The Triton forward and decoders, forced (interpreter on the CPU, float16): GPT-OSS's sinks and windows, Gemma
    2's softcap and windows, DeepSeek-V3's K=192 / Kv=128; left-padded prefill logits and generate()'s decode-step
    logits near eager's float32 logits on the same tokens (measured rel 6.8e-4 / 1.3e-3 / 9.7e-4)."""
    import fmha_ops

    eager, ours = _models(arch)
    ours.half()
    ids, mask = _left_padded_batch()
    with fmha_ops.use_ops("triton_attnF", "triton_decoderF", "triton_splitKF"):
        gen = ours.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0,
                            output_logits=True, return_dict_in_generate=True)
        with torch.no_grad():
            prefill = ours(input_ids=ids, attention_mask=mask).logits.float()
    full_mask = torch.cat([mask, torch.ones_like(gen.sequences[:, mask.shape[1]:])], 1)
    with torch.no_grad():
        want = eager(input_ids=gen.sequences, attention_mask=full_mask).logits
    tokens = mask.bool()
    rel = ((prefill[tokens] - want[:, :mask.shape[1]][tokens]).norm() / want[:, :mask.shape[1]][tokens].norm()).item()
    assert rel < 5e-3, rel
    steps, want = torch.stack(gen.logits, 1).float(), want[:, mask.shape[1] - 1:-1]
    assert ((steps - want).norm() / want.norm()).item() < 5e-3


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt-oss", "deepseek-v3"])
def test_generate_static_cache_compiled(arch, monkeypatch):
    """The static cache's decode steps of a left-padded batch under torch.compile (aot_eager on the CPU: dynamo
    traces the mask and attention functions) are whole graphs: dynamo reports no graph break (the padding reaches
    ``flash_attn_with_kvcache`` as ``cache_leftpad`` / ``cache_seqlens`` computed on the device, where packing by
    data-dependent lengths broke the graph at every layer), over 12 new tokens without reaching dynamo's recompile
    limit; tokens identical to eager's, logits within float32 tolerance. Mistral: every layer slides a window, its mask
    built inside the compiled step (the mask function told by its code, not its name); GPT-OSS: sinks and sliding
    layers' static caches; DeepSeek-V3: K=192 / Kv=128 caches."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    eager, ours = _models(arch)
    ids, mask = _left_padded_batch()
    packed, pack = [], fmha_hf._packed

    def packing(q, *args):  # the eager path: the prefill's (11 queries); a decode step's where dynamo did not trace it
        packed.append(q.shape[1])
        return pack(q, *args)
    monkeypatch.setattr(fmha_hf, "_packed", packing)
    config = CompileConfig(backend="aot_eager", fullgraph=False)
    config._compile_all_devices = True  # transformers compiles only on accelerators unless told
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, cache_implementation="static",
                  output_logits=True, return_dict_in_generate=True)
    torch._dynamo.reset()
    counters.clear()
    got = ours.generate(input_ids=ids, attention_mask=mask, compile_config=config, **kwargs)
    assert counters["stats"]["calls_captured"] > 0
    assert not counters["graph_break"], list(counters["graph_break"])
    assert packed and set(packed) == {ids.shape[1]}, packed
    want = eager.generate(input_ids=ids, attention_mask=mask, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    logits, want_logits = torch.stack(got.logits), torch.stack(want.logits)
    assert ((logits - want_logits).norm() / want_logits.norm()).item() < 1e-5


def test_gpt_oss_sinks_get_gradients():
    """Training through the integration: the sinks (s_aux) and the weights get eager's gradients."""
    eager, ours = _models("gpt-oss")
    ids, _ = _left_padded_batch()
    grads = []
    for model in (eager, ours):
        model.train()
        model.zero_grad()
        model(input_ids=ids[:1], labels=ids[:1]).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if "sinks" in n or "q_proj" in n})
    for name, g in grads[0].items():
        assert torch.allclose(grads[1][name], g, atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("mq,window", [(1, None), (2, None), (1, 4), (3, 6)])
def test_left_padded_decode_matches_packing(mq, window):
    """The traced decode step's call (``cache_leftpad`` / ``cache_seqlens`` from the padding, on the cache as it is)
    equals the eager packing of the same left-padded keys: a static cache longer than the tokens, a sequence with
    no padding, sinks, windows and several queries."""
    g = torch.Generator().manual_seed(mq)
    b, mk, slots = 3, 16, 12
    keys = torch.ones(b, slots, dtype=torch.bool)
    keys[1, :5], keys[2, :slots - mq] = False, False  # the last sequence: its queries only
    q = torch.randn(b, mq, 4, 8, generator=g)
    k, v = (torch.randn(b, mk, 2, 8, generator=g) for _ in range(2))
    options = dict(scale=0.4, softcap=0.0, sinks=torch.randn(4, generator=g), p=0.0)
    got = fmha_hf._left_padded_decode(q, k, v, keys, window, options)
    want = fmha_hf._packed(q, k, v, keys, True, window, options, None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_encoder_with_bidirectional_sliding_windows(masks):
    """ModernBERT (bidirectional; global and sliding-window layers, whose ``sliding_window`` argument is one more than
    the mask's half window): a right-padded batch's logits at the tokens as eager's, the global layers' padding
    packed (block-diagonal), the sliding layers' windows as a dense bias from their mask function."""
    from transformers import AutoModelForMaskedLM, ModernBertConfig

    config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  local_attention=6, global_attn_every_n_layers=3, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  cls_token_id=1, sep_token_id=2, max_position_embeddings=256)
    torch.manual_seed(0)
    eager = AutoModelForMaskedLM.from_config(ModernBertConfig(**config), attn_implementation="eager").to(DEVICE).eval()
    ours = AutoModelForMaskedLM.from_config(ModernBertConfig(**config), attn_implementation="fmha_ops").to(DEVICE)
    ours.eval().load_state_dict(eager.state_dict())
    ids, mask = torch.randint(3, VOCAB, (2, 15), generator=torch.Generator().manual_seed(6)), torch.ones(2, 15)
    mask[1, 10:] = 0
    ids, mask = ids.to(DEVICE), mask.long().to(DEVICE)
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=mask).logits
        got = ours(input_ids=ids, attention_mask=mask).logits
    tokens = mask.bool()
    assert torch.allclose(got[tokens], want[tokens], atol=2e-5, rtol=1e-4), (got[tokens] - want[tokens]).abs().max()
    assert [type(m).__name__ for m in masks] == ["BlockDiagonalMask", "Tensor", "Tensor"]


def test_transformers_is_not_a_runtime_dependency():
    """Importing fmha_ops (every backend registered) loads no transformers: only the integration module needs it."""
    from tests.compiled_child import run_compiled

    done = run_compiled("import sys, fmha_ops; print('transformers' in sys.modules)")
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr


def test_structured_mask():
    """No padding -> None; left padding -> the key slots' padding; an unknown mask function -> a dense bias."""
    from transformers.masking_utils import causal_mask_function, or_masks, sliding_window_causal_mask_function

    mask = torch.ones(2, 6, dtype=torch.bool)
    assert fmha_hf.structured_mask(2, 6, 6, attention_mask=mask, mask_function=causal_mask_function) is None
    assert fmha_hf.structured_mask(2, 6, 6, attention_mask=mask,
                                 mask_function=sliding_window_causal_mask_function(3)) is None
    mask[1, :2] = False
    padding = fmha_hf.structured_mask(2, 6, 6, attention_mask=mask, mask_function=causal_mask_function)
    assert padding.shape == (2, 6) and padding.dtype == torch.bool and padding.sum().item() == 10
    static = fmha_hf.structured_mask(2, 1, 16, q_offset=6, attention_mask=torch.ones(2, 7, dtype=torch.bool),
                                   mask_function=causal_mask_function)  # a static cache's empty slots: left out
    assert static.shape == (2, 7) and bool(static.all())
    custom = or_masks(causal_mask_function, lambda b, h, q, kv: kv == 0)
    dense = fmha_hf.structured_mask(2, 6, 6, attention_mask=None, mask_function=custom, dtype=torch.float32)
    assert dense.shape == (2, 1, 6, 6) and dense.dtype == torch.float32 and (dense[:, :, :, 0] == 0).all()


def test_structured_mask_never_dense_where_a_structure_exists():
    """Every mask function transformers builds from causal / sliding-window / bidirectional (prefill, decode with
    the dynamic or a static cache, a sliding layer's cache, with and without left padding, packed sequences) comes
    back structured: None, the key slots' padding (bool (B, slots)) or the sequence index per token; a mask function
    of another kind (an overlay, packed sequences over one) comes back dense."""
    from transformers.masking_utils import (and_masks, bidirectional_mask_function, causal_mask_function,
                                            find_packed_sequence_indices, or_masks, packed_sequence_mask_function,
                                            remap_positions_for_packed_sequence,
                                            sliding_window_causal_mask_function)

    padded = torch.ones(2, 16, dtype=torch.bool)
    padded[1, :3] = False
    calls = [  # (q_length, kv_length, q_offset, kv_offset, attention_mask)
        (6, 6, 0, 0, None), (6, 6, 0, 0, padded[:, :6]),  # prefill
        (1, 7, 6, 0, padded[:, :7]), (1, 7, 6, 0, None),  # a dynamic cache's decode step
        (1, 16, 6, 0, padded[:, :7]),  # a static cache: slots past the query are empty
        (1, 4, 9, 6, padded[:, :10]), (2, 5, 9, 6, padded[:, :11]),  # a sliding layer's cache: keys from slot 6
    ]
    functions = [causal_mask_function, sliding_window_causal_mask_function(3), bidirectional_mask_function]
    for fn in functions:
        for q_length, kv_length, q_offset, kv_offset, attention_mask in calls:
            got = fmha_hf.structured_mask(2, q_length, kv_length, q_offset, kv_offset, mask_function=fn,
                                          attention_mask=attention_mask, dtype=torch.float32)
            assert got is None or (got.dim() == 2 and got.dtype == torch.bool), (fn, q_length, kv_length)
    positions = torch.tensor([[*range(3), *range(5)], [*range(8)]])
    segments = find_packed_sequence_indices(positions)
    for fn in functions[:2]:
        packed = and_masks(remap_positions_for_packed_sequence(fn, positions), packed_sequence_mask_function(segments))
        got = fmha_hf.structured_mask(2, 8, 8, mask_function=packed, dtype=torch.float32)
        assert got is segments
    overlay = or_masks(causal_mask_function, lambda b, h, q, kv: kv == 0)
    packed = and_masks(remap_positions_for_packed_sequence(overlay, positions), packed_sequence_mask_function(segments))
    assert fmha_hf.structured_mask(2, 8, 8, mask_function=packed, dtype=torch.float32).shape == (2, 1, 8, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["fmha_ops", "fmha_ops_fp8", "fmha_ops_i8fp8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_bf16_models(arch, implementation):
    """bfloat16 on the H200: logits of the left-padded batch near eager's (bf16 / fp8 tolerances), and the logits
    of generate()'s decode steps near eager's on the same tokens."""
    from transformers import AutoModelForCausalLM

    eager, ours = _models(arch, torch.bfloat16, "cuda")
    model = ours
    if implementation != "fmha_ops":
        model = AutoModelForCausalLM.from_config(_config(arch), attn_implementation=implementation,
                                                 dtype=torch.bfloat16).cuda().eval()
        model.load_state_dict(ours.state_dict())
    ids, mask = _left_padded_batch("cuda")
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=mask).logits.float()
        got = model(input_ids=ids, attention_mask=mask).logits.float()
    tokens = mask.bool()
    rel = ((got[tokens] - want[tokens]).norm() / want[tokens].norm()).item()
    assert rel < (2e-2 if implementation == "fmha_ops" else 0.15), rel
    if implementation == "fmha_ops":  # decode steps: their logits against eager's on the same tokens (teacher
        # forcing: greedy tokens of random tiny models near-tie, so bf16 rounding may flip one without an error)
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        steps = torch.stack(gen.logits, 1).float()  # (B, new, vocab)
        full_mask = torch.cat([mask, torch.ones_like(gen.sequences[:, mask.shape[1]:])], 1)
        with torch.no_grad():
            want = eager(input_ids=gen.sequences, attention_mask=full_mask).logits.float()
        want = want[:, mask.shape[1] - 1:-1]
        assert ((steps - want).norm() / want.norm()).item() < 2e-2


@pytest.mark.parametrize("implementation", ["fmha_ops_fp8", "fmha_ops_i8fp8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_variants_prefill(arch, implementation, monkeypatch):
    """The quantized variants' prefill (more than DECODE_QUERIES tokens: q/k/v quantized inside, padded batches
    packed; GPT-OSS's sinks and windows, Gemma's softcap, DeepSeek-V3's K=192 / Kv=128) near eager's logits, every
    layer's attention on quantized q (fp8, or int8 for i8fp8); their decode steps run unquantized."""
    from transformers import AutoModelForCausalLM

    eager, ours = _models(arch)
    model = AutoModelForCausalLM.from_config(_config(arch), attn_implementation=implementation).eval()
    model.load_state_dict(ours.state_dict())
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, VOCAB, (2, fmha_hf.DECODE_QUERIES + 5), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    dtypes, call = [], fmha_hf.memory_efficient_attention
    monkeypatch.setattr(fmha_hf, "memory_efficient_attention", lambda q, *a, **kw: dtypes.append(q.dtype) or call(
        q, *a, **kw))
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        got = model(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    quantized = torch.int8 if implementation == "fmha_ops_i8fp8" else torch.float8_e4m3fn
    assert dtypes == [quantized] * model.config.num_hidden_layers
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
    rel = ((got - want).norm() / want.norm()).item()
    # measured fp8 / i8fp8 relative: 1.9-4.4e-2 (Llama, Qwen 3, Mistral, Gemma 2 / 3, DeepSeek-V3), GPT-OSS (sinks
    # ~ N(0, 2)) 9.1e-2 / 6.4e-2
    assert cos > 0.99 and rel < 0.15, (cos, rel)


@pytest.mark.gpu
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("arch", ["llama", "gpt-oss"])
def test_gpu_static_cache_compiled_generate(arch, padded):
    """generate() with the static cache under transformers' default torch.compile (inductor, reduce-overhead) on
    the H200, bf16: decode-step logits near eager's on the same tokens (GPT-OSS: sinks and sliding layers in the
    CUDA graphs)."""
    eager, ours = _models(arch, torch.bfloat16, "cuda")
    ids, mask = _left_padded_batch("cuda")
    if not padded:
        ids, mask = ids[:1], mask[:1]
    gen = ours.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                        cache_implementation="static", output_logits=True, return_dict_in_generate=True)
    steps = torch.stack(gen.logits, 1).float()
    full_mask = torch.cat([mask, torch.ones_like(gen.sequences[:, mask.shape[1]:])], 1)
    with torch.no_grad():
        want = eager(input_ids=gen.sequences, attention_mask=full_mask).logits.float()[:, mask.shape[1] - 1:-1]
    assert ((steps - want).norm() / want.norm()).item() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_generate_batch_bf16(arch):
    """Continuous batching in bfloat16 on the H200 (no switch to flash: "fmha_ops" stays): the log-probabilities
    of the tokens generate_batch picks near eager's on the same tokens (teacher forcing; greedy tokens of random
    tiny models near-tie, so bf16 rounding may pick another token without an error)."""
    from transformers import ContinuousBatchingConfig

    _generate_batch_near_eager(arch, ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=24, page_size=16,
                                                              return_logprobs=True))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", sorted(PAGED_DECODE_ARCHS))
def test_gpu_generate_batch_decode_graphs(arch, paged_decodes):
    """Continuous batching's decode-only steps on its paged cache, replayed from CUDA graphs (bf16, H200): the
    batches are padded to the captured sizes (sequences of length 0, page-table rows of -1 reach the kernels); the
    log-probabilities of the chosen tokens near eager's."""
    from transformers import ContinuousBatchingConfig

    batching = ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=24, page_size=16, return_logprobs=True,
                                        use_cuda_graph=(False, True))
    _generate_batch_near_eager(arch, batching, prompts=[[5, 6, 7], [12, 13, 14, 15, 16], list(range(20, 60))])
    assert paged_decodes and {s[1] for s in paged_decodes} == {1}


def _generate_batch_near_eager(arch: str, batching, prompts=([5, 6, 7, 8, 9, 10, 11], [12, 13, 14],
                                                             list(range(20, 60)))) -> None:
    """generate_batch in bfloat16 on the GPU with ``batching`` (a ContinuousBatchingConfig returning logprobs): the
    log-probabilities of the tokens it picks within 5e-2 of eager's on the same tokens (teacher forcing)."""
    from transformers import GenerationConfig

    eager, ours = _models(arch, torch.bfloat16, "cuda")
    config = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    got = ours.generate_batch(list(prompts), generation_config=config, continuous_batching_config=batching)
    assert ours.config._attn_implementation == "fmha_ops"
    for i, prompt in enumerate(prompts):
        out = got[f"req_{i}"]
        tokens = torch.tensor([prompt + out.generated_tokens], device="cuda")
        with torch.no_grad():
            logits = eager(input_ids=tokens).logits.float()[0, len(prompt) - 1:-1]
        want = logits.log_softmax(-1).gather(1, tokens[0, len(prompt):, None])[:, 0]
        assert (torch.tensor(out.logprobs, device="cuda") - want).abs().max().item() < 5e-2, i
