"""The default model with its GGUF weights kept quantized (`quantization="gguf"`): the kernels'
quantized linears keep the exactness contract on the real model (verification == decoding,
batched == solo, greedy speculation == plain decoding), and stay close to the dequantized model."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from tokenleap import LLM, SamplingParams
from tokenleap.kernels import CpuKernels, QuantWeight
from tokenleap.models.config import ModelConfig
from tokenleap.models.llama import LlamaModel, SeqInput
from tokenleap.tokenizer import Tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def q_llm(kernels: CpuKernels) -> LLM:
    # fixed drafts: the adaptive length may turn speculation off where a verify row costs much (a loaded host)
    return LLM(
        quantization="gguf", speculative_config={"method": "ngram", "num_speculative_tokens": 8, "adaptive": False}
    )


def test_the_default_keeps_the_files_blocks(kernels: CpuKernels) -> None:
    """`LLM()` runs the default model's GGUF blocks as they are (measured faster end to end);
    "none" and float32 dequantize."""
    assert LLM().model.quantization == "gguf"
    assert LLM(quantization="none").model.quantization is None
    assert LLM(dtype="float32").model.quantization is None


def _logits(model: LlamaModel, seqs: Sequence[SeqInput]) -> torch.Tensor:
    return model.compute_logits(model.forward_batch(seqs).hidden)


def test_linears_and_head_stay_quantized(q_llm: LLM, model_bf16: LlamaModel) -> None:
    model = q_llm.model
    assert model.quantization == "gguf"
    blocks = [w.quantized for layer in model.layers for w in layer.linears()]
    assert all(isinstance(w, QuantWeight) for w in blocks)  # one form each: no dense copy kept
    assert {w.name for w in blocks[:4] if w is not None} == {"Q4_1"}
    assert model.lm_head_linear.quantized is not None and model.lm_head_linear.quantized.name == "Q8_0"
    assert model.weight_bytes_per_token() < 0.4 * model_bf16.weight_bytes_per_token()


def test_verification_and_batches_are_bit_identical_to_decoding(
    q_llm: LLM, tokenizer: Tokenizer, questions: list[str]
) -> None:
    model = q_llm.model
    prompts = [tokenizer.encode(q)[:60] for q in questions[:3]]
    news = [tokenizer.encode(" Sure, here is the answer you asked for, step by step")[: 3 + 5 * i] for i in range(3)]

    def caches() -> list:
        out = []
        for p in prompts:
            kv = model.new_kv_cache(256)
            model.forward(torch.tensor(p), torch.arange(len(p)), kv)
            out.append(kv)
        return out

    def seqs(kvs: list) -> list[SeqInput]:
        return [
            SeqInput(torch.tensor(n), torch.arange(len(p), len(p) + len(n)), kv) for p, n, kv in zip(prompts, news, kvs)
        ]

    batched = _logits(model, seqs(caches()))
    steps = []
    for p, n, kv in zip(prompts, news, caches()):
        for i, t in enumerate(n):
            steps.append(_logits(model, [SeqInput(torch.tensor([t]), torch.tensor([len(p) + i]), kv)]))
    assert torch.equal(batched, torch.cat(steps))


def test_greedy_speculation_is_plain_decoding(q_llm: LLM, tokenizer: Tokenizer, questions: list[str]) -> None:
    engine = q_llm.engine
    params = SamplingParams(temperature=0, max_tokens=48)
    accepted = 0
    for q in questions[:3]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}])
        plain = engine.run(engine.add_request(ids, params, speculative=False))
        spec = engine.run(engine.add_request(ids, params))
        assert spec.output_ids == plain.output_ids
        accepted += spec.metrics.spec.num_accepted_tokens
    assert accepted > 0  # speculation happened


def test_close_to_the_dequantized_model(
    q_llm: LLM, model_fp32: LlamaModel, tokenizer: Tokenizer, questions: list[str]
) -> None:
    """Only the activations' int8 rounding separates the two (the weights are the file's)."""
    ids = torch.tensor(tokenizer.encode(questions[0])[:40])
    got = _logits(q_llm.model, [SeqInput(ids, torch.arange(len(ids)), q_llm.model.new_kv_cache(64))])
    ref = _logits(model_fp32, [SeqInput(ids, torch.arange(len(ids)), model_fp32.new_kv_cache(64))])
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    assert cos.min() > 0.98, cos
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_kept_blocks_hold_the_dequantized_values(
    model_path: Path, weights: tuple[ModelConfig, dict[str, torch.Tensor]]
) -> None:
    """Raw rows keep the loader's Q/K un-permutation: each kept weight dequantizes to exactly
    what the float loader produces."""
    from tokenleap.models.loaders import load_gguf

    _, dense = weights
    _, kept = load_gguf(model_path, keep_quantized=True)
    for name in ("layers.0.q", "layers.0.k", "layers.0.v", "layers.7.down", "layers.29.gate"):
        assert isinstance(kept[name], QuantWeight)
        assert torch.equal(kept[name].dequantize(), dense[name]), name
    # the tied token table is one QuantWeight for both: lookups decode just their rows
    assert isinstance(kept["lm_head"], QuantWeight) and kept["embed"] is kept["lm_head"]
    assert torch.equal(kept["lm_head"].dequantize(), dense["embed"])
    ids = torch.tensor([0, 7, 8, 49151, 7, 1234])
    assert torch.equal(kept["embed"].rows(ids), dense["embed"][ids])
