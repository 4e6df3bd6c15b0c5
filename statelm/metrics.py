"""Prometheus metrics of a serving process: request outcomes, tokens, latencies, engine and KV cache state."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from statelm.engine.client import EngineClient
from statelm.sessions.journal_store import JournalCounters
from statelm.sessions.storage import StorageCondition, StorageHealth

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60)


class ServingMetrics:
    """Counters and histograms fed by the API layer; gauges read from the engine's latest stats at scrape time."""

    def __init__(self, engine: EngineClient) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.http_responses = Counter(
            "statelm_http_responses", "HTTP responses by route and status code", ["route", "status"], registry=registry
        )
        self.finished_requests = Counter(
            "statelm_requests_finished", "Choices ended, by finish reason", ["finish_reason"], registry=registry
        )
        self.prompt_tokens = Counter("statelm_prompt_tokens", "Prompt tokens processed", registry=registry)
        self.cached_prompt_tokens = Counter(
            "statelm_prompt_tokens_cached", "Prompt tokens served by the prefix cache", registry=registry
        )
        self.generation_tokens = Counter("statelm_generation_tokens", "Tokens generated", registry=registry)
        self.time_to_first_token = Histogram(
            "statelm_time_to_first_token_seconds", "Request arrival to first token", buckets=LATENCY_BUCKETS,
            registry=registry,
        )  # fmt: skip
        self.inter_token_latency = Histogram(
            "statelm_inter_token_latency_seconds", "Gap between a stream's tokens", buckets=LATENCY_BUCKETS,
            registry=registry,
        )  # fmt: skip
        gauges = {
            "statelm_requests_running": ("Requests' sequences in the running batch", lambda: engine.stats().running),
            "statelm_requests_waiting": ("Requests' sequences waiting for a slot", lambda: engine.stats().waiting),
            "statelm_kv_refreshes": (
                "K/V refreshes of sessions or replies (no request's) running or waiting",
                lambda: engine.stats().refreshing,
            ),
            "statelm_kv_blocks_used": ("KV cache blocks held by sequences", lambda: engine.stats().kv_blocks_used),
            "statelm_kv_blocks_free": (
                "KV cache blocks free (cached or empty)",
                lambda: engine.stats().kv_blocks_free,
            ),
            "statelm_kv_blocks_pinned": (
                "KV cache blocks of prefixes pinned by cache_control (held or free)",
                lambda: engine.stats().kv_blocks_pinned,
            ),
            "statelm_prefix_cache_hit_rate": (
                "Share of queried prompt tokens found in the prefix cache",
                lambda: engine.stats().prefix_cache_hit_rate,
            ),
        }
        for name, (description, read) in gauges.items():
            Gauge(name, description, registry=registry).set_function(read)
        info = engine.info
        Gauge(
            "statelm_kv_cache_bytes_per_token",
            "Bytes a token's KV takes in the cache, all layers, K and V, by KV format (--kv-cache-dtype)",
            ["dtype"],
            registry=registry,
        ).labels(info.kv_format).set(info.kv_bytes_per_token)
        Gauge("statelm_kv_cache_capacity_tokens", "Tokens the KV cache holds in all", registry=registry).set(
            info.kv_capacity_tokens
        )
        self.journal = JournalCounters()
        registry.register(CounterCollector(lambda: self.journal, JOURNAL_FIGURES))
        registry.register(CounterCollector(lambda: engine.stats().cache_pins, PIN_FIGURES))
        registry.register(CounterCollector(engine.stats, DRAFT_FIGURES))

    def watch_storage(self, health: StorageHealth, owed: Callable[[], int]) -> None:
        """Export the state store's condition, room, owed writes, failures and refusals (owed: how many writes)."""
        self.registry.register(StorageCollector(health, owed))

    def record_finished(self, finish_reasons: list[str], prompt: int, cached: int, completion: int) -> None:
        """Account for one generation that has ended: how each of its choices ended, and its tokens."""
        for reason in finish_reasons:
            self.finished_requests.labels(reason).inc()
        self.prompt_tokens.inc(prompt)
        self.cached_prompt_tokens.inc(cached)
        self.generation_tokens.inc(completion)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class CounterCollector(Collector):
    """Counters read at scrape time from what `read` returns: one Prometheus counter per (name, help, attribute)."""

    def __init__(self, read: Callable[[], object], figures: list[tuple[str, str, str]]) -> None:
        self.read = read
        self.figures = figures

    def collect(self) -> Iterator[CounterMetricFamily]:
        """One counter per figure."""
        counters = self.read()
        for name, help_text, attribute in self.figures:
            yield CounterMetricFamily(name, help_text, getattr(counters, attribute))


