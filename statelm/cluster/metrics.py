"""One /metrics for the cluster: every replica's metrics labelled `replica`, and the router's own."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector


class ReplicaMetrics(Collector):
    """Replicas' metrics (their Prometheus text, by replica name) as one set, each sample labelled by its replica."""

    def __init__(self, texts: Mapping[str, str]) -> None:
        self.texts = texts

    def collect(self) -> Iterator[Metric]:
        """Each family once, with the samples of every replica."""
        families: dict[str, Metric] = {}
        for replica, text in self.texts.items():
            for family in text_string_to_metric_families(text):
                merged = families.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type, family.unit)
                )
                for sample in family.samples:
                    labels = {**sample.labels, "replica": replica}
                    merged.add_sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)
        yield from families.values()


class RouterMetrics:
    """What the router counts: requests by replica and by why they went there, and replicas found gone."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.routed = Counter(
            "statelm_router_requests",
            "Requests routed, by replica and reason (session, prefix, least_loaded, round_robin, any)",
            ["replica", "reason"],
            registry=self.registry,
        )
        self.replicas_lost = Counter(
            "statelm_router_replicas_lost", "Replicas found dead or restarted", ["replica"], registry=self.registry
        )

    def render(self, replica_texts: Mapping[str, str]) -> bytes:
        """The Prometheus text of every replica's metrics and the router's."""
        replicas = CollectorRegistry()
        replicas.register(ReplicaMetrics(replica_texts))
        return generate_latest(replicas) + generate_latest(self.registry)
