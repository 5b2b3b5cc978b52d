"""The default model's EAGLE-3 head (Li et al., 2025), trained on a CUDA GPU in one prepared run
of a few minutes (issue 24), in three steps:

1. `prepare` (here, on the CPU): ShareGPT's user turns under the default model's chat template,
   as token ids (held-out first turns first), the model's GGUF split in two parts a device call
   can carry, and the `gguf` wheel the device lacks: `.gpu_carry0/` (part 0 + wheel) for a first
   call, `.gpu_carry/` (part 1, prompts, wheel) for the second (both ignored by git).
2. `run` (on the GPU machine): the target (`TorchTarget`, bfloat16) answers every prompt greedily
   in length-sorted batches until the generation budget is spent (self-distillation), then
   several training variants (learning rate, batch, unrolled steps) run side by side as separate
   processes under a time-based schedule (`TrainConfig.time_schedule`) through the trainer's own
   loop (`trainer.fit_head` over `TorchFeatures`); the variant with the best held-out chain
   acceptance is brought back (the head split in two files under the tool's 16 MiB a file), with
   the self-distilled answers (so the CPU can reproduce or continue it) and every variant's figures.
3. `assemble` (here): the head's files joined into one EAGLE-3 folder (package data).

    .venv/bin/python benchmarks/gpu_head.py prepare
    # device call 1 (carry .gpu_carry0): mkdir -p /tmp/carry /tmp/site; cp .gpu_carry0/model.gguf.part0 /tmp/carry/;
    #   python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu_carry0/gguf-*.whl;
    #   PYTHONPATH=src:/tmp/site python3 benchmarks/gpu_head.py smoke
    # device call 2 at once (carry .gpu_carry; /tmp lives 30 s after a call): the same pip install from
    #   .gpu_carry, then PYTHONPATH=src:/tmp/site python3 benchmarks/gpu_head.py run --budget 530 --cache-gb 10
    #   --out $OUT
    .venv/bin/python benchmarks/gpu_head.py assemble --from DIR --to src/tokenleap/heads/smollm2-135m-instruct-eagle3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / ".gpu_carry"
MAX_LEN = 768
REGEN_MAX_TOKENS = 256


@dataclass(frozen=True)
class Variant:
    name: str
    lr: float
    tokens_per_batch: int
    ttt_steps: int
    init_from_target: bool = False


VARIANTS = (
    Variant("a", 5e-4, 8192, 4),
    Variant("b", 1e-3, 16384, 5),
    Variant("c", 2e-3, 16384, 4, init_from_target=True),
)


# --------------------------------------------------------------------------- prepare (CPU)


def prepare(args: argparse.Namespace) -> int:
    from tokenleap import LLM
    from tokenleap.train.data import Record, load_records, tokenize

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    llm = LLM(model=args.model)
    tok = llm.tokenizer
    records = load_records(("sharegpt",), None, seed=args.seed)
    room = MAX_LEN - REGEN_MAX_TOKENS
    seen: set[str] = set()
    prompts: list[list[int]] = []
    later: list[list[int]] = []  # later user turns, after the data's own earlier answers
    for rec in records:
        users = [i for i, (r, _) in enumerate(rec.messages) if r == "user"]
        for k, u in enumerate(users[: args.turns]):
            conv = rec.messages[: u + 1]
            key = json.dumps(conv)
            if key in seen or not conv[-1][1].strip():
                continue
            seen.add(key)
            ids = llm.chat_token_ids([{"role": r, "content": c} for r, c in conv])
            if len(ids) > room:
                break  # later turns only grow
            if k == 0:
                prompts.append(ids)
            elif len(prompts) > args.heldout:  # a held-out chat's later turns are not trained on
                later.append(ids)
    prompts = (prompts + later)[: args.prompts]
    # the turn's end after the EOS token, as the chat template writes a finished assistant turn
    probe = [{"role": "user", "content": "hi"}]
    before = tok.apply_chat_template(probe, add_generation_prompt=True)
    through = tok.apply_chat_template([*probe, {"role": "assistant", "content": "ok"}], add_generation_prompt=False)
    eos = sorted(tok.eos_token_ids)
    tail = list(through[len(before):])
    cut = max(i for i, t in enumerate(tail) if t in eos)
    turn_end = tail[cut + 1 :]
    # a check that examples built from ids are what the trainer's own tokenizer gives for the same text
    answer = tok.encode("Paris is the capital of France.")
    built = example_from(before, [*answer, eos[0]], eos, turn_end, MAX_LEN)
    ref = tokenize(tok, Record(messages=(("user", "hi"), ("assistant", tok.decode(answer)))), MAX_LEN)
    assert ref is not None and built.ids == ref.ids and built.mask == ref.mask, (built, ref)
    flat = np.concatenate([np.asarray(p, dtype=np.uint16) for p in prompts])
    offsets = np.cumsum([0] + [len(p) for p in prompts]).astype(np.int64)
    np.savez_compressed(
        out / "prompts.npz",
        ids=flat,
        offsets=offsets,
        eos=np.asarray(eos),
        turn_end=np.asarray(turn_end, dtype=np.int64),
        heldout=np.asarray(args.heldout),
    )
    gguf_path = llm.source.path
    data = Path(gguf_path).read_bytes()
    half = args.first_part_mb << 20
    first = out.parent / (out.name + "0")  # what the first device call carries (the 64 MiB a call holds)
    first.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model.gguf.part*"), *first.glob("model.gguf.part*")]:
        old.unlink()
    (first / "model.gguf.part0").write_bytes(data[:half])
    (out / "model.gguf.part1").write_bytes(data[half:])
    print(
        f"{len(prompts)} prompts ({int(offsets[-1])} tokens, {args.heldout} held out), turn end {turn_end}, eos {eos}; "
        f"{gguf_path.name} in two parts: {half >> 20} MiB in {first}, {(len(data) - half) >> 20} MiB in {out}"
    )
    if not any(out.glob("gguf-*.whl")):
        import gguf

        ver = gguf.__version__ if hasattr(gguf, "__version__") else None
        spec = f"gguf=={ver}" if ver else "gguf"
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(out), spec],
            check=True,
            capture_output=True,
        )
    for wheel in out.glob("gguf-*.whl"):
        (first / wheel.name).write_bytes(wheel.read_bytes())
    return 0


def example_from(prompt: list[int], answer: list[int], eos: list[int], turn_end: list[int], max_len: int) -> Any:
    """The training sequence of a prompt and the target's answer (ids as generated): the answer,
    and the rest of the turn's end after its EOS token, are the assistant tokens."""
    from tokenleap.train.data import Example

    tail = list(answer) + (list(turn_end) if answer and answer[-1] in eos else [])
    ids = (list(prompt) + tail)[:max_len]
    mask = ([False] * len(prompt) + [True] * len(tail))[:max_len]
    return Example(tuple(ids), tuple(mask))


