"""CLI: generate/chat on the real model, and clear errors (no traceback, exit 2) on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tokenleap.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "hi", "--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["generate", "hi", "--model", "/nonexistent/m.gguf"], "GGUF file not found"),
        (["generate", "   "], "the prompt is empty"),
        (["generate", "hi", "--max-tokens", "0"], "max_tokens must be a positive integer"),
        (["generate", "hi", "--temperature", "-0.5"], "temperature must be >= 0"),
        (["generate", "hi", "--temperature", "nan"], "temperature must be >= 0 and finite"),
        (["generate", "hi", "--temperature", "inf"], "temperature must be >= 0 and finite"),
        (["generate", "hi", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["generate", "hi", "--presence-penalty", "3"], "presence_penalty must be in [-2, 2]"),
        (["generate", "hi", "--min-tokens", "-1"], "min_tokens must be"),
        (["generate", "hi", "--speculative-config", "{bad"], "--speculative-config is not valid JSON"),
        (["generate", "hi", "--speculative-config", "[1]"], "--speculative-config must be a JSON object"),
        (
            ["generate", "hi", "--speculative-config", '{"method": "ngram"}', "--spec-type", "ngram"],
            "either --speculative-config or --spec-type",
        ),
        (["generate", "hi", "--speculative-config", '{"method": "bogus"}'], "unknown speculative method 'bogus'"),
        (
            ["generate", "hi", "--spec-type", "ngram-mod", "--draft-max", "65"],
            "num_speculative_tokens must be in [1, 64], got 65",
        ),
        (
            ["generate", "hi", "-ctk", "q8_0", "-ctv", "f16"],
            "keys and values in one type: --cache-type-k q8_0, --cache-type-v f16 differ",
        ),
        (["bench", "--methods", "ngram", "--rounds", "0"], "--rounds must be >= 1, got 0"),
    ],
)
def test_bad_input_is_one_clear_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "generate" in capsys.readouterr().out


@pytest.mark.slow
def test_prompt_longer_than_context_via_entry_point() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tokenleap.cli", "generate", "hello " * 40, "--raw", "--max-model-len", "16"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "context length is 16" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_generate_json_greedy_is_deterministic(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "What is 2 + 2?", "--temperature", "0", "-n", "24", "--json"]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["text"].strip()
    assert len(first["token_ids"]) == first["num_generation_tokens"] <= 24
    assert first["finish_reason"] in ("stop", "length")
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == first["token_ids"]


@pytest.mark.slow
def test_generate_streams_text_and_stats(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "Count from 1 to 5.", "--seed", "7", "-n", "20", "--stop", "5"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert "5" not in captured.out  # the stop string is cut
    assert "tok/s" in captured.err


@pytest.mark.slow
def test_stats_print_llama_cpps_statistics_line(capsys: pytest.CaptureFixture[str]) -> None:
    """`--stats` ends with llama.cpp's per-implementation line, its counters consistent."""
    import re

    assert main(["generate", "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat.",
                 "--temperature", "0", "-n", "48", "--spec-type", "ngram_simple", "--draft-max", "8", "--stats"]) == 0
    err = capsys.readouterr().err
    m = re.search(
        r"statistics ngram_simple: #calls\(b,g,a\) = (\d+) (\d+) (\d+), #gen drafts = (\d+), #acc drafts = (\d+), "
        r"#gen tokens = (\d+), #acc tokens = (\d+), dur\(b,g,a\) = [\d.]+, [\d.]+, [\d.]+ ms",
        err,
    )
    assert m is not None, err
    b, g, a, gen_d, acc_d, gen_t, acc_t = map(int, m.groups())
    assert b == 1 and g >= gen_d >= acc_d > 0 and gen_t >= acc_t > 0 and a >= gen_d


