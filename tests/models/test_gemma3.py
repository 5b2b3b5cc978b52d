"""The registered Gemma 3 270M (GGUF, Q4_K_M dequantized at load): fp32 greedy output identical
to transformers' fp32 on Spec-Bench prompts, and greedy n-gram speculation identical to plain
decoding in the default dtype, and SmolLM2 drafting for it across tokenizers. Slow (loads a
262k-vocabulary model four times)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from hf_reference import hf_causal_lm  # tests/hf_reference.py
from tokenleap import LLM, SamplingParams
from tokenleap.bench import default_spec_bench, load_questions
from tokenleap.models.base import SeqInput
from tokenleap.models.llama import ExecutionPath, LlamaModel

SPEC_BENCH = default_spec_bench()

pytestmark = pytest.mark.slow

TOKENS = 16


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    if not SPEC_BENCH.is_file():
        pytest.skip("no Spec-Bench file")
    questions = load_questions(SPEC_BENCH, 1)
    return [q.turns[0] for q in questions[:3]]


def test_fp32_greedy_identical_to_transformers(prompts: list[str], tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    llm = LLM(model="gemma3-270m", dtype="float32")
    hf = hf_causal_lm(llm.source.path, tmp_path)
    hf.generation_config.eos_token_id = None  # exactly TOKENS tokens, no logit altered
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    for text in prompts:
        ids = llm.tokenizer.encode(text)
        ours = llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              do_sample=False, max_new_tokens=TOKENS, pad_token_id=0)[0, len(ids):]
        assert list(ours) == ref.tolist(), text[:60]


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(model="gemma3-270m")


def test_greedy_ngram_speculation_identical_to_plain(prompts: list[str], plain: LLM) -> None:
    spec = LLM(
        model="gemma3-270m", speculative_config={"method": "ngram", "num_speculative_tokens": 6, "adaptive": False}
    )
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    # a repetitive prompt, so drafts are made and accepted
    texts = ["List the numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,", prompts[0]]
    drafted = 0
    for text in texts:
        a = plain.generate([text], params, use_tqdm=False)[0]
        b = spec.generate([text], params, use_tqdm=False)[0]
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, text[:60]
        drafted += b.metrics.spec.num_accepted_tokens
    assert drafted > 0  # speculation took part


def test_fused_path_equals_the_per_op_block(plain: LLM) -> None:
    """In its default dtype the model takes the fused path (every layer in one C call: QK-norm
    with the query scale, post-norms, GeGLU, local layers with their own plan and rope base);
    its logits are bit-identical to the per-op decoder block's (`ExecutionPath.KERNELS`) over a
    prefill, decode steps past the 512-token window and an 8-row verify."""
    model = plain.model
    if model.kernels is None or not model.kernels.bf16_attention:
        pytest.skip(
            "Gemma's 256-wide heads need the blocked bf16 attention, absent in this CPU's kernel variant "
            "(AVX-512 without BF16)"
        )
    assert model.path is ExecutionPath.FUSED and model.fused is not None and model.fused.has_local
    blocks = copy.copy(model)
    blocks.path = ExecutionPath.KERNELS
    ids = torch.randint(0, 20000, (540,), generator=torch.Generator().manual_seed(0))

    def session(m: LlamaModel) -> list[torch.Tensor]:
        kv = m.new_kv_cache(1024)
        out = [m.compute_logits(m.forward(ids[:508], torch.arange(508), kv).hidden[-1:])]
        for i in range(508, 516):  # the window binds from position 512 on
            out.append(m.compute_logits(m.forward(ids[i : i + 1], torch.tensor([i]), kv).hidden))
        verify = m.forward_batch([SeqInput(ids[516:524], torch.arange(516, 524), kv)])
        return [*out, m.compute_logits(verify.hidden)]

    for a, b in zip(session(model), session(blocks), strict=True):
        assert torch.equal(a, b)


def test_draft_model_with_another_tokenizer(prompts: list[str], plain: LLM) -> None:
    """SmolLM2-135M (49k vocabulary) drafts for Gemma 3 (262k) by text re-tokenization: greedy
    output identical to plain decoding, and drafts accepted (a base and an instruct model agree
    on predictable text, much less on open questions)."""
    spec = LLM(model="gemma3-270m", speculative_config={"method": "draft-model", "model": "smollm2-135m-instruct",
                                                        "num_speculative_tokens": 4, "adaptive": False})
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    drafted = accepted = 0
    texts = ["List the numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "The capital of France is", prompts[0]]
    for text in texts:
        a = plain.generate([text], params, use_tqdm=False)[0]
        b = spec.generate([text], params, use_tqdm=False)[0]
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, text[:60]
        drafted += b.metrics.spec.num_draft_tokens
        accepted += b.metrics.spec.num_accepted_tokens
    assert drafted > 0 and accepted > 0.25 * drafted, (accepted, drafted)  # 0.37 measured
    assert [type(d).__name__ for d in spec.engine.drafters()] == ["CrossTokenizerDrafter"]


def test_q8_0_kv_cache_speculation_identical_to_plain(prompts: list[str]) -> None:
    """Gemma 3's 256-wide heads and sliding windows over a q8_0 KV cache: greedy n-gram
    speculation gives what plain decoding over the same cache gives."""
    from tokenleap.kernels import load_kernels

    kernels = load_kernels()
    if kernels is None or not kernels.bf16_attention:
        pytest.skip("q8_0 caches need the blocked attention kernels")
    plain = LLM(model="gemma3-270m", kv_cache_dtype="q8_0")
    spec = LLM(model="gemma3-270m", kv_cache_dtype="q8_0",
               speculative_config={"method": "ngram", "num_speculative_tokens": 6, "adaptive": False})
    assert plain.model.kv_dtype == torch.int8
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    drafted = 0
    for text in [
        "List the numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,",
        prompts[1],
    ]:
        a = plain.generate([text], params, use_tqdm=False)[0]
        b = spec.generate([text], params, use_tqdm=False)[0]
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, text[:60]
        drafted += b.metrics.spec.num_accepted_tokens
    assert drafted > 0
