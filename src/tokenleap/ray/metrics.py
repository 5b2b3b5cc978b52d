"""/metrics of a replicated deployment: every replica's Prometheus series, labelled `replica`.

Each replica renders its own `ServerMetrics` (vLLM-named, `model_name`-labelled) and pushes the
text to the stats hub every sharing period; the ingress parses each text and re-renders all
series in one exposition, with a `replica` label added to every sample (one family per metric
name, as Prometheus requires). Sum over `replica` in PromQL for the deployment's totals.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


class _Merged:
    def __init__(self, texts: Mapping[str, str]) -> None:
        self.texts = texts

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for replica in sorted(self.texts):
            for fam in text_string_to_metric_families(self.texts[replica]):
                merged = families.get(fam.name)
                if merged is None:
                    merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for s in fam.samples:
                    merged.samples.append(
                        Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
                    )
        yield from families.values()


def merge_metrics(texts: Mapping[str, str]) -> bytes:
    """One Prometheus exposition of every replica's metrics, each sample labelled `replica`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(texts))
    return generate_latest(registry)
