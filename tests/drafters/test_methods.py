"""A method is one record: a test file adds one (a drafter proposing the last token repeated N
times, N its one option) in a few lines, registers it, and finds it in `tokenleap generate
--help`, in the server's per-request schema and in the library, with its option validated. The
built-in methods' names, aliases, keys, registry and docs table come from their records."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

import tokenleap
from tokenleap import SpecConfig, TokenleapError
from tokenleap.drafters import (
    cli_flags,
    default_registry,
    docs_table,
    drafter_key,
    method_fields,
    registry,
    server_schema,
)
from tokenleap.drafters.base import Draft, StatelessDrafter
from tokenleap.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- a user's method, in a few lines


@dataclasses.dataclass(frozen=True)
class RepeatOptions:
    repeat_n: int = dataclasses.field(default=2, metadata={"help": "copies of the last token to draft"})

    def __post_init__(self) -> None:
        if not 1 <= self.repeat_n <= 64:
            raise TokenleapError(f"repeat_n must be in [1, 64], got {self.repeat_n}")


class RepeatLastDrafter(StatelessDrafter):
    name: ClassVar[str] = "repeat-last"

    def __init__(self, n: int) -> None:
        self.n = n

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        return Draft([tokens[-1]] * min(self.n, max_tokens))


REPEAT = tokenleap.MethodRecord(
    "repeat-last",
    lambda config, **_: RepeatLastDrafter(config.options_for("repeat-last").repeat_n),
    "drafts the last token repeated repeat_n times",
    options=RepeatOptions,
)


@pytest.fixture
def repeat_method() -> Iterator[tokenleap.MethodRecord]:
    tokenleap.register_method(REPEAT)
    yield REPEAT
    registry.unregister_method(REPEAT.name)


# --------------------------------------------------------------------------- the user's method everywhere


def test_registered_method_is_in_generate_help_with_its_option_flag(
    repeat_method: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenleap.cli import _spec_dict, build_parser, main

    with pytest.raises(SystemExit) as exit_:  # `tokenleap generate --help`
        main(["generate", "--help"])
    assert exit_.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "repeat-last" in help_text and "--spec-repeat-last-repeat-n" in help_text, help_text
    assert "copies of the last token to draft (default: 2)" in help_text
    args = build_parser().parse_args(
        ["generate", "hi", "--spec-type", "repeat-last", "--spec-repeat-last-repeat-n", "3"]
    )
    spec = SpecConfig.from_dict(_spec_dict(args))
    assert spec is not None and spec.method == "repeat-last" and spec.options_for() == RepeatOptions(3)
    with pytest.raises(TokenleapError, match="--spec-repeat-last-repeat-n is an option of method 'repeat-last'"):
        _spec_dict(
            build_parser().parse_args(["generate", "hi", "--spec-type", "ngram", "--spec-repeat-last-repeat-n", "3"])
        )
    with pytest.raises(SystemExit):  # the flag's type comes from the option's annotation
        build_parser().parse_args(["generate", "hi", "--spec-repeat-last-repeat-n", "x"])


def test_registered_method_is_in_the_servers_per_request_schema(repeat_method: Any) -> None:
    from tokenleap.server.errors import APIError
    from tokenleap.server.handlers import speculative
    from tokenleap.server.protocol import ChatCompletionRequest, SpeculativeOverride

    schema = ChatCompletionRequest.model_json_schema()["$defs"]["SpeculativeOverride"]["properties"]
    assert schema["repeat_n"]["type"] == "integer" and schema["repeat_n"]["default"] == 2
    assert "repeat-last" in schema["repeat_n"]["description"] and "repeat-last" in schema["method"]["description"]
    override = SpeculativeOverride.model_validate({"method": "repeat-last", "repeat_n": 3, "num_speculative_tokens": 4})
    state = SimpleNamespace(llm=SimpleNamespace(engine=SimpleNamespace(spec=None)), max_draft_tokens=16)
    spec = speculative(state, override)  # type: ignore[arg-type]
    assert (
        isinstance(spec, SpecConfig)
        and spec.options_for("repeat-last") == RepeatOptions(3)
        and spec.num_speculative_tokens == 4
    )
    with pytest.raises(APIError, match="repeat_n must be in"):
        speculative(state, SpeculativeOverride.model_validate({"method": "repeat-last", "repeat_n": 0}))  # type: ignore[arg-type]
    with pytest.raises(APIError, match="has no option"):
        speculative(state, SpeculativeOverride.model_validate({"method": "ngram", "repeat_n": 3}))  # type: ignore[arg-type]
    with pytest.raises(Exception, match="Extra inputs"):  # the other knobs stay strict
        SpeculativeOverride.model_validate({"method": "repeat-last", "model": "/etc/passwd"})
    registry.unregister_method(REPEAT.name)
    assert "repeat_n" not in SpeculativeOverride.model_json_schema()["properties"]


def test_registered_method_in_the_library_dict_api(repeat_method: Any) -> None:
    spec = SpecConfig.from_dict({"method": "repeat-last", "repeat_n": 3})
    # read now: derived
    assert spec is not None and spec.method in registry.method_names() and spec.options_for() == RepeatOptions(3)
    assert SpecConfig.from_dict({"method": "repeat-last"}).options_for() == RepeatOptions(2)  # type: ignore[union-attr]
    with pytest.raises(TokenleapError, match="repeat_n must be in"):
        SpecConfig.from_dict({"method": "repeat-last", "repeat_n": 0})
    with pytest.raises(TokenleapError, match="option repeat_n must be int"):
        SpecConfig.from_dict({"method": "repeat-last", "repeat_n": "3"})
    with pytest.raises(TokenleapError, match="unknown speculative_config key"):
        SpecConfig.from_dict({"method": "ngram", "repeat_n": 3})  # not an option of ngram
    # the options key the drafter; a chain passes each member its own
    assert drafter_key(spec) != drafter_key(SpecConfig("repeat-last"))
    assert drafter_key(spec) == drafter_key(dataclasses.replace(spec, num_speculative_tokens=5))
    chained = SpecConfig.from_dict({"method": "ngram+repeat-last", "repeat_n": 4})
    assert (
        chained is not None
        and chained.chain == ("ngram", "repeat-last")
        and chained.options_for("repeat-last") == RepeatOptions(4)
    )
    drafter = default_registry().create("chain", chained)
    member = drafter.drafters[1]  # type: ignore[attr-defined]
    assert isinstance(member, RepeatLastDrafter) and member.n == 4
    assert set(method_fields()) == set(default_registry().names())  # read now: derived, the registered method in
    hash(spec)


def test_registered_method_gives_plain_greedy_output_on_a_tiny_model(repeat_method: Any, tiny_hf_folder: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=12)
    prompt = [[5, 6, 7, 7, 7, 5, 6, 7, 7]]
    plain = tokenleap.LLM(str(tiny_hf_folder), dtype="float32").generate(prompt, params, use_tqdm=False)[0]
    spec = tokenleap.LLM(
        str(tiny_hf_folder),
        dtype="float32",
        speculative_config={"method": "repeat-last", "repeat_n": 3, "adaptive": False},
    )
    out = spec.generate(prompt, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert out.metrics.spec.num_draft_tokens > 0
    with pytest.raises(TokenleapError, match="repeat_n"):
        tokenleap.LLM(
            str(tiny_hf_folder), dtype="float32", speculative_config={"method": "repeat-last", "repeat_n": 99}
        )


@pytest.mark.slow
def test_registered_method_gives_plain_greedy_output_on_the_real_model(repeat_method: Any, llm: tokenleap.LLM) -> None:
    """The session's engine was made before the method was registered: its registry finds it on first use."""
    prompt = llm.chat_token_ids([{"role": "user", "content": "Count: one one one one, two two two two, three three"}])
    params = SamplingParams(temperature=0, max_tokens=32)
    plain = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.engine
    spec = SpecConfig.from_dict({"method": "repeat-last", "repeat_n": 3, "adaptive": False})
    req = engine.run(engine.add_request(prompt, params, speculative=spec))
    assert req.output_ids == plain and req.metrics.spec.num_draft_tokens > 0
    mine = tokenleap.LLM(speculative_config={"method": "repeat-last", "repeat_n": 3, "adaptive": False})
    assert mine.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == plain
    with pytest.raises(TokenleapError, match="repeat_n"):
        engine.add_request(prompt, params, speculative=SpecConfig.from_dict({"method": "repeat-last", "repeat_n": -1}))


