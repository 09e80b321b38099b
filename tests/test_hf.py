"""Hugging Face transformers on fusedattn (``attn_implementation="fusedattn"``), model by model.

Tiny models built from configs with random weights (nothing downloaded): Llama, Mistral (sliding
window), Qwen2, Qwen3, Gemma 2 (softcap, alternating sliding layers, its own scaling) and gpt-oss
(sinks, sliding layers, MoE) and Llama 4 (a chunked layer and a full one), all with grouped-query heads. Each is checked by the correctness rule
against the same model with transformers' eager attention in float64 (the reference) and in the
test dtype (the eager baseline): logits, and the gradients of every attention weight (and of the
sinks), with no padding, with padding (a 2-D mask: packed sequences, not a dense mask), and
as one padding-free row of packed documents (``position_ids`` restarting; the reference runs each
document alone). Greedy generation of a left-padded batch with dynamic and static caches must give
the same tokens as eager; torch.compile must give the eager answer; dropout raises.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fusedattn  # noqa: E402
from fusedattn.integrations.transformers import NAME, attention_forward, register  # noqa: E402
from numerics import assert_close_to_reference  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float16  # the interpreter's bf16 matmul is wrong
BACKENDS = ["auto"] if ON_GPU else ["torch", "triton"]

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
WINDOW = 8  # narrower than the sequences below, so the sliding layers really slide

# name: (config class, model class, config options beyond COMMON)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(sliding_window=WINDOW, attn_logit_softcapping=5.0, query_pre_attn_scalar=12)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
                     max_position_embeddings=131072)),  # its YaRN defaults expect this length
    # chunked attention: layer 0 chunked (chunks of CHUNK, so 37 tokens cross four), layer 1 full (NoPE);
    # MoE in layer 0, a dense MLP in layer 1
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
               dict(attention_chunk_size=WINDOW, no_rope_layers=[1, 0], intermediate_size_mlp=96,
                    num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2)),
}
SEQLEN = 37
DOCUMENTS = (10, 17, 1, 9)  # a packed row: 37 tokens, one document of a single token


@pytest.fixture(autouse=True, scope="module")
def _registered():
    register()


def build(name: str, dtype=torch.float32, **overrides):
    config_class, model_class, options = MODELS[name]
    config = getattr(transformers, config_class)(**{**COMMON, **options, **overrides})
    torch.manual_seed(sum(map(ord, name)))  # a fixed seed per model (hash() varies per process)
    model = getattr(transformers, model_class)(config).eval()
    if getattr(config, "num_local_experts", None):
        model.set_experts_implementation("eager")  # the grouped-matmul experts refuse float64
    for module in model.modules():  # gpt-oss's sinks start at zero: make them matter
        if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
            torch.nn.init.normal_(module.sinks, std=1.0)
    return model.to(DEVICE, dtype)


_MODELS: dict = {}


def models(name: str):
    """(float64 model, test-dtype model), built once per name; the same weights."""
    if name not in _MODELS:
        base = build(name, torch.float64)
        _MODELS[name] = (base, copy.deepcopy(base).to(DTYPE))
    return _MODELS[name]


def attention_weights(model) -> dict:
    """The parameters whose gradients pass through attention: projections and sinks."""
    return {n: p for n, p in model.named_parameters()
            if any(part in n for part in ("q_proj", "k_proj", "v_proj", "o_proj", "sinks"))}


def layer_gradients(model) -> dict:
    """Each attention projection's gradient as one tensor, its bias (Qwen2's) flattened after its
    weight, and the sinks'. In a bf16 model the gradient errors of the whole network, eager's and
    ours alike, come mostly from the rounding of every other layer; for a 32-entry bias vector, the
    largest of those errors varies so much from draw to draw that ours landed 1.04-1.08x past twice
    eager's in 2 of about 300 comparisons on an H200, while the weights beside them, checked by
    the same rule, held. A layer's parameters are one gradient here, checked by the same rule."""
    grads: dict = {}
    for n, p in attention_weights(model).items():
        layer = n.rsplit(".", 1)[0] if n.endswith((".weight", ".bias")) else n
        grads.setdefault(layer, []).append(p.grad.detach().reshape(-1))
    return {layer: torch.cat(parts) for layer, parts in grads.items()}


