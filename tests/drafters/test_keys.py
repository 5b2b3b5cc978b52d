"""Which drafter serves a speculative config: configs that differ only in per-request controls
(draft length cap, floor, adaptive) share one drafter; a draft model is loaded once per path
however many drafters use it; a user's drafter is keyed by identity (a `@dataclass` drafter is
unhashable)."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest

import tokenleap
from tokenleap import SpecConfig
from tokenleap.drafters import CONTROL_FIELDS, default_registry, drafter_key, method_fields
from tokenleap.drafters.base import Draft, DraftRequest
from tokenleap.drafters.ngram import NgramDrafter
from tokenleap.sampling import SamplingParams


@dataclasses.dataclass
class DataclassDrafter:
    """A user's drafter written as a plain `@dataclass` (eq=True: unhashable)."""

    name: ClassVar[str] = "dataclass-lookup"
    needs_hidden_states: ClassVar[bool] = False
    lookup: NgramDrafter = dataclasses.field(default_factory=NgramDrafter, compare=False)
    proposed: int = 0

    def begin(self, request: DraftRequest) -> None: ...

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        draft = self.lookup.propose(request_id, tokens, max_tokens)
        self.proposed += len(draft)
        return draft

    def accept(self, request_id: str, tokens: Sequence[int], num_accepted: int) -> None: ...

    def end(self, request_id: str) -> None: ...


# --------------------------------------------------------------------------- keys


def test_control_fields_do_not_make_a_new_drafter() -> None:
    for method in ("ngram", "suffix", "ngram-map-k", "suffix+ngram"):
        base = SpecConfig(method=method)
        other = SpecConfig(method=method, num_speculative_tokens=4, draft_min=2, adaptive=False)
        assert drafter_key(base) == drafter_key(other), method
    # fields of other methods do not matter either
    assert drafter_key(SpecConfig(method="suffix")) == drafter_key(
        SpecConfig(method="suffix", prompt_lookup_max=7, ngram_size_n=5)
    )
    assert drafter_key(SpecConfig(method="ngram")) == drafter_key(
        SpecConfig(method="ngram", suffix_decoding_max_tree_depth=8)
    )


def test_fields_the_method_reads_make_a_new_drafter() -> None:
    assert drafter_key(SpecConfig(method="ngram")) != drafter_key(SpecConfig(method="ngram", prompt_lookup_max=7))
    assert drafter_key(SpecConfig(method="suffix")) != drafter_key(
        SpecConfig(method="suffix", suffix_decoding_min_token_prob=0.3)
    )
    assert drafter_key(SpecConfig(method="ngram-map-k")) != drafter_key(
        SpecConfig(method="ngram-map-k", ngram_min_hits=3)
    )
    assert drafter_key(SpecConfig(method="ngram-cache")) != drafter_key(
        SpecConfig(method="ngram-cache", ngram_cache_path="x.bin")
    )
    assert drafter_key(SpecConfig(method="ngram")) != drafter_key(SpecConfig(method="suffix"))
    assert drafter_key(SpecConfig(method="suffix+ngram")) != drafter_key(SpecConfig(method="ngram+suffix"))
    assert drafter_key(SpecConfig(method="suffix+ngram")) != drafter_key(
        SpecConfig(method="suffix+ngram", prompt_lookup_max=2)
    )
    a = SpecConfig(method="draft-model", model="m.gguf")
    assert drafter_key(a) != drafter_key(dataclasses.replace(a, draft_layers=4))
    assert drafter_key(a) == drafter_key(dataclasses.replace(a, num_speculative_tokens=3))


def test_custom_drafters_are_keyed_by_identity() -> None:
    one, two = DataclassDrafter(), DataclassDrafter()
    assert one == two  # equal, unhashable objects...
    with pytest.raises(TypeError):
        hash(one)
    a, b = SpecConfig(method="custom", drafter=one), SpecConfig(method="custom", drafter=two)
    assert drafter_key(a) != drafter_key(b)  # ...are still two drafters
    assert drafter_key(a) == drafter_key(dataclasses.replace(a, num_speculative_tokens=2))
    hash(drafter_key(a))


def test_every_method_lists_its_fields_and_every_field_belongs_somewhere() -> None:
    """The per-method field lists cannot drift: each registered method has one, and a new
    SpecConfig field must be claimed by a method (or be a per-request control)."""
    assert set(method_fields()) == set(default_registry().names())
    fields = {f.name for f in dataclasses.fields(SpecConfig)}
    claimed = {"method", *CONTROL_FIELDS, *(f for names in method_fields().values() for f in names)}
    assert fields == claimed, f"unclaimed: {sorted(fields - claimed)}, unknown: {sorted(claimed - fields)}"


class _Recording:
    """A SpecConfig stand-in that records which fields a factory reads."""

    def __init__(self, config: SpecConfig) -> None:
        self._config = config
        self.read: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        self.read.add(name)
        return getattr(self._config, name)


