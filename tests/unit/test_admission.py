"""Admission: a request's slot is taken before any work, its embedding bytes are reserved once
its headers are read, and both come back however the request ends."""

from __future__ import annotations

import pytest

from encdis.client.errors import InvalidArgument, ResourceExhausted
from encdis.llm_node.admission import Admission

MIB = 1 << 20


def test_a_request_beyond_the_embedding_bytes_in_flight_is_refused_until_they_are_released() -> None:
    admission = Admission(max_requests=8, max_embedding_bytes=100 * MIB)
    first = admission.take()
    first.reserve(60 * MIB)
    second = admission.take()
    with pytest.raises(ResourceExhausted) as refused:
        second.reserve(50 * MIB)
    assert refused.value.reason == "ADMISSION_EMBEDDING_BYTES"
    assert refused.value.metadata == {"limit": str(100 * MIB)}
    assert "62914560 embedding bytes in flight" in refused.value.message
    # Nothing of the refused request is counted against the budget; its slot is held until it ends.
    assert (admission.requests, admission.embedding_bytes) == (2, 60 * MIB)
    second.release()
    first.release()
    assert (admission.requests, admission.embedding_bytes) == (0, 0)
    with admission.take() as third:
        third.reserve(50 * MIB)  # the same request, once the first has ended, fits
        assert admission.embedding_bytes == 50 * MIB
    assert (admission.requests, admission.embedding_bytes) == (0, 0)


def test_a_request_that_could_never_fit_is_invalid_not_busy() -> None:
    admission = Admission(max_requests=8, max_embedding_bytes=100 * MIB)
    with admission.take() as slot:
        with pytest.raises(InvalidArgument) as refused:
            slot.reserve(100 * MIB + 1)
    assert refused.value.reason == "EMBEDDING_BYTES_OVER_LIMIT"
    assert (admission.requests, admission.embedding_bytes) == (0, 0)


def test_the_slot_is_taken_before_any_bytes_and_released_once() -> None:
    admission = Admission(max_requests=2, max_embedding_bytes=100 * MIB)
    a, b = admission.take(), admission.take()
    with pytest.raises(ResourceExhausted) as refused:
        admission.take()
    assert refused.value.reason == "ADMISSION_REQUESTS"
    a.reserve(10 * MIB)
    a.release()
    a.release()  # the door and the generation may both release it
    assert (admission.requests, admission.embedding_bytes) == (1, 0)
    with pytest.raises(RuntimeError):
        a.reserve(1)
    b.release()
    assert (admission.requests, admission.embedding_bytes) == (0, 0)


def test_the_node_exports_what_admission_holds_as_it_changes() -> None:
    from prometheus_client import CollectorRegistry

    from encdis.llm_node.metrics import LLMNodeMetrics

    registry = CollectorRegistry()
    admission = Admission(max_requests=4, max_embedding_bytes=1000)
    LLMNodeMetrics(registry).watch_admission(admission)

    def held() -> tuple[float | None, float | None]:
        return (registry.get_sample_value("encdis_admission_requests"),
                registry.get_sample_value("encdis_admission_embedding_bytes"))

    assert held() == (0, 0)
    with admission.take() as slot:
        slot.reserve(300)
        assert held() == (1, 300)
    assert held() == (0, 0)