def run(model, impl: str, inputs: dict, cotangent: torch.Tensor, valid: torch.Tensor):
    """logits at the valid positions and the attention weights' gradients of <logits, cotangent>."""
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    logits = model(**inputs, use_cache=False).logits
    logits = logits[valid]
    (logits.float() * cotangent.to(logits.device)).sum().backward()
    return logits.detach(), layer_gradients(model)


def run_alone(model, sequences: list, cotangent: torch.Tensor):
    """Each sequence in a forward of its own with eager attention (no padding, no packing):
    logits concatenated, and the attention weights' gradients of <logits, cotangent>."""
    model.set_attn_implementation("eager")
    model.zero_grad(set_to_none=True)
    logits = torch.cat([model(input_ids=ids[None], use_cache=False).logits[0] for ids in sequences])
    (logits.float() * cotangent.to(logits.device)).sum().backward()
    return logits.detach(), layer_gradients(model)


def check_against_eager(name: str, what: str, model64, model, inputs: dict, valid: torch.Tensor, backend: str,
                        sequences: list | None = None, gen: torch.Generator | None = None) -> None:
    """fusedattn on ``inputs`` against eager in float64 (the reference) and in the test dtype (the
    baseline): on the same inputs, or, given ``sequences``, on each sequence alone (a batch's
    padding or packing must not change its real tokens; and float64 eager turns a row that keeps
    no key into NaN, which then spreads through the next layer)."""
    cotangent = torch.randn(int(valid.sum()), COMMON["vocab_size"], generator=gen)
    if sequences is None:
        ref_logits, ref_grads = run(model64, "eager", inputs, cotangent, valid)
        eager_logits, eager_grads = run(model, "eager", inputs, cotangent, valid)
    else:
        ref_logits, ref_grads = run_alone(model64, sequences, cotangent)
        eager_logits, eager_grads = run_alone(model, sequences, cotangent)
    with fusedattn.use_backend(backend):
        our_logits, our_grads = run(model, NAME, inputs, cotangent, valid)
    assert_close_to_reference(f"{name} {what} logits", our_logits, eager_logits, ref_logits)
    for n in ref_grads:
        assert_close_to_reference(f"{name} {what} d{n}", our_grads[n], eager_grads[n], ref_grads[n])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(MODELS))
def test_logits_and_gradients(name, backend):
    """No padding: a batch of two sequences."""
    model64, model = models(name)
    gen = torch.Generator().manual_seed(len(name) * 7)
    ids = torch.randint(0, COMMON["vocab_size"], (2, SEQLEN), generator=gen).to(DEVICE)
    valid = torch.ones(2, SEQLEN, dtype=torch.bool, device=DEVICE)
    check_against_eager(name, "plain", model64, model, dict(input_ids=ids), valid, backend, gen=gen)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(MODELS))
def test_a_padded_batch_equals_its_sequences_alone(name, backend):
    """A 2-D padding mask (on the right, as training collators pad; left padding: the generation
    tests): fusedattn packs the real tokens for the varlen kernels."""
    model64, model = models(name)
    gen = torch.Generator().manual_seed(len(name) * 7 + 1)
    ids = torch.randint(0, COMMON["vocab_size"], (3, SEQLEN), generator=gen).to(DEVICE)
    mask = torch.ones(3, SEQLEN, dtype=torch.long, device=DEVICE)
    mask[1, -6:], mask[2, 2:] = 0, 0  # a shorter sequence, and one of two tokens
    sequences = [row[m.bool()] for row, m in zip(ids, mask)]
    check_against_eager(name, "padded", model64, model, dict(input_ids=ids, attention_mask=mask), mask.bool(),
                        backend, sequences, gen)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(MODELS))