@pytest.mark.slow
def test_llama_cpp_ngram_mod_example_is_lossless_with_statistics(capsys: pytest.CaptureFixture[str]) -> None:
    """llama.cpp's ngram-mod example (`--spec-ngram-size-n 24 --draft-min 48 --draft-max 64`)
    runs, prints what plain decoding prints and llama.cpp's statistics line."""
    import re

    base = [
        "generate",
        "Repeat this list exactly three times: apple, banana, cherry, date, elderberry, fig, grape, honeydew, "
        "kiwi, lemon, mango, nectarine, orange, papaya, quince.",
        "--temperature",
        "0",
        "-n",
        "160",
    ]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main([*base, "--spec-type", "ngram-mod", "--spec-ngram-size-n", "24", "--draft-min", "48", "--draft-max",
                 "64", "--stats"]) == 0
    captured = capsys.readouterr()
    assert captured.out == plain
    m = re.search(
        r"statistics ngram_mod: #calls\(b,g,a\) = (\d+) (\d+) (\d+), #gen drafts = (\d+), #acc drafts = (\d+), "
        r"#gen tokens = (\d+), #acc tokens = (\d+), dur\(b,g,a\) = [\d.]+, [\d.]+, [\d.]+ ms",
        captured.err,
    )
    assert m is not None, captured.err
    b, g, a, gen_d, acc_d, gen_t, acc_t = map(int, m.groups())
    assert b == 1 and g >= gen_d >= acc_d > 0 and gen_t >= 48 * gen_d and gen_t <= 64 * gen_d and acc_t > 0


def test_q8_0_kv_cache_as_llama_cpp_users_type_it(capsys: pytest.CaptureFixture[str]) -> None:
    """`-ctk q8_0 -ctv q8_0`: speculative output identical to plain decoding over the same q8_0
    cache; one of the two flags alone applies to both, and says so."""
    from tokenleap.kernels import load_kernels

    kernels = load_kernels()
    if kernels is None or not kernels.bf16_attention:
        pytest.skip("no blocked bf16 attention in this CPU's kernel variant (AVX-512 without BF16): no q8_0 KV cache")
    base = ["generate", "Repeat this list exactly twice: apple, banana, cherry, date, elderberry, fig, grape.",
            "--temperature", "0", "-n", "48"]
    assert main([*base, "-ctk", "q8_0", "-ctv", "q8_0"]) == 0
    plain = capsys.readouterr().out
    assert main([*base, "--cache-type-k", "q8_0", "--spec-type", "ngram-mod", "--spec-ngram-size-n", "8", "--draft-max",
                 "16"]) == 0
    captured = capsys.readouterr()
    assert captured.out == plain and "--cache-type-k q8_0 applies to keys and values alike" in captured.err


@pytest.mark.slow
def test_stats_print_a_statistics_line_per_chain_member(capsys: pytest.CaptureFixture[str]) -> None:
    """A chain's `--stats`: the chain's line, then one llama.cpp line per member, whose drafts
    add up to the chain's (each verified draft is one member's)."""
    import re

    assert main(["generate", "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat.",
                 "--temperature", "0", "-n", "48", "--spec-type", "ngram_map_k+ngram-simple", "--draft-max", "8",
                 "--stats"]) == 0
    err = capsys.readouterr().err
    pattern = (r"statistics {}: #calls\(b,g,a\) = (\d+) (\d+) (\d+), #gen drafts = (\d+), #acc drafts = (\d+), "
               r"#gen tokens = (\d+), #acc tokens = (\d+), dur\(b,g,a\) = [\d.]+, [\d.]+, [\d.]+ ms")
    lines = {}
    for name in ("ngram_map_k\\+ngram_simple", "ngram_map_k", "ngram_simple"):
        m = re.search(pattern.format(name), err)
        assert m is not None, (name, err)
        lines[name.replace("\\", "")] = list(map(int, m.groups()))
    chain, first, second = lines["ngram_map_k+ngram_simple"], lines["ngram_map_k"], lines["ngram_simple"]
    assert err.index("statistics ngram_map_k:") < err.index("statistics ngram_simple:")  # chain order
    assert first[0] == second[0] == chain[0] == 1  # each member began the request once
    assert first[2] == second[2] == chain[2]  # and heard of every verification
    assert [f + s for f, s in zip(first[3:], second[3:])] == chain[3:]  # drafts and tokens: the members' sum
    assert chain[5] > 0 and chain[6] > 0
    assert second[1] <= first[1] == chain[1]  # the second is asked only when the first has nothing


