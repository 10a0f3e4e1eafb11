"""The connection budgets on ``/metrics`` (server/metrics.py ``admission_gauges``): every
counter of ``Admission.counters`` as one ``changefeed_connections_<name>`` family, with help."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from changefeed.server.admission import COUNTER_HELP, Admission, Shares
from changefeed.server.metrics import admission_gauges


class _Fake:
    last_request_s = 0.0

    def close(self) -> None:
        pass

    def idle_evictable(self) -> bool:
        return True


class _Budgets(Collector):
    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    def collect(self):  # type: ignore[no-untyped-def]
        return admission_gauges(self.admission)


def test_every_budget_counter_is_a_metric_family() -> None:
    admission = Admission(Shares.of(10, 2, 1, 3), clock=lambda: 100.0, idle_min_s=0.0)
    conns = [_Fake() for _ in range(4)]
    for conn in conns:
        admission.arrived(conn)  # the third and fourth close the oldest two
    admission.authenticated_as(conns[2], "Administrator", admin=True)
    registry = CollectorRegistry()
    registry.register(_Budgets(admission))
    text = generate_latest(registry).decode()
    scraped = {
        family.name: (family.documentation, family.samples[0].value)
        for family in text_string_to_metric_families(text)
    }
    assert set(COUNTER_HELP) == set(admission.counters())
    for key, value in admission.counters().items():
        help_text, scraped_value = scraped[f"changefeed_connections_{key}"]
        assert scraped_value == value and help_text == COUNTER_HELP[key], key
    assert scraped["changefeed_connections_authenticating"][1] == 1
    assert scraped["changefeed_connections_admin"][1] == 1
    assert scraped["changefeed_connections_closed_authenticating_total"][1] == 2
