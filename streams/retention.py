"""Records a consumer never read because retention deleted them first: the count and the
warning (pure; :class:`relax.streams.consumer.BatchConsumer` asks the broker).

Kafka deletes a partition's oldest records by ``retention.ms`` / ``retention.bytes`` (or
an admin's DeleteRecords) and moves its log start offset up. A consumer whose next offset
(its consumer group's committed offset when it is handed the partition, or its position
while it reads) is below the log start cannot read the records in between: kafka-python
resets it to the log start (``auto_offset_reset=earliest``), which is right, and says so
only in an INFO line. relax counts them (:func:`lost_to_retention`), logs a WARNING
(:meth:`RetentionLoss.message`) and writes the count as the metric ``lost_to_retention``.
"""

from __future__ import annotations

from dataclasses import dataclass


def lost_to_retention(next_offset: int | None, log_start: int) -> int:
    """How many records below ``log_start`` a consumer at ``next_offset`` never read.

    Args:
        next_offset: the next offset the consumer was to read (a committed offset is
            one, public case C29); None when it had none (a consumer group that never
            committed starts where ``auto_offset_reset`` says: nothing of it was lost).
        log_start: the partition's log start offset (its first record still kept).

    Returns:
        ``log_start - next_offset`` when positive, else 0 (records count as Kafka
        offsets: one per message).
    """
    if next_offset is None:
        return 0
    return max(0, log_start - next_offset)


@dataclass(frozen=True)
class RetentionLoss:
    """Records of one partition deleted before a consumer read them.

    Attributes:
        topic, partition: where.
        next_offset: the offset the consumer was to read next.
        log_start: the partition's log start offset, where the consumer goes on.
        lost: records in between (``log_start - next_offset``).
        committed: ``next_offset`` is the consumer group's committed offset (found when
            the partition was handed over); False: the consumer's position while it read.
    """

    topic: str
    partition: int
    next_offset: int
    log_start: int
    lost: int
    committed: bool = True

    def message(self, stage: str, group: str | None) -> str:
        """The WARNING: names the stage, consumer group, topic, partition, committed
        offset (or position), log start and the count lost."""
        who = f"consumer group {group}" if group else "a reader without a consumer group"
        at = "committed offset" if self.committed else "position"
        return (f"{stage} ({who}): {self.lost} record(s) of {self.topic}[{self.partition}] "
                f"lost to retention: {at} {self.next_offset}, log start {self.log_start} "
                f"(offsets {self.next_offset}..{self.log_start - 1} were deleted before "
                f"they were read); reading on from {self.log_start}")
