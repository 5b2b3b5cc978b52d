"""Tiny random models of each supported architecture, made by transformers (fp32): our logits
match transformers' and greedy decoding is token-for-token identical; verification of several
rows equals single-row decoding (sliding windows included, across a rollback)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenleap.errors import TokenleapError
from tokenleap.kernels import CpuKernels, load_kernels
from tokenleap.models.llama import LlamaModel
from tokenleap.models.loaders import load_hf_folder

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)

CASES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        head_dim=16, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=16, tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict()),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=16, sliding_window=5)),
    # Gemma 3: head_dim 32 (the kernels' attention) and 48 (torch attention, like the real 256)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=4, head_dim=32, sliding_window=5, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        final_logit_softcapping=30.0)),
    # Gemma 3 4B+: linear rope scaling (factor 8) on the global layers only
    "gemma3-linear": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=4, head_dim=32, sliding_window=5, tie_word_embeddings=True, rope_theta=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])),
    "gemma3-hd48": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, head_dim=48, num_key_value_heads=1, sliding_window=4, tie_word_embeddings=True,
        query_pre_attn_scalar=64)),
}


# llama.cpp's fixed gemma3 layout (local layers except every 6th, local rope base 10k, scale 1/sqrt(head_dim))
GGUF_GEMMA = ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
    num_hidden_layers=6, head_dim=32, sliding_window=5, tie_word_embeddings=True, query_pre_attn_scalar=32))


Pair = tuple[str, torch.nn.Module, LlamaModel]  # the case's name, transformers' model, ours on its weights


def _make(name: str, folder: Path) -> torch.nn.Module:
    if name == "gemma3-linear-gguf":
        cfg_cls, model_cls, extra = (
            GGUF_GEMMA[0],
            GGUF_GEMMA[1],
            {**GGUF_GEMMA[2], "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
        )
    else:
        cfg_cls, model_cls, extra = GGUF_GEMMA if name == "gemma3-gguf" else CASES[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**{**COMMON, **extra})
    hf = getattr(transformers, model_cls)(cfg).float().eval()
    with torch.no_grad():  # random norm weights, so every norm (and Gemma's 1 + w) matters
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.normal_(0.0, 0.3)
    hf.save_pretrained(str(folder))
    return hf


@pytest.fixture(scope="module")
def kernels() -> CpuKernels | None:
    return load_kernels()


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, kernels: CpuKernels | None) -> Pair:
    folder = tmp_path_factory.mktemp(request.param)
    hf = _make(request.param, folder)
    config, weights = load_hf_folder(folder)
    return request.param, hf, LlamaModel(config, weights, torch.float32, kernels)


def _prefill_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    kv = model.new_kv_cache()
    out = model.forward(torch.tensor(ids), torch.arange(len(ids)), kv)
    return model.compute_logits(out.hidden)


def _greedy(model: LlamaModel, ids: list[int], steps: int) -> list[int]:
    kv = model.new_kv_cache()
    out = model.forward(torch.tensor(ids), torch.arange(len(ids)), kv)
    tok = int(model.compute_logits(out.hidden, [-1]).argmax())
    generated = [tok]
    for _ in range(steps - 1):
        pos = kv.length
        out = model.forward(torch.tensor([tok]), torch.tensor([pos]), kv)
        tok = int(model.compute_logits(out.hidden).argmax())
        generated.append(tok)
    return generated


def test_logits_match_transformers(pair: Pair) -> None:
    name, hf, model = pair
    ids = list(range(3, 43))  # 40 tokens: past the sliding windows, torch prefill path (> 32 rows)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = _prefill_logits(model, ids)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=2e-4, msg=name)
    short = ids[:20]  # the row (kernel) path
    with torch.no_grad():
        ref = hf(torch.tensor([short])).logits[0]
    torch.testing.assert_close(_prefill_logits(model, short), ref, atol=2e-4, rtol=2e-4, msg=name)


def test_greedy_matches_transformers(pair: Pair) -> None:
    name, hf, model = pair
    prompt = [5, 17, 33, 2, 99, 41, 7]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24)[
            0, len(prompt) :
        ]
    assert _greedy(model, prompt, 24) == ref.tolist(), name


def test_verify_rows_equal_single_rows_across_rollback(pair: Pair) -> None:
    """k rows in one forward are bit-identical to k single-row forwards, also after truncating
    rejected rows (the window of local layers must see the same slots)."""
    name, _, model = pair
    _check_rollback(model, name)


Q8_CASES = [name for name, (_, _, extra) in CASES.items() if extra.get("head_dim", 16) % 32 == 0]  # q8_0: 32-dim blocks


@pytest.mark.parametrize("name", Q8_CASES)
def test_q8_0_cache_verify_rows_equal_single_rows_across_rollback(
    name: str, kernels: CpuKernels | None, tmp_path: Path
) -> None:
    """The same over a q8_0 KV cache (bf16 model; the cases whose head dim is a multiple of 32)."""
    if kernels is None or not kernels.bf16_attention:
        pytest.skip("q8_0 caches need the blocked attention kernels")
    _make(name, tmp_path)
    config, weights = load_hf_folder(tmp_path)
    model = LlamaModel(config, weights, torch.bfloat16, kernels, kv_cache_type="q8_0")
    assert model.new_kv_cache().dtype == torch.int8
    _check_rollback(model, name)


def _check_rollback(model: LlamaModel, name: str) -> None:
    prompt = list(range(10, 22))
    kv_a, kv_b = model.new_kv_cache(), model.new_kv_cache()
    for kv in (kv_a, kv_b):
        model.forward(torch.tensor(prompt), torch.arange(len(prompt)), kv)
    draft = [40, 41, 42, 43, 44]
    # reject the last 3 of a first verification, then verify again from the rollback point
    n = len(prompt)
    model.forward(torch.tensor(draft), torch.arange(n, n + 5), kv_a)
    kv_a.truncate(n + 2)
    batch = model.forward(torch.tensor(draft[2:] + [45, 46]), torch.arange(n + 2, n + 7), kv_a)
    singles = []
    for pos, tok in enumerate(draft, start=n):
        singles.append(model.forward(torch.tensor([tok]), torch.tensor([pos]), kv_b).hidden)
    for pos, tok in enumerate([45, 46], start=n + 5):
        singles.append(model.forward(torch.tensor([tok]), torch.tensor([pos]), kv_b).hidden)
    assert torch.equal(batch.hidden, torch.cat(singles[2:])), name
    assert torch.equal(model.compute_logits(batch.hidden), model.compute_logits(torch.cat(singles[2:]))), name


def test_unsupported_options_are_named(tmp_path: Path) -> None:
    from tokenleap.models.loaders import read_hf_config

    base = {
        "num_attention_heads": 4,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "vocab_size": 100,
    }
    for raw, words in (
        ({**base, "model_type": "phi3"}, "phi3"),
        ({**base, "model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({**base, "model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
        (
            {**base, "model_type": "gemma3_text", "sliding_window": 4, "attn_logit_softcapping": 50.0},
            "attn_logit_softcapping",
        ),
    ):
        (tmp_path / "config.json").write_text(json.dumps(raw))
        with pytest.raises(TokenleapError, match=words):
            read_hf_config(tmp_path)


@pytest.mark.parametrize("name", ["mistral", "gemma3", "qwen3"])
def test_torch_path_without_kernels(name: str, tmp_path: Path) -> None:
    hf = _make(name, tmp_path)
    config, weights = load_hf_folder(tmp_path)
    model = LlamaModel(config, weights, torch.float32, None)
    ids = list(range(3, 43))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_prefill_logits(model, ids), ref, atol=2e-4, rtol=2e-4)
    prompt = [5, 17, 33, 2, 99, 41, 7]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)[
            0, len(prompt) :
        ]
    assert _greedy(model, prompt, 12) == want.tolist()


_GGUF_ARCH = {"llama3": "llama", "qwen3": "qwen3", "gemma3": "gemma3", "gemma3-linear": "gemma3"}
_TO_GGUF = {"attn_norm": "attn_norm", "q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
            "mlp_norm": "ffn_norm", "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down", "q_norm": "attn_q_norm",
            "k_norm": "attn_k_norm", "post_attn_norm": "post_attention_norm", "post_mlp_norm": "post_ffw_norm"}


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter permutation of Q/K rows (half-split -> interleaved pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(name: str, folder: Path, path: Path) -> None:
    """Our canonical weights of a tiny HF model, written as llama.cpp's converter would."""
    import math

    gguf = pytest.importorskip("gguf")
    config, weights = load_hf_folder(folder)
    arch = _GGUF_ARCH[name]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    if config.sliding_window:
        w.add_sliding_window(config.sliding_window)
    if config.final_logit_softcap:
        w.add_final_logit_softcapping(config.final_logit_softcap)
    if config.rope_linear_factor != 1.0:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(config.rope_linear_factor)
    if config.rope_scaling is not None:  # llama.cpp's rope_freqs factors
        s = config.rope_scaling
        factors = []
        for i in range(0, config.head_dim, 2):
            freq = 1.0 / (config.rope_theta ** (i / config.head_dim))
            wavelen = 2 * math.pi / freq
            if wavelen < s.original_max_position / s.high_freq_factor:
                factors.append(1.0)
            elif wavelen > s.original_max_position / s.low_freq_factor:
                factors.append(s.factor)
            else:
                smooth = (
                    (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
                )
                factors.append(1 / ((1 - smooth) / s.factor + smooth))
        w.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    for key, t in weights.items():
        if key == "embed":
            gname = "token_embd.weight"
        elif key == "norm":
            gname = "output_norm.weight"
        elif key == "lm_head":
            gname = "output.weight"
        else:
            _, idx, part = key.split(".", 2)
            if arch == "llama" and part in ("q", "k"):
                t = _permute(t, config.num_heads if part == "q" else config.num_kv_heads)
            gname = f"blk.{idx}.{_TO_GGUF[part]}.weight"
        w.add_tensor(gname, t.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", ["llama3", "qwen3", "gemma3", "gemma3-linear"])
def test_gguf_matches_transformers(name: str, tmp_path: Path, kernels: CpuKernels | None) -> None:
    from tokenleap.models.loaders import load_gguf

    hf = _make(f"{name}-gguf" if name.startswith("gemma3") else name, tmp_path / "hf")
    _write_gguf(name, tmp_path / "hf", tmp_path / "m.gguf")
    config, weights = load_gguf(tmp_path / "m.gguf")
    model = LlamaModel(config, weights, torch.float32, kernels)
    ids = list(range(3, 43))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_prefill_logits(model, ids), ref, atol=2e-4, rtol=2e-4)
    prompt = [5, 17, 33, 2, 99, 41, 7]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)[
            0, len(prompt) :
        ]
    assert _greedy(model, prompt, 12) == want.tolist()


