"""What a stage's log keeps of the Kafka client's own records (``infra/recipe/specs.py``)."""

from __future__ import annotations

import logging

from kafka.errors import Cancelled, KafkaConnectionError

from relax.infra.control.runners import not_a_cancelled_refresh


def _record(msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord("kafka.cluster", logging.ERROR, __file__, 1, msg, args, None)


def test_only_the_cancelled_start_up_refresh_is_dropped():
    assert not not_a_cancelled_refresh(_record("Metadata refresh: failed %s", Cancelled()))
    assert not_a_cancelled_refresh(_record("Metadata refresh: failed %s",
                                           KafkaConnectionError("broker down")))
    assert not_a_cancelled_refresh(_record("Metadata refresh loop error: %s", Cancelled()))
    assert not_a_cancelled_refresh(_record("plain message"))
