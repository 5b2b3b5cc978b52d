"""Scale-out on Ray (issue 12): three measurements, each in its own process (`--part`).

* `acceptance`: suffix decoding's acceptance on repeated-workload traffic served by 1 replica,
  by 2 replicas that do not share drafter statistics, and by 2 replicas that share them
  (`tokenleap.ray.sharing`). The traffic: `--num-prompts` Spec-Bench first turns (chat
  template, greedy, `--max-tokens`), each asked `--repeats` times, in one shuffled order
  (seeded), sent by 2 concurrent clients; with 2 replicas each request goes to a replica drawn
  at random (seeded, through an `x-session-id` routed to it), so a repeat lands on the other
  replica about half the time. Acceptance = accepted draft tokens / generated tokens, from the
  responses' `speculative` fields. Every answer is checked equal across the three setups.
* `mixed`: `tokenleap serve --replicas 2` started as a subprocess (its own local Ray); 200
  requests from 8 concurrent clients: good ones (chat and completions, streamed or not, greedy),
  malformed ones (bad JSON, unknown model, bad parameters: each must get its 4xx) and
  disconnecting ones (streams closed after the first chunk). Every good answer is compared with
  the single-process server's answer to the same request; afterwards every replica must hold no
  request (added == freed) and /health must be 200.
* `data`: `tokenleap.ray.build_processor` over `--num-prompts` Spec-Bench conversations (2
  actors of 1 thread, suffix speculation) against `LLM.chat` in this process: equal outputs.

    .venv/bin/python benchmarks/ray_scaleout.py --part acceptance   # -> results/ray_scaleout_acceptance.json
    .venv/bin/python benchmarks/ray_scaleout.py --part mixed        # -> results/ray_scaleout_mixed.json
    .venv/bin/python benchmarks/ray_scaleout.py --part data         # -> results/ray_scaleout_data.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from tokenleap.bench import default_spec_bench, load_questions

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "smollm2-135m-instruct"
KEY = "bench-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spec_bench_prompts(n: int) -> list[str]:
    qs = load_questions(default_spec_bench(), per_group=max(1, -(-n // 6)))
    by_group: dict[str, list[str]] = {}
    for q in qs:
        by_group.setdefault(q.group, []).append(q.turns[0])
    out: list[str] = []
    while len(out) < n and any(by_group.values()):
        for g in list(by_group):
            if by_group[g] and len(out) < n:
                out.append(by_group[g].pop(0))
    return out


def sessions_by_replica(url: str, n: int) -> list[str]:
    found: dict[str, str] = {}
    tag = uuid.uuid4().hex[:8]
    for i in range(256):
        s = f"bench-{tag}-{i}"
        rid = httpx.get(url + "/v1/tokenleap/replica", headers={**AUTH, "x-session-id": s}, timeout=60).json()[
            "replica"
        ]
        found.setdefault(rid, s)
        if len(found) == n:
            return [found[r] for r in sorted(found)]
    raise RuntimeError(f"reached {len(found)} of {n} replicas")


# ------------------------------------------------------------------ acceptance


def part_acceptance(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray import serve

    from tokenleap.ray.config import RayServeConfig
    from tokenleap.ray.serve import deployment, start, wait_ready
    from tokenleap.server.config import ServerConfig

    prompts = spec_bench_prompts(args.num_prompts)
    rng = random.Random(0)
    traffic = [p for p in range(len(prompts)) for _ in range(args.repeats)]
    rng.shuffle(traffic)
    choice = [rng.randrange(2) for _ in traffic]
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"OMP_WAIT_POLICY": "passive"}},
    )
    setups = [("1 replica", 1, True), ("2 replicas, no sharing", 2, False), ("2 replicas, sharing", 2, True)]
    results: dict[str, Any] = {}
    answers: dict[str, list[str]] = {}
    for name, replicas, share in setups:
        server = ServerConfig(port=free_port(), api_key=KEY, log_level="warning")
        cfg = RayServeConfig(
            replicas=replicas, threads_per_replica=1, share_stats=share, app_name=f"bench{replicas}{int(share)}"
        )
        t0 = time.monotonic()
        url = start(deployment(MODEL, speculative_config={"method": "suffix"}, server=server, config=cfg), server, cfg)
        wait_ready(url)
        sessions = sessions_by_replica(url, replicas)
        print(f"{name}: up in {time.monotonic() - t0:.0f} s", flush=True)

        def one(i: int) -> dict[str, Any]:
            headers = {**AUTH, "x-session-id": sessions[choice[i] % replicas]}
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": prompts[traffic[i]]}],
                "max_tokens": args.max_tokens,
                "temperature": 0,
            }
            r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=600).raise_for_status()
            return r.json()

        t0 = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(one, range(len(traffic))))
        wall = time.monotonic() - t0
        gen = sum(o["usage"]["completion_tokens"] for o in outs)
        acc = sum(o["speculative"]["num_accepted_tokens"] for o in outs)
        drafted = sum(o["speculative"]["num_draft_tokens"] for o in outs)
        results[name] = {
            "generated_tokens": gen, "accepted_tokens": acc, "draft_tokens": drafted, "acceptance": acc / gen,
            "draft_precision": acc / max(1, drafted), "wall_s": wall, "output_tok_per_s": gen / wall
        }
        answers[name] = [o["choices"][0]["message"]["content"] for o in outs]
        print(name, json.dumps(results[name]), flush=True)
        serve.delete(cfg.app_name)
        serve.shutdown()
    ref = answers[setups[0][0]]
    identical = {n: sum(a == b for a, b in zip(answers[n], ref)) for n in answers}
    base = results["1 replica"]["acceptance"]
    summary = {n: round(r["acceptance"] / base, 3) for n, r in results.items()}
    ray.shutdown()
    return {
        "num_prompts": len(prompts), "repeats": args.repeats, "requests": len(traffic), "max_tokens": args.max_tokens,
        "results": results, "acceptance_vs_1_replica": summary, "answers_identical_to_1_replica": identical
    }


# ------------------------------------------------------------------ mixed


def part_mixed(args: argparse.Namespace) -> dict[str, Any]:
    from tokenleap import LLM
    from tokenleap.server import BackgroundServer, ServerConfig

    port = free_port()
    env = {**os.environ, "OMP_WAIT_POLICY": "passive"}
    cmd = [
        sys.executable, "-m", "tokenleap.cli", "serve", "--replicas", "2", "--threads-per-replica", "1", "--spec-type",
        "suffix", "--port", str(port), "--api-key", KEY, "--log-level", "warning"
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    prompts = spec_bench_prompts(20)
    rng = random.Random(1)
    kinds = ["good"] * 140 + ["malformed"] * 40 + ["disconnect"] * 20
    rng.shuffle(kinds)
    jobs = []
    for i, kind in enumerate(kinds):
        p = prompts[i % len(prompts)]
        if kind == "good":
            chat = i % 3 != 0
            jobs.append((kind, {"chat": chat, "stream": i % 2 == 0, "prompt": p}))
        elif kind == "malformed":
            jobs.append((kind, i % 5))
        else:
            jobs.append((kind, p))
    # the single-process server's answers
    single_llm = LLM(speculative_config={"method": "suffix"})
    ref: dict[tuple[bool, str], str] = {}
    with BackgroundServer(single_llm, ServerConfig(port=0, log_level="warning")) as single:
        for chat in (True, False):
            for p in prompts:
                ref[(chat, p)] = good_request(single.url, {}, chat, False, p, args.max_tokens)[1]
    del single_llm
    t0 = time.monotonic()
    deadline = t0 + 600
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(
                f"tokenleap serve --replicas 2 did not start: {proc.stderr.read() if proc.stderr else ''}"
            )
        time.sleep(1)
    startup = time.monotonic() - t0

    def run(job: tuple[str, Any]) -> dict[str, Any]:
        kind, spec = job
        if kind == "good":
            status, text = good_request(url, AUTH, spec["chat"], spec["stream"], spec["prompt"], args.max_tokens)
            return {"kind": kind, "status": status, "ok": status == 200 and text == ref[(spec["chat"], spec["prompt"])]}
        if kind == "malformed":
            status = malformed_request(url, spec)
            return {"kind": kind, "status": status, "ok": 400 <= status < 500}
        return {"kind": kind, "status": disconnecting_request(url, spec), "ok": True}

    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(run, jobs))
    wall = time.monotonic() - t0
    time.sleep(2)
    replicas = {}
    for s in sessions_by_replica(url, 2):
        st = httpx.get(url + "/v1/tokenleap/replica", headers={**AUTH, "x-session-id": s}, timeout=60).json()
        replicas[st["replica"]] = {k: st[k] for k in ("live", "added", "freed", "published", "ingested")}
    health = httpx.get(url + "/health", timeout=30).status_code
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
    by_kind: dict[str, dict[str, int]] = {}
    for o in outcomes:
        k = by_kind.setdefault(o["kind"], {"sent": 0, "ok": 0})
        k["sent"] += 1
        k["ok"] += int(o["ok"])
    return {"requests": len(jobs), "startup_s": startup, "wall_s": wall, "by_kind": by_kind, "replicas": replicas,
            "health_after": health, "statuses": sorted({o["status"] for o in outcomes}), "exit_code": proc.returncode,
            "nothing_leaked": all(r["live"] == 0 and r["added"] == r["freed"] for r in replicas.values())}


def good_request(
    url: str, headers: dict[str, str], chat: bool, stream: bool, prompt: str, max_tokens: int
) -> tuple[int, str]:
    if chat:
        path, body = "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": prompt}]}
    else:
        path, body = "/v1/completions", {"model": MODEL, "prompt": prompt}
    body |= {"max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if not stream:
        r = httpx.post(url + path, json=body, headers=headers, timeout=600)
        if r.status_code != 200:
            return r.status_code, ""
        c = r.json()["choices"][0]
        return 200, c["message"]["content"] if chat else c["text"]
    text = []
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=600) as r:
        if r.status_code != 200:
            return r.status_code, ""
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                return 500, ""
            for c in obj.get("choices", []):
                text.append((c.get("delta") or {}).get("content") or "" if chat else c.get("text") or "")
    return 200, "".join(text)


def malformed_request(url: str, which: int) -> int:
    chat = url + "/v1/chat/completions"
    if which == 0:
        return httpx.post(
            chat, content=b"{not json", headers={**AUTH, "content-type": "application/json"}, timeout=60
        ).status_code
    bodies = [
        None,
        {"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
        {"model": MODEL, "messages": "not a list"},
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 3},
    ]
    return httpx.post(chat, json=bodies[which], headers=AUTH, timeout=60).status_code


def disconnecting_request(url: str, prompt: str) -> int:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 200,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=AUTH, timeout=600) as r:
        for _ in r.iter_lines():
            break  # go away after the first chunk
        return r.status_code


# ------------------------------------------------------------------ data


def part_data(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    import ray.data

    from tokenleap import LLM, SamplingParams
    from tokenleap.ray import build_processor

    prompts = spec_bench_prompts(args.num_prompts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    convs = [[{"role": "user", "content": p}] for p in prompts]
    t0 = time.monotonic()
    ref = LLM(speculative_config={"method": "suffix"}).chat(convs, params, use_tqdm=False)
    t_ref = time.monotonic() - t0
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"OMP_WAIT_POLICY": "passive"}},
    )
    proc = build_processor(MODEL, speculative_config={"method": "suffix"}, sampling_params=params, concurrency=2,
                           batch_size=16, chat=True, prompt_column="messages")
    t0 = time.monotonic()
    rows = proc(ray.data.from_items([{"messages": c, "i": i} for i, c in enumerate(convs)])).take_all()
    t_data = time.monotonic() - t0
    ray.shutdown()
    got = {int(r["i"]): list(r["generated_token_ids"]) for r in rows}
    equal = sum(got.get(i) == list(o.outputs[0].token_ids) for i, o in enumerate(ref))
    return {"prompts": len(prompts), "max_tokens": args.max_tokens, "rows": len(rows), "identical": equal,
            "llm_chat_s": t_ref, "ray_data_s": t_data,
            "generated_tokens": sum(len(o.outputs[0].token_ids) for o in ref)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=["acceptance", "mixed", "data"], required=True)
    ap.add_argument("--num-prompts", type=int, default=None, help="acceptance: 24; data: 200")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=None, help="acceptance: 64; mixed: 24; data: 32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    defaults = {"acceptance": (24, 64), "mixed": (20, 24), "data": (200, 32)}[args.part]
    args.num_prompts = args.num_prompts or defaults[0]
    args.max_tokens = args.max_tokens or defaults[1]
    result = {"acceptance": part_acceptance, "mixed": part_mixed, "data": part_data}[args.part](args)
    result["date"] = time.strftime("%Y-%m-%d")
    out = Path(args.out) if args.out else RESULTS / f"ray_scaleout_{args.part}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