@pytest.mark.parametrize(
    "method", ["ngram", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", "suffix", "custom"]
)
def test_factories_read_only_their_listed_fields(method: str) -> None:
    config = SpecConfig(method=method, drafter=DataclassDrafter() if method == "custom" else None)
    recording = _Recording(config)
    default_registry().create(method, recording)
    assert recording.read - {"method"} <= set(method_fields()[method]), method


# --------------------------------------------------------------------------- engines on real models


@pytest.mark.slow
def test_per_request_controls_reuse_the_engines_drafter(llm: tokenleap.LLM) -> None:
    engine = llm.engine
    a = engine.drafter_for(SpecConfig(method="suffix"))
    b = engine.drafter_for(SpecConfig(method="suffix", num_speculative_tokens=4, adaptive=False))
    c = engine.drafter_for(SpecConfig(method="suffix", suffix_decoding_min_token_prob=0.25))
    assert a is b and c is not a


def test_draft_model_is_loaded_once_per_path(
    tiny_hf_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drafters of one registry (one engine) share a loaded draft model: another cap, another
    layer count or another spelling of the path loads no second copy."""
    import tokenleap.models.loading as loading

    target = tokenleap.LLM(str(tiny_hf_folder), dtype="float32")
    draft_dir = tmp_path / "draft"
    shutil.copytree(tiny_hf_folder, draft_dir)  # another path: not the target's own weights
    loads: list[Any] = []
    real = loading.load_model

    def counting(*args: Any, **kwargs: Any) -> Any:
        loads.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(loading, "load_model", counting)
    engine = target.engine
    base = SpecConfig(method="draft-model", model=str(draft_dir))
    first = engine.drafter_for(base)
    assert engine.drafter_for(dataclasses.replace(base, num_speculative_tokens=3)) is first
    layered = engine.drafter_for(dataclasses.replace(base, draft_layers=1))
    (tmp_path / "link").symlink_to(draft_dir)
    respelled = engine.drafter_for(dataclasses.replace(base, model=str(tmp_path / "link")))
    assert layered is not first and respelled is not first
    assert len(loads) == 1
    assert layered.model.layers[0] is first.model.layers[0]  # type: ignore[attr-defined]


def test_dataclass_custom_drafter_in_the_llm_constructor(tiny_hf_folder: Path) -> None:
    llm = tokenleap.LLM(
        str(tiny_hf_folder),
        dtype="float32",
        speculative_config={"method": "custom", "drafter": DataclassDrafter(), "adaptive": False},
    )
    out = llm.generate([[5, 6, 7, 5, 6, 7, 5, 6]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8


@pytest.mark.slow
def test_dataclass_custom_drafter_gives_plain_greedy_output(llm: tokenleap.LLM) -> None:
    engine = llm.engine
    prompt = llm.chat_token_ids(
        [{"role": "user", "content": "Repeat twice: the quick brown fox jumps over the lazy dog."}]
    )
    params = SamplingParams(temperature=0, max_tokens=40)
    plain = engine.run(engine.add_request(prompt, params, speculative=False)).output_ids
    drafter = DataclassDrafter()
    spec = SpecConfig(method="custom", drafter=drafter, num_speculative_tokens=6, adaptive=False)
    req = engine.run(engine.add_request(prompt, params, speculative=spec))
    assert req.output_ids == plain
    assert drafter.proposed > 0 and req.metrics.spec.num_accepted_tokens > 0


def test_least_recently_used_drafters_are_let_go(tiny_model: Any, tokenizer: Any) -> None:
    """At most `max_drafters` drafters are kept; the engine's own is never let go, and a request
    still holding a drafter that was let go runs to its end."""
    from tokenleap.engine.engine import Engine

    registry = default_registry()
    default = SpecConfig(method="suffix", adaptive=False)
    engine = Engine(tiny_model, tokenizer, spec=default, drafter=registry.create("suffix", default), max_drafters=2,
                    drafter_factory=lambda spec: registry.create(spec.method, spec))
    configs = [SpecConfig(method="ngram", prompt_lookup_max=n, adaptive=False) for n in (2, 3, 4)]
    held = engine.add_request(
        [5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(temperature=0, max_tokens=6), speculative=configs[0]
    )
    first = engine.drafter_for(configs[0])
    engine.drafter_for(configs[1])
    engine.drafter_for(configs[0])  # used again: now the most recent
    engine.drafter_for(configs[2])  # lets configs[1]'s drafter go
    assert engine.drafter_for(configs[0]) is first
    assert engine.drafter_for(default) is engine.drafter
    assert len(engine._drafters) == 3  # two per-request drafters and the engine's own
    engine.drafter_for(configs[1])
    engine.drafter_for(configs[2])  # configs[0]'s drafter goes, while `held` still uses it
    assert engine.drafter_for(configs[0]) is not first
    engine.run(held)
    assert held.finished and held.drafter is first