# --------------------------------------------------------------------------- run (GPU)


def _log(msg: str, start: float) -> None:
    print(f"[{time.monotonic() - start:6.1f}s] {msg}", flush=True)


def run(args: argparse.Namespace) -> int:
    import torch

    from tokenleap.models.loaders import load_gguf
    from tokenleap.train.torch_target import TorchTarget

    start = time.monotonic()
    end = start + args.budget
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    carry: Path = args.carry
    gguf_file = work / "model.gguf"
    if not gguf_file.is_file():
        with gguf_file.open("wb") as f:
            parts = {q.name: q for d in (Path(args.part_dir), carry) for q in d.glob("model.gguf.part*")}
            for _, part in sorted(parts.items()):
                f.write(part.read_bytes())
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    config, weights = load_gguf(gguf_file)
    dtype = getattr(torch, args.dtype)
    target = TorchTarget(config, weights, device, dtype, max_positions=MAX_LEN + 64)
    torch.save({"config": config, "weights": {k: v.to(dtype) for k, v in weights.items()}}, work / "target.pt")
    del weights
    _log(
        f"target on {device}: {config.num_layers} layers, "
        f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}",
        start,
    )

    z = np.load(carry / "prompts.npz")
    offsets, flat_ids = z["offsets"], z["ids"].astype(np.int64)  # each z[...] reads the archive again: once
    prompts = [flat_ids[offsets[i] : offsets[i + 1]].tolist() for i in range(len(offsets) - 1)]
    if args.limit:
        prompts = prompts[: args.limit]
    eos, turn_end, n_held = z["eos"].tolist(), z["turn_end"].tolist(), min(int(z["heldout"]), len(prompts) // 5)
    gen_end = start + args.budget * args.gen_share
    answers = target.generate(prompts[:n_held], args.max_new, eos, max_batch=args.max_batch)
    _log(f"held-out answers: {n_held}", start)
    done = 0

    def progress(idx: list[int], ans: list[list[int]]) -> None:
        nonlocal done
        done += len(idx)
        if done % 4096 < len(idx):
            _log(f"self-distillation: {done} answers", start)

    rest = target.generate(
        prompts[n_held:], args.max_new, eos, max_batch=args.max_batch, deadline=gen_end, on_batch=progress
    )
    answers.update({n_held + i: a for i, a in rest.items()})
    n_tokens = sum(len(a) for a in answers.values())
    _log(f"self-distillation: {len(answers)} of {len(prompts)} prompts answered, {n_tokens} answer tokens "
         f"({n_tokens / max(time.monotonic() - start, 1e-9):.0f} tok/s overall)", start)
    keys = sorted(answers)
    flat = np.concatenate([np.asarray(answers[k], dtype=np.uint16) for k in keys]) if keys else np.zeros(0, np.uint16)
    np.savez_compressed(out / "answers.npz", prompt_index=np.asarray(keys, dtype=np.int64), ids=flat,
                        offsets=np.cumsum([0] + [len(answers[k]) for k in keys]).astype(np.int64))
    heldout = [example_from(prompts[i], answers[i], eos, turn_end, MAX_LEN) for i in range(n_held) if i in answers]
    train = [example_from(prompts[i], answers[i], eos, turn_end, MAX_LEN) for i in keys if i >= n_held and answers[i]]
    torch.save({"train": train, "heldout": heldout, "eos": eos}, work / "examples.pt")
    del target
    torch.cuda.empty_cache() if device == "cuda" else None

    deadline = time.time() + max(60.0, end - time.monotonic() - args.reserve)  # wall clock: the variants' own clocks
    variants = [v for v in VARIANTS if v.name in args.variants.split(",")]
    _log(
        f"training {len(variants)} variants side by side until {deadline - time.time():.0f} s from now "
        f"on {len(train)} sequences",
        start,
    )
    procs = []
    for v in variants:
        cmd = [sys.executable, __file__, "variant", "--work", str(work), "--name", v.name, "--deadline", str(deadline),
               "--device", device, "--cache-gb", str(args.cache_gb), "--dtype", args.dtype]
        log = (work / f"variant_{v.name}.log").open("w")
        procs.append(
            (
                v,
                subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
                ),
                log,
            )
        )
    results: dict[str, Any] = {}
    for v, p, log in procs:
        try:
            p.wait(timeout=max(10.0, deadline - time.time() + args.reserve - 5))
        except subprocess.TimeoutExpired:
            p.kill()
        log.close()
        res = work / f"variant_{v.name}" / "result.json"
        results[v.name] = json.loads(res.read_text()) if res.is_file() else {"failed": p.returncode}
        tail = (work / f"variant_{v.name}.log").read_text().splitlines()[-6:]
        _log(
            f"variant {v.name} {asdict(v)}: {results[v.name].get('acceptance', 'no result')}\n    "
            + "\n    ".join(tail),
            start,
        )
    ok = {k: r for k, r in results.items() if "acceptance" in r}
    summary = {
        "prompts": len(prompts),
        "answered": len(answers),
        "answer_tokens": n_tokens,
        "train_sequences": len(train),
        "heldout_sequences": len(heldout),
        "variants": {v.name: {**asdict(v), **results[v.name]} for v in variants},
        "seconds": round(time.monotonic() - start, 1),
        "device": torch.cuda.get_device_name() if device == "cuda" else device,
    }
    if ok:
        best = max(ok, key=lambda k: ok[k]["acceptance"])
        summary["best"] = best
        split_head(work / f"variant_{best}", out)
        _log(f"best variant {best}: held-out chain acceptance {ok[best]['acceptance']:.3f}, top-1 per step "
             + " ".join(f"{a:.3f}" for a in ok[best]["accuracy"]), start)
    (out / "result.json").write_text(json.dumps(summary, indent=2))
    return 0 if ok else 1