@pytest.mark.slow
def test_chat_multi_turn_from_stdin() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tokenleap.cli", "chat", "--temperature", "0", "-n", "16"],
        input="My name is Ada.\n/reset\nSay hello.\n/exit\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "(history cleared)" in proc.stderr
    assert proc.stderr.count(" generated; ") == 2  # one stats line per answered turn
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_generate_with_quantized_weights(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["generate", "Name a prime number.", "--quantization", "gguf", "--temperature", "0", "-n", "12", "--json"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["text"] and len(out["token_ids"]) <= 12


def test_quantization_of_a_folder_model_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert main(["generate", "hi", "--model", str(tmp_path), "--quantization", "gguf"]) == 2
    err = capsys.readouterr().err
    assert "needs a .gguf model" in err and "Traceback" not in err


def test_tree_and_acceptance_flags_reach_the_speculative_config() -> None:
    from tokenleap import SpecConfig
    from tokenleap.cli import _spec_dict, build_parser

    args = build_parser().parse_args(["generate", "hi", "--spec-type", "ngram-tree", "--spec-ngram-size-n", "3",
                                      "--spec-sampled-tree", "first-path", "--spec-acceptance", "typical-lossy",
                                      "--spec-typical-threshold", "0.2"])
    spec = SpecConfig.from_dict(_spec_dict(args))
    assert spec is not None and spec.method == "ngram-tree" and spec.prompt_lookup_max == 3
    assert (spec.sampled_tree, spec.acceptance, spec.typical_threshold, spec.typical_alpha) == (
        "first-path",
        "typical-lossy",
        0.2,
        0.3,
    )
    plain = SpecConfig.from_dict(_spec_dict(build_parser().parse_args(["generate", "hi", "--spec-type", "ngram"])))
    assert plain is not None and (plain.sampled_tree, plain.acceptance) == ("full", "exact")


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_the_front_door_speculates_by_default(command: str) -> None:
    """generate / chat / serve speculate with `auto` (suffix decoding, adaptive) unless told
    `--spec-type none`; a draft model alone means draft-model; a whole JSON config replaces it."""
    from tokenleap import SpecConfig
    from tokenleap.cli import _spec_dict, build_parser

    def spec(*argv: str) -> SpecConfig | None:
        return SpecConfig.from_dict(
            _spec_dict(build_parser().parse_args([command, *(["hi"] if command == "generate" else []), *argv]))
        )

    default = spec()
    assert default is not None and default.method == "suffix" and default.adaptive
    assert spec("--spec-type", "none") is None and spec("--spec-type", "off") is None
    with_draft = spec("-md", "smollm2-135m-instruct")
    assert with_draft is not None and with_draft.method == "draft-model"
    given = spec("--speculative-config", '{"method": "ngram"}')
    assert given is not None and given.method == "ngram"
    chained = spec("--spec-type", "ngram", "--spec-type", "suffix")
    assert chained is not None and chained.chain == ("ngram", "suffix")


def test_llama_cpp_spellings_flags_and_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What llama.cpp's speculative-decoding docs have users type: --draft / --draft-n / --draft-n-min,
    LLAMA_ARG_DRAFT_MAX / _MIN, `draft` and underscore spellings; -md beside a draftless method is
    a clear error, not silently ignored."""
    from tokenleap import SpecConfig
    from tokenleap.cli import _spec_dict, build_parser

    def spec(*argv: str) -> SpecConfig:
        out = SpecConfig.from_dict(_spec_dict(build_parser().parse_args(["generate", "hi", *argv])))
        assert out is not None
        return out

    s = spec("--spec-type", "ngram_simple", "--draft", "12", "--draft-n-min", "3")
    assert (s.method, s.num_speculative_tokens, s.draft_min) == ("ngram-simple", 12, 3)
    assert spec("--spec-type", "ngram_map_k", "--draft-n", "9").num_speculative_tokens == 9
    s = spec("--spec-type", "draft", "-md", "smollm2-135m-instruct")
    assert (s.method, s.model) == ("draft-model", "smollm2-135m-instruct")
    monkeypatch.setenv("LLAMA_ARG_DRAFT_MAX", "7")
    monkeypatch.setenv("LLAMA_ARG_DRAFT_MIN", "2")
    s = spec("--spec-type", "ngram-mod")
    assert (s.num_speculative_tokens, s.draft_min) == (7, 2)
    assert spec("--spec-type", "ngram-mod", "--draft-max", "5").num_speculative_tokens == 5  # the flag wins
    monkeypatch.setenv("LLAMA_ARG_DRAFT_MAX", "many")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi"])
    assert "invalid int value: 'many'" in capsys.readouterr().err
    monkeypatch.delenv("LLAMA_ARG_DRAFT_MAX")
    assert main(["generate", "hi", "--spec-type", "ngram-simple", "-md", "x.gguf"]) == 2
    err = capsys.readouterr().err
    assert "--spec-type ngram-simple uses none" in err and "ngram-simple+draft-model" in err and "Traceback" not in err


@pytest.mark.slow
def test_speculative_config_json_and_penalties(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["generate", "Repeat after me: red green blue red green blue red green blue", "--temperature", "0", "-n",
            "24", "--json"]
    assert main(base + ["--repeat-penalty", "1.3"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert (
        main(
            base
            + ["--repeat-penalty", "1.3", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']
        )
        == 0
    )
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"]
    assert main(base) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] != plain["token_ids"]  # the penalty changed the text


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--aux-layers", "1,2"], "--aux-layers takes three comma-separated layer ids"),
        (["--aux-layers", "a,b,c"], "--aux-layers takes three"),
        (["--ttt-steps", "0"], "ttt_steps must be in [1, 16]"),
        (["--data", "/nonexistent/chats.jsonl"], "does not exist"),
        (["--resume"], "nothing to resume"),
    ],
)
def test_train_drafter_bad_input(
    extra: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train-drafter", "-o", str(tmp_path / "head"), "--no-progress", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_train_drafter_end_to_end_on_the_default_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Self-distillation, a few TTT steps, the EAGLE-3 layout on disk, and the engine evaluation
    (greedy outputs with the head identical to plain decoding) on SmolLM2."""
    data = tmp_path / "chats.jsonl"
    topics = ["the moon", "tea", "rivers", "prime numbers", "bicycles", "owls", "glass", "maps", "bread", "snow"]
    data.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"Write one sentence about {t}."},
                        {"role": "assistant", "content": "(answered again by the target)"},
                    ]
                }
            )
            + "\n"
            for t in topics
        )
    )
    out = tmp_path / "head"
    argv = [
        "train-drafter", "-o", str(out), "--data", str(data), "--regen-max-tokens", "24", "--draft-vocab-size", "512",
        "--ttt-steps", "2", "--tokens-per-batch", "256", "--epochs", "3", "--max-steps", "3", "--eval-prompts", "2",
        "--no-progress"
    ]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "self-distillation: the target answers 10 prompts" in err
    assert "outputs identical" in err and "--spec-type eagle3 --model-draft" in err
    regen = [json.loads(line) for line in (out / "regenerated.jsonl").read_text().splitlines()]
    assert len(regen) == len(topics) and all(r["answer"].strip() for r in regen)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 512 and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert cfg["tokenleap_training"]["steps"] == 3
    assert cfg["tokenleap_training"]["command"].startswith("tokenleap train-drafter -o ")
    ev = json.loads((out / "eval.json").read_text())
    assert ev["identical"] and ev["prompts"] == 2
    # a second run resumes: answers come from the cache, training continues from step 3
    assert main([*argv, "--resume", "--max-steps", "1", "--eval-prompts", "0"]) == 0
    err = capsys.readouterr().err
    assert "resuming at step 3" in err and "self-distillation" not in err
    assert json.loads((out / "config.json").read_text())["tokenleap_training"]["steps"] == 4