def test_packed_documents_attend_within_their_own(name, backend):
    """One padding-free row of documents (position_ids restart per document) equals each document
    run alone: fusedattn finds the documents from position_ids, as FlashAttention's integration
    does (the reference runs them apart, so it holds for models whose eager masks ignore packing,
    gpt-oss among them)."""
    model64, model = models(name)
    gen = torch.Generator().manual_seed(len(name))
    ids = torch.randint(0, COMMON["vocab_size"], (1, sum(DOCUMENTS)), generator=gen).to(DEVICE)
    positions = torch.cat([torch.arange(n) for n in DOCUMENTS])[None].to(DEVICE)
    sequences = list(torch.split(ids[0], DOCUMENTS))
    valid = torch.ones(1, sum(DOCUMENTS), dtype=torch.bool, device=DEVICE)
    if name == "llama4":  # its layers do not pass position_ids on: transformers' own packed mask, as eager
        sequences = None
    check_against_eager(name, "packed", model64, model, dict(input_ids=ids, position_ids=positions), valid,
                        backend, sequences, gen)


@pytest.mark.parametrize("backend", BACKENDS)
def test_llama4_packed_row_follows_transformers_mask_with_cu_seq_lens(backend):
    """Llama 4 with ``position_ids`` that restart and ``cu_seq_lens_q/k`` as well: the model makes its
    own packed mask (its layers do not pass position_ids on), and fusedattn follows it, chunks
    counted from the row's start, as eager does, rather than the documents alone."""
    model64, model = models("llama4")
    gen = torch.Generator().manual_seed(9)
    documents = (20, 1, 16)  # two documents longer than two chunks
    ids = torch.randint(0, COMMON["vocab_size"], (1, sum(documents)), generator=gen).to(DEVICE)
    cu = torch.tensor([0, *torch.tensor(documents).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    positions = torch.cat([torch.arange(n) for n in documents])[None].to(DEVICE)
    inputs = dict(input_ids=ids, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                  max_length_q=max(documents), max_length_k=max(documents))
    valid = torch.ones(1, sum(documents), dtype=torch.bool, device=DEVICE)
    check_against_eager("llama4", "cu_seq_lens", model64, model, inputs, valid, backend, None, gen)


def test_packed_documents_from_cu_seq_lens():
    """The same packing given as ``cu_seq_lens_q/k`` and ``max_length_q/k`` (what a padding-free
    collator passes): the attention function must use it, not the row as one sequence."""
    model64, model = models("llama")
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, COMMON["vocab_size"], (1, sum(DOCUMENTS)), generator=gen).to(DEVICE)
    cu = torch.tensor([0, *torch.tensor(DOCUMENTS).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    positions = torch.cat([torch.arange(n) for n in DOCUMENTS])[None].to(DEVICE)
    kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(DOCUMENTS), max_length_k=max(DOCUMENTS))
    model.set_attn_implementation(NAME)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False, **kwargs).logits[0]
        # the position_ids alone say the same; without either, the row is one causal sequence
        from_positions = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
        model64.set_attn_implementation("eager")
        alone = torch.cat([model64(input_ids=ids[:, a:b], use_cache=False).logits[0]
                           for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    assert (packed.double() - alone).abs().max() < 0.05
    assert torch.equal(packed, from_positions)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_generation_is_token_identical(name, cache):
    """generate() with a left-padded batch over a KV cache: prefill through the packed path, then
    one query per sequence over its cache (a static cache's unwritten rows cut by the mask). Llama 4's
    chunked layer keeps only its last C - 1 keys: once it drops one, the mask function gives the exact mask."""
    model = build(name)  # float32: greedy ties between implementations are then vanishingly rare
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, COMMON["vocab_size"], (2, 13), generator=gen).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    options = dict(attention_mask=mask, max_new_tokens=2 * WINDOW, do_sample=False, pad_token_id=0)
    if cache == "static":
        options["cache_implementation"] = "static"
    tokens = {}
    for impl in ("eager", NAME):
        model.set_attn_implementation(impl)
        try:
            tokens[impl] = model.generate(ids, **options)
        except TypeError as error:
            # Some transformers releases (5.17 among them) build a static cache's chunked mask for
            # Llama 4 wrongly whatever the attention, before any attention runs: then eager fails
            # first, and fusedattn must fail the same way, not differently.
            assert name == "llama4" and cache == "static" and "block_sequence_ids" in str(error), error
            assert impl == "eager" or tokens["eager"] is None, "eager generated, fusedattn failed"
            tokens[impl] = None
    if tokens["eager"] is None:
        assert tokens[NAME] is None
        return
    assert tokens[NAME].shape[1] == ids.shape[1] + 2 * WINDOW
    assert torch.equal(tokens[NAME], tokens["eager"])


def test_torch_compile_gives_the_eager_answer():
    """The model compiled (inductor) with fusedattn: logits and gradients by the correctness rule
    (the fused op is a custom op, so the graph holds it whole)."""
    model64, model = models("mistral")
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, COMMON["vocab_size"], (2, SEQLEN), generator=gen).to(DEVICE)
    valid = torch.ones(2, SEQLEN, dtype=torch.bool, device=DEVICE)
    cotangent = torch.randn(2 * SEQLEN, COMMON["vocab_size"], generator=gen)
    ref_logits, ref_grads = run(model64, "eager", dict(input_ids=ids), cotangent, valid)
    eager_logits, eager_grads = run(model, "eager", dict(input_ids=ids), cotangent, valid)
    compiled = copy.copy(model)
    compiled.forward = torch.compile(model.forward)
    torch._dynamo.reset()
    our_logits, our_grads = run(compiled, NAME, dict(input_ids=ids), cotangent, valid)
    assert_close_to_reference("compiled logits", our_logits, eager_logits, ref_logits)
    for n in ref_grads:
        assert_close_to_reference(f"compiled d{n}", our_grads[n], eager_grads[n], ref_grads[n])


def test_a_four_dimensional_mask_is_used_as_given():
    """A float (B, 1, Sq, Sk) mask passed by the caller goes in whole, as eager adds it to the
    scores: here one that hides every third key as well as the future."""
    model64, model = models("qwen2")
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(0, COMMON["vocab_size"], (2, SEQLEN), generator=gen).to(DEVICE)
    q, k = torch.arange(SEQLEN)[:, None], torch.arange(SEQLEN)[None]
    keep = (k <= q) & ((k % 3 != 1) | (k == q))

    def additive(dtype):
        return torch.zeros(2, 1, SEQLEN, SEQLEN, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min).to(DEVICE)

    valid = torch.ones(2, SEQLEN, dtype=torch.bool, device=DEVICE)
    cotangent = torch.randn(2 * SEQLEN, COMMON["vocab_size"], generator=gen)
    ref_logits, ref_grads = run(model64, "eager", dict(input_ids=ids, attention_mask=additive(torch.float64)),
                                cotangent, valid)
    eager_logits, eager_grads = run(model, "eager", dict(input_ids=ids, attention_mask=additive(DTYPE)),
                                    cotangent, valid)
    our_logits, our_grads = run(model, NAME, dict(input_ids=ids, attention_mask=additive(DTYPE)), cotangent, valid)
    assert_close_to_reference("4-D mask logits", our_logits, eager_logits, ref_logits)
    for n in ref_grads:
        assert_close_to_reference(f"4-D mask d{n}", our_grads[n], eager_grads[n], ref_grads[n])


def test_an_overlaid_mask_rule_is_materialised_exactly():
    """Where a model combines its mask rule with one of its own (``and_mask_function`` /
    ``or_mask_function``: image tokens, prefixes), the mask function hands over the full bool mask
    and the attention function applies it: checked against softmax attention under that mask."""
    from transformers.masking_utils import create_causal_mask

    model = build("llama")
    model.set_attn_implementation(NAME)
    embeds = torch.zeros(2, 19, COMMON["hidden_size"], device=DEVICE)
    mask = create_causal_mask(config=model.config, inputs_embeds=embeds, attention_mask=None, past_key_values=None,
                              and_mask_function=lambda b, h, q, kv: (q + kv) % 3 != 1)
    assert mask is not None and mask.dtype == torch.bool and mask.shape == (2, 1, 19, 19)
    expected = torch.tensor([[kv <= q and (q + kv) % 3 != 1 for kv in range(19)] for q in range(19)])
    assert torch.equal(mask[0, 0].cpu(), expected)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, h, 19, 16, generator=gen).to(DEVICE) for h in (4, 2, 2))
    out, weights = attention_forward(model.model.layers[0].self_attn, q, k, v, mask, scaling=0.25)
    assert weights is None and out.shape == (2, 19, 4, 16)
    kk, vv = (t.double().repeat_interleave(2, dim=1) for t in (k, v))
    scores = (q.double() @ kk.transpose(-1, -2) * 0.25).masked_fill(~mask, float("-inf"))
    dead = ~mask.any(-1, keepdim=True)  # a row with no key (q = 1): zeros, by fusedattn's rule
    expected_out = (torch.softmax(scores.masked_fill(dead, 0), -1).masked_fill(dead, 0) @ vv).transpose(1, 2)
    assert (out.double() - expected_out).abs().max() < 1e-5


