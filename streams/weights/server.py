"""A weight subscriber for an inference server that receives the broadcast itself:
:class:`ServerSubscriber`.

An SGLang server (:class:`relax.consumers.engines.sglang.SGLangEngine`) joins a broadcast
group over HTTP (``/init_weights_update_group``, forming its group with
``init_custom_process_group``, whose store keys relax's groups use:
:func:`relax.streams.weights.rendezvous.group_store`) and receives each bucket into its
own model (``/update_weights_from_distributed``). Its rollout instance registers it in
the publisher's membership under one member id per TP rank (``<id>``, ``<id>/tp1``, ...,
appended at once so their ranks are consecutive) and, for every version announced to a
group it belongs to, asks it to join (on a new group) and to receive. The bytes never
reach the rollout process: no checksum is verified there, no checkpoint is loaded (SGLang
loads those only from a model folder, ``/update_weights_from_disk``), no same-host file
is read. A late-joining server samples with the weights it started with until the next
broadcast.
"""

from __future__ import annotations

import logging
import time

from relax.streams.client import BusConfig
from relax.streams.follow import Follower
from relax.streams.weights.rendezvous import MEMBERSHIP_KEY, parse_rendezvous
from relax.streams.weights.subscriber import WeightSubscriber

log = logging.getLogger(__name__)


class ServerSubscriber(WeightSubscriber):
    """The weight channel's member for a server that receives the broadcast itself.

    Args:
        cfg: bus settings.
        run: run name.
        member_id: the server's first member id (rank ``i + 1`` of a group whose members
            list it at place ``i``; its other TP ranks follow).
        target: the server's client: ``tp_size`` (int >= 1),
            ``init_weights_update_group(master_address, master_port, rank_offset,
            world_size, group_name, backend=...)`` and ``receive_weights(announcement)``
            (returns once the server holds every bucket), both raising ``RuntimeError``
            when the server answers an error.
        rendezvous, join_timeout_s, follower: as for :class:`WeightSubscriber`.
    """

    reads_shm = False

    def __init__(self, cfg: BusConfig, run: str, *, member_id: str, target,
                 rendezvous: str | None = None, join_timeout_s: float = 60.0,
                 follower: Follower | None = None):
        super().__init__(cfg, run, member_id=member_id, target=target, catch_up=False,
                         rendezvous=rendezvous, join_timeout_s=join_timeout_s,
                         follower=follower)
        self._ids = [member_id] + [f"{member_id}/tp{r}" for r in range(1, target.tp_size)]

    def _receive(self, row: dict, group: str, members: list[str]) -> None:
        """On a new group, mark every id ready and ask the server to join as ranks
        ``i + 1 ..`` of ``len(members) + 1`` over the announced rendezvous and transport;
        then have it receive every bucket while the publisher broadcasts. A request that
        fails leaves the group like a failed broadcast (the next version forms a new one).

        Raises:
            ValueError: its ids are not consecutive among the members.
        """
        t0 = time.perf_counter()
        first = members.index(self.member_id)
        if members[first:first + len(self._ids)] != self._ids:
            raise ValueError(f"{self.member_id}: its TP ranks {self._ids} are not "
                             f"consecutive among {group}'s members {members}")
        try:
            if group != self._group:
                for m in self._ids:
                    self._store.set(f"{group}/ready/{m}", "1")
                host, port = parse_rendezvous(row["rendezvous"])
                self.target.init_weights_update_group(
                    host, port, first + 1, len(members) + 1, group, backend=row["transport"])
                self._group = group
            self.target.receive_weights(row)
        except RuntimeError as e:  # the server answered an error
            self._group = None
            self.stats.skipped += 1
            log.warning("%s: the server did not receive v%d (%s); waiting for the next "
                        "version", self.member_id, row["policy_version"], e)
            self._store.append(MEMBERSHIP_KEY, self._log_lines("+"))
            return
        self.stats.received += 1
        self.stats.bytes += row["total_bytes"]
        self.stats.receive_s += time.perf_counter() - t0
        self._deliver(row, "broadcast", staged=True)
