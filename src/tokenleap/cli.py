"""Command line: `tokenleap generate` and `tokenleap chat` (argparse; the only module that prints).

Option names follow vLLM / llama.cpp where they exist (`--max-tokens`, `--temperature`,
`--top-p`, `--top-k`, `--min-p`, `--seed`, `--stop`). Errors a user can cause print one line
`error: ...` on stderr and exit with status 2; Ctrl-C exits with 130 without a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from tokenleap.errors import TokenleapError
from tokenleap.models.registry import DEFAULT_MODEL, REGISTRY

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", "-m", default=DEFAULT_MODEL, help=f"registered name ({', '.join(REGISTRY)}), a .gguf file or a Hugging Face folder (default: %(default)s)")
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weight dtype (default: %(default)s)")
    g.add_argument("--max-model-len", type=int, default=None, help="context length cap (default: the model's)")
    g.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    g.add_argument("--no-kernels", action="store_true", help="use torch ops instead of tokenleap's CPU kernels")
    g.add_argument("--verbose", "-v", action="store_true", help="log loading details")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (llama.cpp's defaults; --temperature 0 is greedy)")
    g.add_argument("--max-tokens", "-n", type=int, default=256, help="tokens to generate at most (default: %(default)s)")
    g.add_argument("--temperature", "--temp", type=float, default=0.8, help="0 = greedy (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=40, help="0 disables (default: %(default)s)")
    g.add_argument("--min-p", type=float, default=0.05, help="0 disables (default: %(default)s)")
    g.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenleap", description="Speculative-decoding LLM inference engine.")
    parser.add_argument("--version", action="version", version="tokenleap 0.1.0")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = sub.add_parser("generate", help="generate a completion for one prompt (streamed)", description="Generate text for one prompt, streamed to stdout; statistics go to stderr.")
    gen.add_argument("prompt", help="the prompt text, or - to read it from stdin")
    gen.add_argument("--raw", action="store_true", help="complete the raw prompt (no chat template)")
    gen.add_argument("--system", default=None, help="system message (chat template only)")
    gen.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, finish reason, metrics) instead of streaming")
    _add_model_args(gen)
    _add_sampling_args(gen)
    chat = sub.add_parser("chat", help="interactive multi-turn chat", description="Interactive chat with the model's chat template. Commands: /reset, /exit.")
    chat.add_argument("--system", default=None, help="system message")
    _add_model_args(chat)
    _add_sampling_args(chat)
    return parser


def _sampling(args: argparse.Namespace) -> Any:
    from tokenleap.sampling import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )


def _load(args: argparse.Namespace) -> Any:
    from rich.console import Console

    from tokenleap.llm import LLM, set_threads

    set_threads(args.threads)
    console = Console(stderr=True)
    with console.status(f"loading {args.model} ({args.dtype})...", spinner="dots"):
        return LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, use_kernels=not args.no_kernels)


def _stats_line(out: Any) -> str:
    m = out.metrics
    c = out.outputs[0]
    return (
        f"[{m.num_prompt_tokens} prompt tokens, {m.num_generation_tokens} generated; "
        f"prefill {m.prefill_seconds:.2f} s, decode {m.decode_tokens_per_second:.1f} tok/s, "
        f"end to end {m.tokens_per_second:.1f} tok/s; finish: {c.finish_reason}]"
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise TokenleapError("the prompt is empty")
    params = _sampling(args)
    llm = _load(args)
    if args.raw:
        source: Any = prompt
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": prompt}]
        source = llm.chat_token_ids(messages)
    if args.json:
        out = llm.generate([source], params, use_tqdm=False)[0]
        c = out.outputs[0]
        m = out.metrics
        print(json.dumps({
            "text": c.text,
            "token_ids": c.token_ids,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            "num_prompt_tokens": m.num_prompt_tokens,
            "num_generation_tokens": m.num_generation_tokens,
            "prefill_seconds": round(m.prefill_seconds, 4),
            "decode_seconds": round(m.decode_seconds, 4),
            "decode_tokens_per_second": round(m.decode_tokens_per_second, 2),
            "tokens_per_second": round(m.tokens_per_second, 2),
        }, ensure_ascii=False))
        return 0
    chunk = None
    for chunk in llm.stream(source, params):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if chunk is not None and chunk.output is not None:
        print(_stats_line(chunk.output), file=sys.stderr)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling(args)
    llm = _load(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = []
    interactive = sys.stdin.isatty()
    if interactive:
        print("tokenleap chat: type a message; /reset clears the history, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            history.clear()
            print("(history cleared)", file=sys.stderr)
            continue
        conversation = system + history + [{"role": "user", "content": text}]
        try:
            ids = llm.chat_token_ids(conversation)
            reply = []
            chunk = None
            for chunk in llm.stream(ids, params):
                reply.append(chunk.text)
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        except TokenleapError as exc:
            print(f"\nerror: {exc} (type /reset to start a new conversation)", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": "".join(reply)}]
        if chunk is not None and chunk.output is not None:
            print(_stats_line(chunk.output), file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if not args.verbose:
        logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        if args.command == "generate":
            return _cmd_generate(args)
        return _cmd_chat(args)
    except TokenleapError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