def variant(args: argparse.Namespace) -> int:
    """One training variant (a separate process: several share the GPU, each launch-bound)."""
    import torch

    from tokenleap.train.torch_target import TorchTarget
    from tokenleap.train.trainer import FeatureCache, TorchFeatures, TrainConfig, aux_layers_for, fit_head

    work = Path(args.work)
    v = next(x for x in VARIANTS if x.name == args.name)
    saved = torch.load(work / "target.pt", weights_only=False)
    target = TorchTarget(
        saved["config"], saved["weights"], args.device, getattr(torch, args.dtype), max_positions=MAX_LEN + 64
    )
    del saved
    data = torch.load(work / "examples.pt", weights_only=False)
    seconds = args.deadline - time.time() - args.margin  # the final held-out evaluation and the save come after
    cmd = (f"python benchmarks/gpu_head.py run (variant {v.name}: lr {v.lr}, {v.tokens_per_batch} tokens a batch, "
           f"{v.ttt_steps} unrolled steps{', lm_head from the target' if v.init_from_target else ''}; {seconds:.0f} s)")
    cfg = TrainConfig(
        output=work / f"variant_{v.name}", data=("sharegpt",), max_len=MAX_LEN, ttt_steps=v.ttt_steps, epochs=1000,
        lr=v.lr, warmup_steps=50, tokens_per_batch=v.tokens_per_batch, eval_examples=len(data["heldout"]),
        eval_every=500, save_every=10**9, max_time=max(1.0, seconds), time_schedule=True, cache_gb=args.cache_gb,
        init_from_target=v.init_from_target, command=cmd, device=args.device, seed=0
    )
    source = TorchFeatures(
        target, aux_layers_for(cfg, target.config.num_layers), FeatureCache(int(args.cache_gb * 2**30))
    )
    res = fit_head(
        source, data["train"], data["heldout"], cfg, "smollm2-135m-instruct", eos=data["eos"], progress=False,
        log=lambda m: print(m, flush=True)
    )
    (cfg.output / "result.json").write_text(
        json.dumps(
            {
                "acceptance": res.eval_acceptance,
                "accuracy": res.eval_accuracy,
                "steps": res.steps,
                "tokens": res.tokens,
                "seconds": round(res.seconds, 1),
            }
        )
    )
    return 0