def test_batched_rows_equal_rows_alone(pair: Pair) -> None:
    """A batched step (rows of several sequences) gives each row the bits of its own forward."""
    from tokenleap.models.llama import SeqInput

    name, _, model = pair
    prompts = [list(range(10, 22)), list(range(30, 37))]
    alone, caches = [], []
    for p in prompts:
        kv = model.new_kv_cache()
        model.forward(torch.tensor(p), torch.arange(len(p)), kv)
        caches.append(kv)
        kv2 = model.new_kv_cache()
        model.forward(torch.tensor(p), torch.arange(len(p)), kv2)
        alone.append(model.forward(torch.tensor([50, 51]), torch.arange(len(p), len(p) + 2), kv2).hidden)
    seqs = [SeqInput(torch.tensor([50, 51]), torch.arange(len(p), len(p) + 2), kv) for p, kv in zip(prompts, caches)]
    batched = model.forward_batch(seqs).hidden
    assert torch.equal(batched, torch.cat(alone)), name


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_bf16_kernel_attention_keeps_the_sliding_window_over_cached_slots(
    name: str, tmp_path: Path, kernels: CpuKernels | None
) -> None:
    """bf16 on the kernels (blocked caches): once a row's window excludes cached slots, its
    sliding layers must attend over the window only (the kernel's per-row lower slot bound). The
    same model with torch attention over the same blocked cache is the reference (they differ by
    bf16 rounding of queries and probabilities alone); attending past the window put the decode
    logits off by 15-85 % of their scale."""
    if not kernels.bf16_attention:
        pytest.skip("no AVX512-BF16: bf16 models keep plain caches")
    _make(name, tmp_path)
    config, weights = load_hf_folder(tmp_path)
    fused = LlamaModel(config, weights, torch.bfloat16, kernels)
    reference = LlamaModel(config, weights, torch.bfloat16, kernels)
    reference.kernel_attention = False  # torch attention over the same blocked bf16 cache
    assert fused.kv_blocked and reference.kv_blocked
    ids = (torch.arange(14) * 7) % 160
    logits = []
    for model in (fused, reference):
        kv = model.new_kv_cache()
        model.forward(ids[:4], torch.arange(4), kv)  # inside the window: the kernel's fast path
        steps = [
            model.compute_logits(model.forward(ids[i : i + 1], torch.tensor([i]), kv).hidden) for i in range(4, 12)
        ]
        steps.append(model.compute_logits(model.forward(ids[12:14], torch.arange(12, 14), kv).hidden))  # a 2-row verify
        logits.append(torch.cat(steps))
    scale = float(logits[1].abs().max())
    assert float((logits[0] - logits[1]).abs().max()) < 0.05 * scale
    # the window's lower slot bound keeps the exactness contract: the verified rows equal the
    # same tokens decoded one at a time, bit for bit
    kv = fused.new_kv_cache()
    fused.forward(ids[:12], torch.arange(12), kv)
    one = [fused.compute_logits(fused.forward(ids[i : i + 1], torch.tensor([i]), kv).hidden) for i in (12, 13)]
    assert torch.equal(torch.cat(one), logits[0][-2:])


def test_verify_of_65_rows_equals_single_rows(pair: Pair) -> None:
    """A 64-token draft's verify forward (65 rows, `forward_batch` as the engine runs it) is
    bit-identical to 65 single-row forwards on every architecture, the general path's included
    (an fp32 `forward` of that many rows would take torch's GEMM and SDPA instead)."""
    from tokenleap.models.llama import SeqInput

    name, _, model = pair
    prompt, draft = list(range(10, 22)), [(7 * i + 3) % 160 for i in range(65)]
    n = len(prompt)
    kv_a, kv_b = model.new_kv_cache(), model.new_kv_cache()
    for kv in (kv_a, kv_b):
        model.forward(torch.tensor(prompt), torch.arange(n), kv)
    batch = model.forward_batch([SeqInput(torch.tensor(draft), torch.arange(n, n + 65), kv_a)]).hidden
    singles = torch.cat(
        [model.forward(torch.tensor([tok]), torch.tensor([pos]), kv_b).hidden for pos, tok in enumerate(draft, start=n)]
    )
    assert torch.equal(batch, singles), name
