"""Training off the runtime (`train-drafter --device cuda|mps`): the plain-PyTorch target computes
the runtime's features and greedy answers (batched, left-padded, stopping at EOS), the trainer's
loop gives the same losses on its features as on the runtime's, a held-out chain acceptance is
what its definition says, and a device this machine lacks or a target it cannot run is refused
by name. Every test runs on the CPU; the same code ran on an H100 (benchmarks/gpu_head.py)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tiny_models import TINY_CONFIG
from tokenleap import LLM
from tokenleap.errors import TokenleapError
from tokenleap.sampling import SamplingParams
from tokenleap.train.data import Example, Record
from tokenleap.train.torch_target import TorchTarget, check_supported
from tokenleap.train.trainer import (
    Batch,
    FeatureCache,
    RuntimeFeatures,
    TorchFeatures,
    TrainConfig,
    _lr_at,
    _regenerate,
    fit_head,
    forward_features,
    ttt_loss,
)

AUX = (0, 1, 1)


@pytest.fixture(scope="module")
def target(tiny_weights: dict[str, torch.Tensor]) -> TorchTarget:
    return TorchTarget(TINY_CONFIG, tiny_weights, "cpu", torch.float32, max_positions=128)


def test_features_are_the_runtimes(tiny_model: Any, target: TorchTarget) -> None:
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (23, 9)]
    ids = torch.zeros(2, 23, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s)  # right-padded: pad rows never reach real ones
    aux, hidden = target.features(ids, AUX)
    for r, s in enumerate(seqs):
        ref = forward_features(tiny_model, s, AUX)  # bf16-rounded float32 forward
        torch.testing.assert_close(aux[r, : len(s)], ref.aux.float(), atol=0.05, rtol=0.02)
        torch.testing.assert_close(hidden[r, : len(s)], ref.hidden.float(), atol=0.05, rtol=0.02)
        assert torch.equal(target.logits(hidden[r, : len(s)]).argmax(-1), ref.argmax.long())


def test_generation_is_the_engines_greedy_batched_or_alone(tiny_hf_folder: Path) -> None:
    llm = LLM(model=str(tiny_hf_folder), dtype="float32")
    t = TorchTarget.load(llm.source, "cpu", torch.float32, max_positions=128)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 11, 6, 17)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    batched = t.generate(prompts, 24, [], max_batch=3)  # two batches, rows of unequal prompt lengths
    for i, o in enumerate(outs):
        assert batched[i] == list(o.outputs[0].token_ids), i
        assert t.generate([prompts[i]], 24, [])[0] == batched[i]
    # an EOS token ends a row there (kept), the others run on; the batch still drops ended rows
    stop = batched[1][5]
    ended = t.generate(prompts, 24, [stop], max_batch=4)
    for i in range(len(prompts)):
        cut = batched[i].index(stop) + 1 if stop in batched[i] else 24
        assert ended[i] == batched[i][:cut], i


def test_generation_stops_at_a_deadline_between_batches(target: TorchTarget) -> None:
    seen: list[int] = []
    done = target.generate([[1, 2, 3]] * 6, 4, [], max_batch=2, deadline=0.0, on_batch=lambda idx, _: seen.extend(idx))
    assert done == {} and seen == []


@pytest.mark.slow
def test_regeneration_on_a_torch_target_matches_the_engine(tmp_path: Path) -> None:
    """Self-distillation through the chat template on the default model (float32 on both sides)."""
    llm = LLM(dtype="float32", quantization="none")
    t = TorchTarget.load(llm.source, "cpu", torch.float32, max_positions=256)
    records = [
        Record(messages=(("user", q), ("assistant", "x"))) for q in ("What is 2 + 2?", "Name a colour.", "Say hi.")
    ]
    logs: list[str] = []
    got = {}
    for name, tgt in (("engine", None), ("torch", t)):
        cfg = TrainConfig(output=tmp_path / name, regen_max_tokens=12, max_len=96)
        cfg.output.mkdir()
        got[name] = _regenerate(llm, records, cfg, False, logs.append, tgt)
        assert (tmp_path / name / "regenerated.jsonl").is_file()
    assert [r.messages for r in got["torch"]] == [r.messages for r in got["engine"]]


def test_training_on_torch_features_is_training_on_the_runtimes(
    tiny_model: Any, target: TorchTarget, tmp_path: Path
) -> None:
    g = torch.Generator().manual_seed(5)
    data = []
    for _ in range(24):
        p = torch.randint(0, 256, (4,), generator=g).tolist()
        ans = target.generate([p], 20, [])[0]
        data.append(Example(tuple(p + ans), (False,) * 4 + (True,) * 20))
    losses = {}
    for name, source in (("runtime", RuntimeFeatures(tiny_model, AUX, FeatureCache(1 << 28))),
                         ("torch", TorchFeatures(target, AUX, FeatureCache(1 << 28)))):
        cfg = TrainConfig(output=tmp_path / name, draft_vocab_size=64, aux_layers=AUX, ttt_steps=3, epochs=3, lr=3e-3,
                          warmup_steps=2, tokens_per_batch=128, eval_every=10**6, save_every=10**6, bf16=False)
        res = fit_head(source, data[4:], data[:4], cfg, "tiny", progress=False, log=lambda _: None)
        losses[name] = res.losses
        assert res.eval_acceptance is not None and (tmp_path / name / "model.safetensors").is_file()
    assert len(losses["torch"]) == len(losses["runtime"]) > 10
    torch.testing.assert_close(torch.tensor(losses["torch"]), torch.tensor(losses["runtime"]), atol=0.05, rtol=0.01)
    assert sum(losses["torch"][-3:]) < sum(losses["torch"][:3])


class _FixedHead(torch.nn.Module):
    """Draft logits chosen by the test: step k's top-1 at each row."""

    def __init__(self, top1: list[list[int]], vocab: int) -> None:
        super().__init__()
        self.top1, self.vocab = top1, vocab

    def ttt_logits(self, aux: torch.Tensor, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
        return [torch.nn.functional.one_hot(torch.tensor([row]), self.vocab).float() * 5 for row in self.top1[:steps]]


def test_chain_acceptance_counts_leading_agreeing_steps() -> None:
    t = 6
    amax = [0, 1, 2, 3, 4, 5]  # the target's next token at each row (draft ids)
    # step k at row i predicts row i + k + 1; agreement marked by the right id, else 9
    step0 = [1, 2, 3, 9, 5, 0]  # agrees at rows 0, 1, 2, 4
    step1 = [2, 9, 4, 0, 0, 0]  # agrees at rows 0, 2 (rows >= 4 fall off the end)
    step2 = [3, 9, 9, 0, 0, 0]  # agrees at row 0
    batch = Batch(torch.zeros(1, t, 4), torch.zeros(1, t, dtype=torch.long), torch.zeros(1, t, 10).log_softmax(-1),
                  torch.ones(1, t, dtype=torch.bool), torch.tensor([amax]), t)
    chain = [0.0, 0.0]
    _, hits, counts = ttt_loss(_FixedHead([step0, step1, step2], 10), batch, 3, 0.8, chain=chain)  # type: ignore[arg-type]
    assert hits == [4.0, 2.0, 1.0] and counts == [5, 4, 3]
    # accepted drafts per position 0..4: 3, 1, 2, 0, 1 over 5 positions whose first label counts
    assert chain == [7.0, 5.0]
    # the last token outside the draft vocabulary: nothing drafts it, and its position still counts
    valid = torch.tensor([[True] * 5 + [False]])
    batch = dataclasses.replace(batch, valid=valid, assistant=torch.ones(1, t, dtype=torch.bool))
    chain = [0.0, 0.0]
    ttt_loss(_FixedHead([step0, step1, step2], 10), batch, 3, 0.8, chain=chain)  # type: ignore[arg-type]
    assert chain == [6.0, 5.0]


def test_time_schedule_decays_over_the_time_budget(tmp_path: Path) -> None:
    cfg = TrainConfig(output=tmp_path, lr=1.0, warmup_steps=2, max_time=10.0, time_schedule=True)
    assert _lr_at(0, 1000, cfg, 0.0) == 0.5  # warmup by steps
    assert _lr_at(50, 1000, cfg, 0.0) == pytest.approx(1.0)
    assert _lr_at(50, 1000, cfg, 0.5) == pytest.approx(0.55)
    assert _lr_at(50, 1000, cfg, 1.0) == pytest.approx(0.1)
    with pytest.raises(TokenleapError, match="time_schedule needs max_time"):
        TrainConfig(output=tmp_path, time_schedule=True)
    with pytest.raises(TokenleapError, match="device must be"):
        TrainConfig(output=tmp_path, device="tpu")


def test_unsupported_targets_are_refused_by_name() -> None:
    gemma = dataclasses.replace(TINY_CONFIG, architecture="gemma3", embed_scale=8.0, post_norms=True)
    with pytest.raises(TokenleapError, match="Gemma 3.*--device cpu"):
        check_supported(gemma)
    with pytest.raises(TokenleapError, match="sliding-window"):
        check_supported(dataclasses.replace(TINY_CONFIG, architecture="mistral", sliding_window=64))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_cli_device_cuda_without_a_gpu_says_so(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "tokenleap.cli", "train-drafter", "-o", str(tmp_path / "h"),
                           "--device", "cuda", "--max-samples", "4", "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "no CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