def test_attention_dropout_in_training(monkeypatch):
    """A model trained with ``attention_dropout``: transformers passes it in train mode, and each
    attention call gets it as ``dropout_p`` -- on the plain and the padded path; eval mode passes 0;
    the same seed reproduces the step, and the gradients flow."""
    import fusedattn.integrations.transformers as integration

    seen = []
    for name in ("attention", "varlen_attention"):
        real = getattr(integration, name)

        def spy(*args, _real=real, **kwargs):
            seen.append(kwargs.get("dropout_p"))
            return _real(*args, **kwargs)

        monkeypatch.setattr(integration, name, spy)
    model = build("llama", attention_dropout=0.1).to(DEVICE).train()
    model.set_attn_implementation(NAME)
    ids = torch.randint(0, COMMON["vocab_size"], (2, 9)).to(DEVICE)
    padding = torch.ones(2, 9, dtype=torch.long, device=DEVICE)
    padding[1, 6:] = 0
    for mask in (None, padding):
        seen.clear()
        torch.manual_seed(0)
        first = model(input_ids=ids, attention_mask=mask).logits
        torch.manual_seed(0)
        again = model(input_ids=ids, attention_mask=mask).logits
        assert seen and set(seen) == {0.1}
        assert torch.equal(first, again)
        first.sum().backward()
        assert all(p.grad is not None for p in model.model.layers[0].self_attn.parameters())
        model.eval()
        seen.clear()
        with torch.no_grad():
            evaluated = model(input_ids=ids, attention_mask=mask).logits
        assert set(seen) == {0.0} and not torch.allclose(first, evaluated)
        model.train()