# --------------------------------------------------------------------------- entry points


class _EntryPoint:
    def __init__(self, name: str, value: str, target: Any) -> None:
        self.name, self.value, self._target = name, value, target

    def load(self) -> Any:
        if isinstance(self._target, Exception):
            raise self._target
        return self._target


def test_entry_point_methods_load_lazily_and_report_failures(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[str] = []

    def entry_points(group: str) -> list[_EntryPoint]:
        calls.append(group)
        return [
            _EntryPoint("repeat", "mypkg:REPEAT", REPEAT),
            _EntryPoint("broken", "otherpkg:METHOD", ImportError("no module named otherpkg")),
            _EntryPoint("wrong", "otherpkg:thing", object()),
        ]

    monkeypatch.setattr("importlib.metadata.entry_points", entry_points)
    monkeypatch.setattr(registry._REGISTERED, "entry_points_loaded", False)
    monkeypatch.setattr(registry._REGISTERED, "failures", {})
    try:
        assert registry.canonical("repeat_last") == "repeat-last"  # first use loads them
        assert registry.canonical("ngram_simple") == "ngram-simple"
        assert calls == ["tokenleap.methods"]  # once per process
        spec = SpecConfig.from_dict({"method": "repeat-last", "repeat_n": 5})
        assert spec is not None and spec.options_for() == RepeatOptions(5)
        assert "failed to load" in caplog.text and "otherpkg" in caplog.text
        with pytest.raises(TokenleapError, match="unknown speculative method 'broken'.*no module named otherpkg"):
            SpecConfig("broken")
        with pytest.raises(TokenleapError, match="not a tokenleap.MethodRecord"):
            SpecConfig("wrong")
    finally:
        registry.unregister_method(REPEAT.name)


# --------------------------------------------------------------------------- built-ins from their records


def test_builtin_names_aliases_and_keys_come_from_the_records() -> None:
    assert registry.method_names() == tuple(r.name for r in registry.builtin_methods())
    for alias, name in (
        ("draft", "draft-model"), ("draft_model", "draft-model"), ("eagle-3", "eagle3"), ("prompt_lookup", "ngram"),
        ("mimo_mtp", "mtp"), ("ngram_map_k4v", "ngram-map-k4v")
    ):
        assert registry.canonical(alias) == name
    assert server_schema.server_side_methods() == {"custom", "draft-model", "eagle3", "eagle", "medusa", "chain"}
    assert method_fields() == {r.name: r.fields for r in registry.builtin_methods()}
    with pytest.raises(TokenleapError, match="is built in"):
        tokenleap.register_method(dataclasses.replace(REPEAT, name="ngram"))


def test_builtin_option_is_declared_once_and_derived_everywhere(capsys: pytest.CaptureFixture[str]) -> None:
    """A built-in method's option (suffix's tree depth) is a field of its options dataclass: that
    gives its flag in `tokenleap generate --help`, its property in the server's per-request schema
    (with the request limit) and its validation; SpecConfig holds only engine-wide controls."""
    from tokenleap.cli import _spec_dict, build_parser, main
    from tokenleap.drafters.ngram import NgramOptions
    from tokenleap.drafters.suffix import SuffixOptions
    from tokenleap.server.handlers import speculative
    from tokenleap.server.protocol import ChatCompletionRequest, SpeculativeOverride

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--spec-suffix-max-tree-depth N suffix: longest suffix indexed and matched (default: 64)" in help_text, (
        help_text
    )
    # one flag, two meanings
    assert "ngram, ngram-tree (prompt_lookup_max): longest n-gram looked up (default: 4)" in help_text
    spec = SpecConfig.from_dict(
        _spec_dict(
            build_parser().parse_args(["generate", "hi", "--spec-type", "suffix", "--spec-suffix-max-tree-depth", "16"])
        )
    )
    assert spec is not None and spec.options_for() == SuffixOptions(suffix_decoding_max_tree_depth=16)
    with pytest.raises(
        TokenleapError,
        match="--spec-suffix-max-tree-depth is an option of method 'suffix'; --spec-type ngram does not use it",
    ):
        _spec_dict(
            build_parser().parse_args(["generate", "hi", "--spec-type", "ngram", "--spec-suffix-max-tree-depth", "16"])
        )
    chained = SpecConfig.from_dict(
        _spec_dict(
            build_parser().parse_args(["generate", "hi", "--spec-type", "ngram+ngram-mod", "--spec-ngram-size-n", "5"])
        )
    )
    assert (
        chained is not None
        and chained.options_for("ngram") == NgramOptions(prompt_lookup_max=5)
        and chained.options_for("ngram-mod").ngram_size_n == 5
    )

    props = ChatCompletionRequest.model_json_schema()["$defs"]["SpeculativeOverride"]["properties"]
    depth = props["suffix_decoding_max_tree_depth"]
    assert (
        (depth["type"], depth["default"], depth["maximum"]) == ("integer", 64, 256) and "suffix" in depth["description"]
    )
    # the operator's: not per request
    assert "suffix_decoding_max_cached_requests" not in props and "model" not in props
    state = SimpleNamespace(llm=SimpleNamespace(engine=SimpleNamespace(spec=None)), max_draft_tokens=16)
    spec = speculative(
        state,  # type: ignore[arg-type]
        SpeculativeOverride.model_validate({"method": "suffix", "suffix_decoding_max_tree_depth": 16}),
    )
    assert isinstance(spec, SpecConfig) and spec.options_for() == SuffixOptions(suffix_decoding_max_tree_depth=16)
    with pytest.raises(Exception, match="suffix_decoding_max_tree_depth must be <= 256 in a request"):
        SpeculativeOverride.model_validate({"method": "suffix", "suffix_decoding_max_tree_depth": 1000})

    with pytest.raises(TokenleapError, match="suffix_decoding_max_tree_depth >= 1"):
        SuffixOptions(suffix_decoding_max_tree_depth=0)
    with pytest.raises(TokenleapError, match="suffix_decoding_max_tree_depth >= 1"):
        SpecConfig.from_dict({"method": "suffix", "suffix_decoding_max_tree_depth": 0})
    with pytest.raises(TokenleapError, match="option suffix_decoding_max_tree_depth must be int"):
        SpecConfig.from_dict({"method": "suffix", "suffix_decoding_max_tree_depth": "16"})
    # the library has no request limit
    assert SpecConfig.from_dict({"method": "suffix", "suffix_decoding_max_tree_depth": 1000}) is not None
    assert SpecConfig("suffix").method_options == (("suffix", SuffixOptions()),)
    assert "suffix_decoding_max_tree_depth" not in {f.name for f in dataclasses.fields(SpecConfig)}
    options = {f.name for r in registry.builtin_methods() for f in r.option_fields}
    assert not options & {f.name for f in dataclasses.fields(SpecConfig)}, (
        "a method's option is a field of its options, not of SpecConfig"
    )