def smoke(args: argparse.Namespace) -> int:
    """A first minute on the device: a small random Llama on it, batched greedy generation against
    one prompt at a time, and 30 training steps of the trainer's loop there (the loss must fall)."""
    import torch

    from tokenleap.models.config import ModelConfig
    from tokenleap.train.data import Example
    from tokenleap.train.torch_target import TorchTarget
    from tokenleap.train.trainer import FeatureCache, TorchFeatures, TrainConfig, fit_head

    t0 = time.monotonic()
    cfg = ModelConfig(
        architecture="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=32, max_position=512
    )
    g = torch.Generator().manual_seed(0)
    d = cfg.hidden_size
    w = {
        "embed": torch.randn(cfg.vocab_size, d, generator=g),
        "norm": torch.ones(d),
        "lm_head": torch.randn(cfg.vocab_size, d, generator=g) * d**-0.5,
    }
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        for n, shape in (
            ("q", (cfg.q_size, d)), ("k", (cfg.kv_size, d)), ("v", (cfg.kv_size, d)), ("o", (d, cfg.q_size)),
            ("gate", (cfg.intermediate_size, d)), ("up", (cfg.intermediate_size, d)),
            ("down", (d, cfg.intermediate_size))
        ):
            w[p + n] = torch.randn(*shape, generator=g) * shape[1] ** -0.5
        w[p + "attn_norm"] = w[p + "mlp_norm"] = torch.ones(d)
    target = TorchTarget(cfg, w, args.device, torch.float32, max_positions=512)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (3, 17, 9, 30, 5)]
    batched = target.generate(prompts, 20, [7])
    alone = {i: target.generate([p], 20, [7])[0] for i, p in enumerate(prompts)}
    same = all(batched[i] == alone[i] for i in alone)
    print(
        f"generate: batched == one at a time: {same}; lengths {[len(batched[i]) for i in sorted(batched)]}", flush=True
    )
    data = [Example(tuple(p + target.generate([p], 40, [])[0]), (False,) * len(p) + (True,) * 40) for p in
            (torch.randint(0, 512, (4,), generator=g).tolist() for _ in range(64))]
    tc = TrainConfig(
        output=Path(args.work) / "smoke", draft_vocab_size=128, aux_layers=(0, 1, 3), ttt_steps=3, epochs=30, lr=3e-3,
        warmup_steps=5, tokens_per_batch=1024, eval_every=10**6, save_every=10**6, device=args.device
    )
    res = fit_head(
        TorchFeatures(target, (0, 1, 3), FeatureCache(1 << 30)),
        data[8:],
        data[:8],
        tc,
        "smoke",
        progress=False,
        log=print,
    )
    first, last = sum(res.losses[:5]) / 5, sum(res.losses[-5:]) / 5
    print(f"smoke: {res.steps} steps, loss {first:.3f} -> {last:.3f}, acceptance {res.eval_acceptance:.2f}, "
          f"{time.monotonic() - t0:.1f} s", flush=True)
    return 0 if same and last < first else 1


