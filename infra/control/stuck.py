"""Whether a run can still make progress, decided from its stages' counts on
``<run>.metrics`` (no I/O here: :class:`relax.infra.control.run_watch.RunWatch` feeds the rows and
reads the first error).

A counted reward (a name of ``advantage.rewards``: the aggregator waits for it) that fails
a rollout's row drops that rollout from training (``error_reward``). One that fails every
row leaves nothing to train: the trainer never steps while the rollout stage samples on.
Two rules end such a run, each a key of the recipe's ``stuck:`` section
(:class:`~relax.infra.recipe.sections.StuckConfig`):

* ``failed_groups``: the newest polls of the reward stage in a row where every row
  failed hold at least ``failed_groups x group_size`` rows (a poll with one row that did
  not fail, a value or an abstention, starts the count again). A reward that raises,
  returns ``"yes"`` or times out on every row.
* ``unscored_s``: the reward has scored no row for ``unscored_s`` seconds while groups
  sampled after its last scored row waited (a reward stuck inside one poll writes no
  count at all). When the groups were sampled comes from the rollout stages'
  cumulative ``groups_sampled``: an increase between two of an instance's rows means
  groups sampled in that interval; only an interval that begins after the reward's
  last scored poll counts (the metrics of a poll and of sampling are periodic, so an
  earlier one may hold groups the reward already scored).

The counts of one poll are its ``reward_rows`` and ``reward_errors`` rows, written in this
order by one ``MetricsWriter.add_many`` and sent in one message of the one-partition
metrics topic, so the first follows the second in the order read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from relax.infra.observe.report import ts_ms
from relax.infra.recipe.sections import StuckConfig
from relax.schemas import metric_names as M


@dataclass
class RewardTally:
    """One counted reward's counts, folded from its stage's per-poll metrics.

    Attributes:
        streak_rows / streak_failed: rows, and failed rows, of the newest polls in a row
            where every row failed (equal; kept apart for the line's ``failed/rows``).
        streak_since_ms: ``ts`` of the first of those polls (ms since epoch), None when
            there is none.
        last_scored_ms: ``ts`` of the newest poll with a row that did not fail, None
            before the first.
        waiting_since_ms: ``ts`` of the first rollout metrics row showing groups sampled
            after ``last_scored_ms``, None when none waits.
        rows / failed: every row and failed row reported (whole run).
    """

    streak_rows: int = 0
    streak_failed: int = 0
    streak_since_ms: int | None = None
    last_scored_ms: int | None = None
    waiting_since_ms: int | None = None
    rows: int = 0
    failed: int = 0

    def add_poll(self, ts_ms: int, rows: int, failed: int) -> None:
        """Count one poll of ``rows`` rows of which ``failed`` failed, reported at ``ts_ms``."""
        self.rows += rows
        self.failed += failed
        if rows == 0:
            return
        if failed < rows:
            self.streak_rows = self.streak_failed = 0
            self.streak_since_ms = self.waiting_since_ms = None
            self.last_scored_ms = ts_ms
            return
        if self.streak_since_ms is None:
            self.streak_since_ms = ts_ms
        self.streak_rows += rows
        self.streak_failed += failed

    def add_sampled(self, after_ms: int | None, ts_ms: int) -> None:
        """Groups were sampled after ``after_ms`` (None: some time before) and by ``ts_ms``."""
        if self.waiting_since_ms is not None:
            return
        if self.last_scored_ms is None or (after_ms is not None and after_ms >= self.last_scored_ms):
            self.waiting_since_ms = ts_ms


@dataclass(frozen=True)
class Stuck:
    """A counted reward that keeps the run from training.

    Attributes:
        reward: its name.
        rule: ``failed_groups`` or ``unscored_s`` (the :class:`StuckConfig` key).
        rows / failed: the rows, and failed rows, of its failing polls in a row.
        groups: ``rows`` in groups (``rows // group_size``).
        since_ms: when those polls began (``failed_groups``), or since when groups
            waited (``unscored_s``), ms since epoch.
        waited_s: ``unscored_s``: how long groups waited for a scored row (seconds).
    """

    reward: str
    rule: Literal["failed_groups", "unscored_s"]
    rows: int
    failed: int
    groups: int
    since_ms: int
    waited_s: float = 0.0

    def line(self, first_error: str | None, timeout_s: float | None = None) -> str:
        """The one line that ends the run, e.g. ``reward 'bad' failed 100% of its rows in
        the last 16 groups (64/64); first: ValueError: ...; the run cannot train``.
        ``first_error``: the first failed row's error of those polls (None: not read);
        ``timeout_s``: the reward's time limit per call, named when no row was written."""
        first = f"; first: {first_error}" if first_error else ""
        if self.rule == "failed_groups":
            last = "group" if self.groups == 1 else f"{self.groups} groups"
            return (f"reward {self.reward!r} failed 100% of its rows in the last {last} "
                    f"({self.failed}/{self.rows}){first}; the run cannot train")
        if self.rows:
            share = (f"{100 * self.failed // self.rows}% of the {self.rows} rows it wrote since "
                     f"failed ({self.failed}/{self.rows}){first}")
        else:
            limit = f" (a call may take timeout_s={timeout_s:g}s, then each row alone as " \
                    "long)" if timeout_s else ""
            share = f"it wrote no row since{limit}"
        return (f"reward {self.reward!r} scored no row for {self.waited_s:.0f}s while groups "
                f"sampled after its last scored row waited; {share}; the run cannot train")


class ProgressCheck:
    """Follows the counted rewards of a run through its metrics rows and says when one
    keeps the run from training (module docstring).

    Args:
        rewards: the counted reward names (stages ``reward.<name>``; not the rollout
            environment's reward, which has no stage).
        group_size: rollouts per group (rows per group).
        cfg: the thresholds.
        start_ms: when the watch began (ms since epoch): ``unscored_s`` counts no time
            before it (a resumed run reads the metrics of its earlier part again, whose
            groups may have waited while no driver ran).
    """

    def __init__(self, rewards: list[str], group_size: int, cfg: StuckConfig,
                 start_ms: int = 0):
        self.cfg, self.group_size, self.start_ms = cfg, group_size, start_ms
        self.tallies = {f"reward.{r}": RewardTally() for r in rewards}
        self._rows: dict[str, tuple[int, float]] = {}  # component -> its poll's (ts, rows)
        self._sampled: dict[str, tuple[int, float]] = {}  # rollout-<i> -> (ts, groups_sampled)

    def add(self, rows: list[dict]) -> None:
        """Fold metrics rows (``<run>.metrics`` as dicts: ``ts`` in ms or a datetime,
        ``component``, ``name``, ``value``), in the order read."""
        for r in rows:
            comp, name = r["component"], r["name"]
            ts = ts_ms(r["ts"])
            if comp in self.tallies and name == M.REWARD_ROWS:
                self._rows[comp] = (ts, r["value"])
            elif comp in self.tallies and name == M.REWARD_ERRORS and comp in self._rows:
                ts0, n = self._rows.pop(comp)
                self.tallies[comp].add_poll(ts0, int(n), int(r["value"]))
            elif comp.startswith("rollout-") and name == M.GROUPS_SAMPLED:
                prev = self._sampled.get(comp)
                self._sampled[comp] = (ts, r["value"])
                if r["value"] > 0 and (prev is None or r["value"] != prev[1]):
                    for t in self.tallies.values():
                        t.add_sampled(None if prev is None else prev[0], ts)

    def stuck(self, now_ms: int) -> Stuck | None:
        """The first counted reward (in the order given) that keeps the run from training
        at ``now_ms`` (ms since epoch), or None."""
        cfg = self.cfg
        for comp, t in self.tallies.items():
            name = comp.removeprefix("reward.")
            if cfg.failed_groups and t.streak_rows >= cfg.failed_groups * self.group_size:
                return Stuck(name, "failed_groups", t.streak_rows, t.streak_failed,
                             t.streak_rows // self.group_size, t.streak_since_ms)
            if t.waiting_since_ms is None or not cfg.unscored_s:
                continue
            waited_s = (now_ms - max(t.waiting_since_ms, self.start_ms)) / 1000
            if waited_s >= cfg.unscored_s:
                return Stuck(name, "unscored_s", t.streak_rows, t.streak_failed,
                             t.streak_rows // self.group_size, t.waiting_since_ms, waited_s)
        return None