# --------------------------------------------------------------------------- llama.cpp's current flag names


def _spec(*argv: str) -> Any:
    from tokenleap import SpecConfig
    from tokenleap.cli import _spec_dict, build_parser

    return SpecConfig.from_dict(_spec_dict(build_parser().parse_args(["generate", "hi", *argv])))


@pytest.mark.parametrize(
    ("current", "former"),
    [
        (
            [
                "--spec-type", "draft-simple", "--spec-draft-model", "x.gguf", "--spec-draft-n-max", "7",
                "--spec-draft-n-min", "2"
            ],
            ["--spec-type", "draft", "-md", "x.gguf", "--draft-max", "7", "--draft-min", "2"],
        ),
        (
            ["--spec-type", "draft-simple", "--spec-draft-model", "x.gguf", "--spec-draft-p-min", "0.75"],
            ["--spec-type", "draft-model", "--model-draft", "x.gguf", "--draft-p-min", "0.75"],
        ),
        (["--spec-type", "draft-eagle3", "--spec-draft-n-max", "3"], ["--spec-type", "eagle3", "--draft", "3"]),
        (["--spec-type", "draft-mtp", "--spec-draft-n-max", "3"], ["--spec-type", "mtp", "--draft-n", "3"]),
        (
            ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "12", "--spec-ngram-simple-size-m", "48"],
            ["--spec-type", "ngram_simple", "--spec-ngram-size-n", "12", "--spec-ngram-size-m", "48"],
        ),
        (
            [
                "--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "8", "--spec-ngram-map-k-size-m", "8",
                "--spec-ngram-map-k-min-hits", "2"
            ],
            [
                "--spec-type", "ngram-map-k", "--spec-ngram-size-n", "8", "--spec-ngram-size-m", "8",
                "--spec-ngram-min-hits", "2"
            ],
        ),
        (
            [
                "--spec-type", "ngram-map-k4v", "--spec-ngram-map-k4v-size-n", "8", "--spec-ngram-map-k4v-size-m", "8",
                "--spec-ngram-map-k4v-min-hits", "3"
            ],
            [
                "--spec-type", "ngram-map-k4v", "--spec-ngram-size-n", "8", "--spec-ngram-size-m", "8",
                "--spec-ngram-min-hits", "3"
            ],
        ),
        # llama.cpp's ngram-mod example, in each generation's names
        (
            [
                "--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "24", "--spec-ngram-mod-n-min", "48",
                "--spec-ngram-mod-n-max", "64"
            ],
            ["--spec-type", "ngram-mod", "--spec-ngram-size-n", "24", "--draft-min", "48", "--draft-max", "64"],
        ),
        # a draft model alone: its type
        (["--spec-draft-model", "x.gguf", "--spec-draft-n-max", "5"], ["-md", "x.gguf", "--draft-max", "5"]),
        (["-md", "x.gguf"], ["--spec-type", "draft-model", "-md", "x.gguf"]),
        # llama.cpp's draft cache types
        (["-md", "x.gguf", "-ctkd", "q8_0"], ["-md", "x.gguf", "--cache-type-k-draft", "q8"]),
        (["--spec-type", "ngram-mod,ngram-simple"], ["--spec-type", "ngram-mod+ngram-simple"]),
        (["--spec-type", "ngram-mod", "--spec-type", "ngram-simple"], ["--spec-type", "ngram-mod+ngram-simple"]),
        # one cap per request: the largest
        (
            [
                "--spec-type", "ngram-mod,draft-simple", "--spec-draft-model", "x.gguf", "--spec-ngram-mod-n-max", "32",
                "--spec-draft-n-max", "4"
            ],
            ["--spec-type", "ngram-mod+draft-model", "-md", "x.gguf", "--draft-max", "32"],
        ),
    ],
)
def test_llama_cpp_current_spellings_parse_as_the_former(current: list[str], former: list[str]) -> None:
    new, old = _spec(*current), _spec(*former)
    assert new is not None and new == old