def test_the_chunked_mask_is_the_padding_mask_until_a_cache_drops_keys():
    """Llama 4's chunked mask: None / the padding mask while the keys start at position 0 (the
    attention function applies chunk=), and transformers' exact 4-D mask over a cache layer that
    dropped its first kv_offset keys (chunk boundaries then differ from bottom-right alignment)."""
    from transformers.masking_utils import chunked_causal_mask_function

    from fusedattn.integrations.transformers import attention_mask
    config = transformers.Llama4TextConfig(**COMMON, attention_chunk_size=8)
    rule = chunked_causal_mask_function(8, torch.zeros(1, dtype=torch.long))
    assert attention_mask(1, 9, 9, mask_function=rule, config=config, local_size=8) is None
    padding = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 1]])
    assert torch.equal(attention_mask(1, 9, 9, mask_function=rule, attention_mask=padding, config=config,
                                      local_size=8), padding)
    dense = attention_mask(1, 1, 8, q_offset=13, kv_offset=6, mask_function=rule, config=config, local_size=8)
    # the query at absolute position 13 sees keys 8..13 of the cached 6..13
    assert dense.shape == (1, 1, 1, 8) and dense[0, 0, 0].tolist() == [False] * 2 + [True] * 6


def test_registration():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert register() == register() == "fusedattn"
    assert AttentionInterface._global_mapping[NAME] is attention_forward
    del AttentionInterface._global_mapping[NAME], AttentionMaskInterface._global_mapping[NAME]
    import importlib
    import fusedattn.hf
    importlib.reload(fusedattn.hf)  # importing it is the one-line form of register()
    from fusedattn.integrations import transformers as integration
    assert AttentionInterface._global_mapping[NAME] is attention_forward
    assert AttentionMaskInterface._global_mapping[NAME] is integration.attention_mask
