"""Fast pieces of tokenleap.ray without a cluster: the hub's bounded ring, affinity keys,
rendezvous hashing, per-replica metrics merging, settings validation, and drafters learning
from answers produced elsewhere."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

pytest.importorskip("ray")

from tokenleap.drafters.base import Drafter, DraftRequest  # noqa: E402
from tokenleap.drafters.ngram_cache import NgramCacheDrafter  # noqa: E402
from tokenleap.drafters.ngram_mod import NgramModDrafter  # noqa: E402
from tokenleap.drafters.suffix import SuffixDrafter  # noqa: E402
from tokenleap.errors import TokenleapError  # noqa: E402
from tokenleap.ray.config import RayServeConfig  # noqa: E402
from tokenleap.ray.metrics import merge_metrics  # noqa: E402
from tokenleap.ray.router import affinity_key, rendezvous  # noqa: E402
from tokenleap.ray.sharing import StatsHub  # noqa: E402
from tokenleap.sampling import SamplingParams  # noqa: E402


def test_hub_ring_skips_own_answers_and_reports_what_was_dropped() -> None:
    hub = StatsHub(capacity=3)
    for i in range(2):
        hub.publish("a", [1], [i])
    hub.publish("b", [2], [9])
    cursor, got, skipped = hub.since(0, "b")
    assert (cursor, got, skipped) == (3, [([1], [0]), ([1], [1])], 0)
    assert hub.since(cursor, "b") == (3, [], 0)
    for i in range(5):
        hub.publish("a", [3], [i])
    cursor2, got2, skipped2 = hub.since(cursor, "b")  # fell behind: 2 answers were dropped
    assert skipped2 == 2 and [o for _, o in got2] == [[2], [3], [4]] and cursor2 == 8
    assert hub.since(0, "b", limit=1)[1] == [([3], [2])]


def test_affinity_keys() -> None:
    chat = lambda msgs: json.dumps({"model": "m", "messages": msgs}).encode()  # noqa: E731
    first = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    k = affinity_key("/v1/chat/completions", {}, chat(first))
    assert k and k == affinity_key("/v1/chat/completions", {}, chat(first + [{"role": "assistant", "content": "a"}]))
    assert k != affinity_key("/v1/chat/completions", {}, chat([{"role": "user", "content": "other"}]))
    assert affinity_key("/v1/chat/completions", {"x-session-id": "abc"}, chat(first)) == "s:abc"
    assert affinity_key("/v1/completions", {}, b'{"prompt": "hello"}').startswith("p:")
    assert affinity_key("/v1/chat/completions", {}, b"{bad json") is None
    assert affinity_key("/v1/models", {}, b"") is None
    ids = ["r1", "r2", "r3"]
    picks = {rendezvous(f"k{i}", ids) for i in range(50)}
    assert picks == set(ids)  # spread over all replicas
    # removing a replica moves only the keys that were on it
    moved = [
        i
        for i in range(200)
        if rendezvous(f"k{i}", ids) != "r3" and rendezvous(f"k{i}", ids) != rendezvous(f"k{i}", ids[:2])
    ]
    assert moved == []


def test_merge_metrics_labels_each_replica() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from tokenleap.server.metrics import ServerMetrics

    a, b = ServerMetrics("m", lambda: 1, lambda: 0), ServerMetrics("m", lambda: 2, lambda: 0)
    a.prompt_tokens.inc(5)
    b.prompt_tokens.inc(7)
    text = merge_metrics({"r1": a.render().decode(), "r2": b.render().decode()}).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    got = {s.labels["replica"]: s.value for s in fams["tokenleap:prompt_tokens"].samples if s.name.endswith("_total")}
    assert got == {"r1": 5.0, "r2": 7.0}
    assert {s.labels["replica"]: s.value for s in fams["tokenleap:num_requests_running"].samples} == {
        "r1": 1.0,
        "r2": 2.0,
    }


def test_config_validation() -> None:
    assert RayServeConfig(replicas=2).autoscaling_config() is None
    auto = RayServeConfig(replicas=3, min_replicas=1, max_replicas=2).autoscaling_config()
    assert auto == {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 2, "target_ongoing_requests": 4.0}
    assert RayServeConfig(replicas=64).threads() == 1 and RayServeConfig(threads_per_replica=3).threads() == 3
    for bad in (
        {"replicas": 0},
        {"min_replicas": 3, "max_replicas": 2},
        {"target_ongoing_requests": 0},
        {"threads_per_replica": 0},
    ):
        with pytest.raises(TokenleapError):
            RayServeConfig(**bad)


def _draft_after(drafter: Drafter, context: list[int]) -> list[int]:
    drafter.begin(DraftRequest("q", context, SamplingParams(temperature=0), None))
    draft = drafter.propose("q", context, 8)
    drafter.end("q")
    return list(draft.tokens)


@pytest.mark.parametrize(
    "make", [SuffixDrafter, lambda: NgramModDrafter(size_n=2, pool_size=4096), lambda: NgramCacheDrafter(n_max=2)]
)
def test_drafters_learn_answers_produced_elsewhere(
    make: Callable[[], SuffixDrafter | NgramModDrafter | NgramCacheDrafter],
) -> None:
    answer = [10, 11, 12, 13, 14, 15, 16, 17]
    fresh, taught = make(), make()
    taught.learn([1, 2, 3], answer)
    context = [7, 10, 11, 12]
    assert _draft_after(fresh, context) == []
    assert _draft_after(taught, context)[:3] == [13, 14, 15]


def test_cli_replicas_errors_are_clean(capsys: pytest.CaptureFixture[str]) -> None:
    from tokenleap.cli import main

    assert main(["serve", "--replicas", "0"]) == 2
    assert "--replicas must be >= 1" in capsys.readouterr().err
    assert main(["serve", "--replicas", "2", "--threads", "2"]) == 2
    assert "--threads-per-replica" in capsys.readouterr().err