def test_a_draft_model_alone_means_its_type_unless_none_is_said() -> None:
    # as vLLM's model without a method: by its name
    assert _spec("--spec-draft-model", "my-eagle3-head").method == "eagle3"
    assert _spec("--spec-type", "none", "-md", "x.gguf") is None


def test_a_types_own_flag_wins_over_the_shared_one_for_that_type_only() -> None:
    spec = _spec(
        "--spec-type", "ngram-map-k,ngram-simple", "--spec-ngram-size-n", "8", "--spec-ngram-map-k-size-n", "12"
    )
    assert spec.options_for("ngram-map-k").ngram_size_n == 12 and spec.options_for("ngram-simple").ngram_size_n == 8
    spec = _spec(
        "--spec-type", "ngram-mod", "--spec-draft-n-max", "8", "--spec-draft-n-min", "2", "--spec-ngram-mod-n-min", "4"
    )
    assert (spec.num_speculative_tokens, spec.draft_min) == (8, 2)  # the smallest floor given


def test_llama_cpp_environment_variables_of_both_generations(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenleap.cli import build_parser

    monkeypatch.setenv("LLAMA_ARG_SPEC_DRAFT_N_MAX", "9")
    monkeypatch.setenv("LLAMA_ARG_SPEC_DRAFT_N_MIN", "3")
    spec = _spec("--spec-type", "ngram-mod")
    assert (spec.num_speculative_tokens, spec.draft_min) == (9, 3)
    monkeypatch.setenv("LLAMA_ARG_DRAFT_MAX", "7")  # the former names: the current ones win
    monkeypatch.setenv("LLAMA_ARG_DRAFT_MIN", "1")
    assert (_spec("--spec-type", "ngram-mod").num_speculative_tokens, _spec("--spec-type", "ngram-mod").draft_min) == (
        9,
        3,
    )
    assert _spec("--spec-type", "ngram-mod", "--spec-draft-n-max", "5").num_speculative_tokens == 5  # the flag wins
    # the environment's cap counts as given: with a per-type cap, the larger applies
    assert _spec("--spec-type", "ngram-mod", "--spec-ngram-mod-n-max", "4").num_speculative_tokens == 9
    monkeypatch.delenv("LLAMA_ARG_SPEC_DRAFT_N_MAX")
    monkeypatch.delenv("LLAMA_ARG_SPEC_DRAFT_N_MIN")
    spec = _spec("--spec-type", "ngram-mod")
    assert (spec.num_speculative_tokens, spec.draft_min) == (7, 1)
    monkeypatch.delenv("LLAMA_ARG_DRAFT_MAX")
    monkeypatch.delenv("LLAMA_ARG_DRAFT_MIN")
    # 16 is only a default
    assert _spec("--spec-type", "ngram-mod", "--spec-ngram-mod-n-max", "4").num_speculative_tokens == 4
    monkeypatch.setenv("LLAMA_ARG_SPEC_DRAFT_N_MAX", "lots")
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["generate", "hi"])
    assert (
        info.value.code == 2
        and "error: argument --draft-max/--spec-draft-n-max/--draft/--draft-n: invalid int value: 'lots'"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--spec-type", "draft-bogus"], "unknown speculative method 'draft-bogus'"),
        (["--spec-type", "ngram-mod,bogus"], "not allowed: bogus"),
        (
            ["--spec-type", "ngram-simple", "--spec-ngram-map-k-size-n", "4"],
            "--spec-ngram-map-k-size-n is an option of method 'ngram-map-k'; --spec-type ngram-simple does not use it",
        ),
        (
            ["--spec-type", "ngram-simple", "--spec-ngram-mod-n-max", "8"],
            "--spec-ngram-mod-n-max is a draft length of method 'ngram-mod'",
        ),
        (
            ["--spec-type", "draft-mtp", "--spec-draft-p-min", "0.5"],
            "--spec-draft-p-min is an option of method 'draft-model'; --spec-type draft-mtp",
        ),
        (
            ["--spec-type", "draft-simple", "--spec-draft-model", "x.gguf", "--spec-draft-p-min", "1.5"],
            "draft_p_min must be in [0, 1], got 1.5",
        ),
        (
            ["-md", "x.gguf", "-ctkd", "q8_0", "-ctvd", "f16"],
            "draft_cache_type_k q8_0 and draft_cache_type_v bf16 differ",
        ),
        (["-md", "x.gguf", "--cache-type-k-draft", "q4"], "draft_cache_type_k must be one of auto, bf16, q8_0"),
        (
            ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-max", "65"],
            "num_speculative_tokens must be in [1, 64], got 65",
        ),
        (
            ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-min", "9", "--spec-ngram-mod-n-max", "8"],
            "draft_min must be in [0, num_speculative_tokens]",
        ),
        (
            ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "0"],
            "ngram_size_n and ngram_mod_pool_size must be >= 1",
        ),
        (["--spec-type", "draft-simple"], "method 'draft-model' needs a draft model"),
        (
            ["--spec-type", "ngram-mod", "--spec-synth-len", "8"],
            "--spec-synth-len (llama.cpp's synthetic acceptance rates, for benchmarking) is not supported",
        ),
        (
            ["--spec-synth-rates", "0.9,0.8"],
            "--spec-synth-rates (llama.cpp's synthetic acceptance rates, for benchmarking) is not supported",
        ),
    ],
)
def test_bad_llama_cpp_flags_are_one_clear_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", "hi", *argv]) == 2  # before any model load
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err, err