def split_head(folder: Path, out: Path) -> None:
    """The head as two safetensors files (the LM head apart) and its config.json."""
    from safetensors.torch import load_file, save_file

    w = load_file(str(folder / "model.safetensors"))
    save_file({"lm_head.weight": w.pop("lm_head.weight")}, str(out / "head_lm.safetensors"))
    save_file(w, str(out / "head_rest.safetensors"))
    (out / "config.json").write_text((folder / "config.json").read_text())


def assemble(args: argparse.Namespace) -> int:
    from safetensors.torch import load_file, save_file

    src, dst = Path(args.src), Path(args.dst)
    dst.mkdir(parents=True, exist_ok=True)
    w = {**load_file(str(src / "head_rest.safetensors")), **load_file(str(src / "head_lm.safetensors"))}
    save_file(dict(sorted(w.items())), str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    print(f"{dst}: {len(w)} tensors, {(dst / 'model.safetensors').stat().st_size / 2**20:.1f} MiB")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="token ids of ShareGPT first turns, the GGUF in parts, the gguf wheel")
    p.add_argument("--out", type=Path, default=CARRY)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=40000)
    p.add_argument("--heldout", type=int, default=256, help="first turns held out (the first ones)")
    p.add_argument(
        "--turns",
        type=int,
        default=4,
        help="user turns of a chat answered at most (later ones after the data's answers)",
    )
    p.add_argument("--first-part-mb", type=int, default=56)
    p.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run", help="self-distil and train on the GPU (the device script)")
    r.add_argument("--carry", type=Path, default=CARRY)
    r.add_argument("--part-dir", default="/tmp/carry", help="where an earlier call left the GGUF's first part")
    r.add_argument("--work", default="/tmp/gpu_head")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--budget", type=float, default=500.0, help="seconds for the whole run")
    r.add_argument("--gen-share", type=float, default=0.35, help="share of the budget for self-distillation")
    r.add_argument("--reserve", type=float, default=25.0, help="seconds kept for evaluation and writing back")
    r.add_argument("--max-new", type=int, default=REGEN_MAX_TOKENS)
    r.add_argument("--max-batch", type=int, default=1024)
    r.add_argument("--limit", type=int, default=0, help="prompts used at most (0: all)")
    r.add_argument("--variants", default=",".join(v.name for v in VARIANTS))
    r.add_argument("--cache-gb", type=float, default=8.0)
    r.add_argument("--device", default="cuda")
    r.add_argument("--dtype", default="bfloat16", help="the target's weights (float32 for a dry run on a CPU)")
    v = sub.add_parser("variant")
    v.add_argument("--work", required=True)
    v.add_argument("--name", required=True)
    v.add_argument("--deadline", type=float, required=True, help="time.time() by which the head is written")
    v.add_argument("--margin", type=float, default=15.0, help="seconds kept for the final evaluation and the save")
    v.add_argument("--device", default="cuda")
    v.add_argument("--cache-gb", type=float, default=8.0)
    v.add_argument("--dtype", default="bfloat16")
    m = sub.add_parser("smoke", help="a small random model's generation and training on the device")
    m.add_argument("--device", default="cuda")
    m.add_argument("--work", default="/tmp/gpu_head")
    a = sub.add_parser("assemble", help="join a run's head files into one EAGLE-3 folder")
    a.add_argument("--from", dest="src", required=True)
    a.add_argument("--to", dest="dst", required=True)
    args = ap.parse_args(argv)
    return {"prepare": prepare, "run": run, "variant": variant, "smoke": smoke, "assemble": assemble}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