def test_tree_options_are_named_for_trees_and_their_former_names_say_so() -> None:
    """EAGLE, Medusa and MTP trees are sized by `tree_topk` / `tree_depth`; a former name
    (`eagle_tree_topk`, `eagle_tree_depth`) is an error naming the new one, in every form a
    config takes."""
    assert SpecConfig("medusa", model="x", tree_topk=2).options_for().tree_topk == 2
    for method in ("mtp", "eagle", "eagle3"):
        opts = SpecConfig(method, model="x", tree_topk=3, tree_depth=4).options_for()
        assert (opts.tree_topk, opts.tree_depth) == (3, 4)
    with pytest.raises(TokenleapError, match="eagle_tree_topk is now tree_topk"):
        SpecConfig.from_dict({"method": "medusa", "model": "x", "eagle_tree_topk": 2})
    with pytest.raises(TokenleapError, match="eagle_tree_depth is now tree_depth"):
        SpecConfig("eagle", model="x", eagle_tree_depth=3)
    with pytest.raises(TokenleapError, match="eagle_tree_topk is now tree_topk"):
        SpecConfig("mtp", method_options={"mtp": {"eagle_tree_topk": 2}})
    with pytest.raises(AttributeError, match="eagle_tree_topk is now tree_topk"):
        SpecConfig("mtp").eagle_tree_topk  # noqa: B018


def test_docs_hold_the_generated_methods_table() -> None:
    table = docs_table.methods_table(registry.builtin_methods())
    assert table in (ROOT / "docs" / "speculative-decoding.md").read_text(), (
        "regenerate: print(methods_table(builtin_methods()))"
    )
    assert all(f"`{r.name}`" in table for r in registry.builtin_methods())


def test_spec_type_help_lists_every_method_and_chains() -> None:
    text = cli_flags.spec_type_help()
    for r in registry.builtin_methods():
        if r.name not in ("custom", "chain"):
            assert r.name in text
    assert "a+b" in text and "draft-eagle3" in text
    json.dumps(server_schema.options_json_schema())