def test_a_bad_value_of_a_current_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, flag in (
        (["--spec-draft-n-max", "many"], "--spec-draft-n-max"),
        (["--spec-ngram-mod-n-match", "x"], "--spec-ngram-mod-n-match"),
        (["--spec-draft-p-min", "high"], "--spec-draft-p-min"),
    ):
        with pytest.raises(SystemExit) as info:
            main(["generate", "hi", "--spec-type", "ngram-mod", *argv])
        err = capsys.readouterr().err
        assert info.value.code == 2 and "error: argument" in err and flag in err and "invalid" in err, err


def test_the_server_takes_llama_cpp_type_names_and_lists_per_request() -> None:
    """A request's `speculative.method` in llama.cpp's names: a comma list is a chain, and a list
    naming a method only the operator may choose is refused as its `+` spelling is."""
    from types import SimpleNamespace

    from tokenleap import SpecConfig
    from tokenleap.server.errors import APIError
    from tokenleap.server.handlers import speculative
    from tokenleap.server.protocol import SpeculativeOverride

    state = SimpleNamespace(llm=SimpleNamespace(engine=SimpleNamespace(spec=None)), max_draft_tokens=16)

    def ask(method: str) -> Any:
        return speculative(state, SpeculativeOverride.model_validate({"method": method, "num_speculative_tokens": 4}))  # type: ignore[arg-type]

    assert ask("ngram-mod,ngram-simple") == ask("ngram-mod+ngram-simple") == SpecConfig("ngram-mod+ngram-simple", 4)
    assert ask("draft-mtp") == SpecConfig("mtp", 4)
    for method in ("ngram,draft-eagle3", "ngram+eagle3", "draft-simple"):
        with pytest.raises(APIError, match="not available per request"):
            ask(method)