class StorageCollector(Collector):
    """The state store as last seen (statelm.sessions.storage), read at scrape time without I/O."""

    def __init__(self, health: StorageHealth, owed: Callable[[], int]) -> None:
        self.health = health
        self.owed = owed

    def collect(self) -> Iterator[Metric]:
        """Condition (one gauge per condition, 1 for the current one), free bytes, owed writes, failures, refusals."""
        owed = self.owed()
        current = self.health.condition(owed)
        condition = GaugeMetricFamily(
            "statelm_storage_condition", "The state store's condition (1: the current one)", labels=["condition"]
        )
        for each in StorageCondition:
            condition.add_metric([each.value], float(each is current))
        yield condition
        free = self.health.space.free_bytes
        if free is not None:
            yield GaugeMetricFamily("statelm_storage_free_bytes", "Bytes free in the state store", value=free)
        yield GaugeMetricFamily(
            "statelm_storage_owed_writes", "Sessions whose journal must be rewritten or spill written", value=owed
        )
        for name, help_text, counts in (
            ("statelm_storage_failures", "Writes to the state store that failed, by cause", self.health.failures),
            (
                "statelm_storage_refusals",
                "Requests refused (507) because what they would keep could not be saved, by cause",
                self.health.refusals,
            ),
        ):
            family = CounterMetricFamily(name, help_text, labels=["cause"])
            for cause in StorageCondition:
                if cause is not StorageCondition.OK:
                    family.add_metric([cause.value], counts[cause])
            yield family


JOURNAL_FIGURES = [  # JournalCounters, updated by the journal's worker threads
    ("statelm_journal_appends", "Session journal records written", "appends"),
    ("statelm_journal_bytes", "Bytes of session journal records written", "bytes"),
    ("statelm_journal_recoveries", "Sessions brought up to date by their journals at start", "recoveries"),
    ("statelm_journal_failures", "Session journal writes that failed or were skipped", "failures"),
    ("statelm_journal_write_seconds", "Seconds session journal writes took (fsync included)", "write_seconds"),
    ("statelm_journal_slow_writes", "Session journal writes that took a second or more", "slow_writes"),
]
DRAFT_FIGURES = [  # EngineStats: drafts of prompt lookup (--speculative-tokens)
    ("statelm_draft_tokens", "Draft tokens (prompt lookup) verified in a step's forward", "draft_tokens"),
    ("statelm_draft_tokens_accepted", "Draft tokens that were the sequence's next tokens", "draft_tokens_accepted"),
]
PIN_FIGURES = [  # CachePinCounters, of the engine's latest stats
    ("statelm_cache_pins_created", "Prefixes pinned by cache_control", "created"),
    ("statelm_cache_pin_hits", "Pinned prefixes a request found whole in the cache", "hits"),
    ("statelm_cache_pins_expired", "Cache pins released at the end of their TTL", "expired"),
    (
        "statelm_cache_pins_released_under_pressure",
        "Cache pins released early because the KV pool had no unpinned free block left",
        "released_under_pressure",
    ),
    (
        "statelm_cache_pins_refused",
        "cache_control breakpoints cached without a pin because the key's or the pool's pin cap was reached",
        "refused",
    ),
]
