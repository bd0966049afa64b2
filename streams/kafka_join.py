"""Keep a consumer-group join that finished between two polls (a kafka-python 3.0 fix).

kafka-python 3.0 runs JoinGroup -> SyncGroup as a task on its I/O thread and awaits it
inside ``KafkaConsumer.poll``. A broker holds a JoinGroup until every member has
rejoined (Kafka: up to the rebalance timeout), so
with polls shorter than that the task often completes while no poll is waiting. The
next poll then finds the task done, schedules a *new* JoinGroup and drops the finished
task's assignment (``BaseCoordinator.join_group_async``: ``if self._join_task is None or
self._join_task.is_done``). Every member's rejoin starts another rebalance, so two
members that poll in turn can livelock: the group never settles and one member keeps
every partition (measured: 13 of 19 two-member rebalances did not settle in
40 s; the CI failure of ``test_finishing_deliveries_of_a_revoked_partition_is_harmless``).

:func:`apply` wraps ``join_group_async`` so that a task which finished successfully is
completed the way the library completes one it awaited (state STABLE, heartbeat on,
``_on_join_complete``); every other case goes to the library unchanged. A failed task
still goes to the library, which retries it.

It also makes a join task in flight or finished a reason to rejoin
(``BaseCoordinator.need_rejoin``), so the next poll collects it. Without that, a
leader's rejoin caused by new partition metadata is lost when it finishes between two
polls: the leader's assignment stores the metadata it used (``_assignment_snapshot``),
so ``ConsumerCoordinator.need_rejoin`` turns False, no poll awaits the task again, and
the member keeps no partitions for good (measured: the restarted trainer of
``test_seeded_chaos_run[11]`` waited 300 s for data with every partition of
``train_samples`` unowned; ``test_a_leader_join_started_by_new_metadata_is_kept``).

Applied by :func:`relax.streams.client.consumer_kwargs`, so every relax consumer has
it; only kafka-python 3.0.x is patched (``pyproject.toml`` pins ``<3.1``).

When to remove it: a kafka-python release whose ``join_group_async`` completes a
finished join task instead of scheduling a new one (its body no longer reads ``if
self._join_task is None or self._join_task.is_done`` without checking the task's
result), and whose ``need_rejoin`` counts a join in flight. To tell: raise the pin, turn
:func:`apply` into a no-op, and run ``tests/streams/test_kafka_join.py`` ten times: its
three tests fail within a few runs while the library still drops a finished join.
"""

from __future__ import annotations

_applied = False


def apply() -> None:
    """Patch ``kafka.coordinator.base.BaseCoordinator.join_group_async`` and
    ``need_rejoin`` once per process (idempotent; a no-op on kafka-python versions
    other than 3.0.x)."""
    global _applied
    if _applied:
        return
    import kafka
    from kafka.coordinator.base import BaseCoordinator, MemberState

    _applied = True
    if not kafka.__version__.startswith("3.0."):
        return
    original = BaseCoordinator.join_group_async

    async def join_group_async(self, timeout_ms=None):
        task = self._join_task
        if task is None or not task.is_done or not task.succeeded():
            return await original(self, timeout_ms)
        self._join_task = None
        with self._lock:
            self.rejoining = False
            self.rejoin_needed = False
            self.state = MemberState.STABLE
            self._enable_heartbeat()
        await self._on_join_complete_async(self._generation.generation_id,
                                           self._generation.member_id,
                                           self._generation.protocol, task.value)
        return True

    def need_rejoin(self):
        return self.rejoin_needed or self._join_task is not None

    BaseCoordinator.join_group_async = join_group_async
    BaseCoordinator.need_rejoin = need_rejoin