def test_every_model_flag_reaches_a_ray_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    """serve --replicas hands each replica the arguments a local serve gives its LLM (the KV cache
    type was once dropped there)."""
    import tokenleap.llm
    import tokenleap.ray.serve as ray_serve
    from tokenleap.cli import _cmd_serve, build_parser

    local: dict[str, object] = {}
    replica: dict[str, object] = {}

    class FakeLLM:
        def __init__(self, **kwargs: object) -> None:
            local.update(kwargs)
            raise SystemExit(0)  # stop before serving

    def fake_deployment(*, llm_kwargs: dict[str, object], **_: object) -> None:
        replica.update(llm_kwargs)

    monkeypatch.setattr(tokenleap.llm, "LLM", FakeLLM)
    monkeypatch.setattr(ray_serve, "deployment", fake_deployment)
    monkeypatch.setattr(ray_serve, "run_until_signal", lambda *a, **k: None)
    flags = [
        "--model", "smollm2-135m-instruct", "--dtype", "float32", "--max-model-len", "512", "--quantization", "none",
        "-ctk", "q8_0", "-ctv", "q8_0", "--spec-type", "ngram", "--draft-max", "5", "--port", "0"
    ]
    with pytest.raises(SystemExit):
        _cmd_serve(build_parser().parse_args(["serve", *flags]))
    assert _cmd_serve(build_parser().parse_args(["serve", *flags, "--replicas", "2"])) == 0
    assert local and replica == local and replica["kv_cache_dtype"] == "q8_0"
