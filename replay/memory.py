"""In-process replay store: the embedded default, hosted in one Ray actor."""

from __future__ import annotations

import itertools
from collections import OrderedDict

from replay.admission import admission_capacity, is_stale, staleness
from replay.base import Claim, LiveShare, PutResult, ReplayStats, ReplayStore, check_live_share
from replay.config import ReplayConfig
from replay.record import GroupRecord, as_record
from rollout.trajectory import Group


class InProcessReplayStore(ReplayStore):
    """Groups' records held in memory, oldest first. Not durable: a crash loses what is held.
    A record's length is what ``capacity_bytes`` counts, as the Redis store counts it."""

    def __init__(self, cfg: ReplayConfig, batch_groups: int) -> None:
        self.cfg = cfg
        self.batch_groups = batch_groups
        self._ready: OrderedDict[str, GroupRecord] = OrderedDict()
        self._live: OrderedDict[str, GroupRecord] = OrderedDict()
        """Live groups (unscheduled puts) waiting, oldest first."""
        self._live_ids: set[str] = set()
        """Ids of the live groups not yet committed, to requeue them where they came from."""
        self._claims: dict[str, list[GroupRecord]] = {}
        self._acked: dict[str, tuple[int, list[GroupRecord]]] = {}
        """Claim id -> (version it produced, its groups): retained until a checkpoint commits."""
        self._seen: set[str] = set()
        self._ids = itertools.count()
        self._stats = ReplayStats()
        self._scheduled_evicted = 0
        """Scheduled groups evicted untrained: the admission rule gives their places back."""

    # -- producers -------------------------------------------------------------------------
    def reserve(self, n: int) -> int:
        if n < 0:
            raise ValueError(f"reserve(n): n must be >= 0, got {n}")
        s = self._stats
        granted = min(
            n,
            admission_capacity(
                max_concurrent=self.cfg.max_concurrent_groups,
                running=s.running,
                eta=self.cfg.eta,
                version=s.version,
                batch_groups=self.batch_groups,
                accepted=s.accepted,
                evicted=self._scheduled_evicted,
            ),
        )
        s.running += granted
        return granted

    def release(self, n: int) -> None:
        self._stats.running = max(0, self._stats.running - n)

    def put(self, group: Group | GroupRecord, scheduled: bool = True) -> PutResult:
        s = self._stats
        record = as_record(group)
        if record.group_id in self._seen:
            s.count("refused", "duplicate")
            return PutResult("duplicate", f"group {record.group_id} was already accepted")
        nbytes = record.nbytes
        held = self._held()
        if held >= self.cfg.capacity_groups or s.bytes + nbytes > self.cfg.capacity_bytes:
            s.count("refused", "full")
            return PutResult("full", f"{held} groups / {s.bytes} bytes held")
        live_held = 0 if scheduled else self._live_held()
        if not scheduled and live_held >= self.cfg.live_capacity_groups:
            s.count("refused", "live_full")
            return PutResult("live_full", f"{live_held} live groups held")
        if scheduled:
            self.release(1)
        if is_stale(s.version, record.min_version, self.cfg.eta):
            s.count("refused", "stale")
            return PutResult("stale", f"group version {record.min_version} < {s.version - self.cfg.eta}")
        self._seen.add(record.group_id)
        (self._ready if scheduled else self._live)[record.group_id] = record
        if scheduled:
            s.accepted += 1
        else:
            self._live_ids.add(record.group_id)
            s.live_accepted += 1
        s.bytes += nbytes
        return PutResult("accepted")

    def live_room(self) -> int:
        return max(0, min(self.cfg.live_capacity_groups - self._live_held(),
                          self.cfg.capacity_groups - self._held()))

    def _held(self) -> int:
        """Groups held: ready (scheduled and live) plus claimed and not yet acknowledged."""
        return len(self._ready) + len(self._live) + sum(len(c) for c in self._claims.values())

    def _live_held(self) -> int:
        claimed = sum(r.group_id in self._live_ids for c in self._claims.values() for r in c)
        return len(self._live) + claimed

    # -- learner ---------------------------------------------------------------------------
    def _evict_stale(self) -> None:
        s = self._stats
        for queue in (self._ready, self._live):
            for gid, record in list(queue.items()):
                if is_stale(s.version, record.min_version, self.cfg.eta):
                    del queue[gid]
                    self._live_ids.discard(gid)
                    s.bytes -= record.nbytes
                    s.count("evicted", "stale")
                    self._scheduled_evicted += queue is self._ready

    def claim(self, num_groups: int, live: LiveShare | None = None) -> Claim | None:
        lo, hi = check_live_share(num_groups, live)
        self._evict_stale()
        n_live = min(hi, len(self._live))
        if n_live < lo or len(self._ready) < num_groups - n_live:
            return None
        taken = [self._live.popitem(last=False)[1] for _ in range(n_live)]
        taken += [self._ready.popitem(last=False)[1] for _ in range(num_groups - n_live)]
        claim_id = f"c{next(self._ids)}"
        self._claims[claim_id] = taken
        ages = [staleness(self._stats.version, r.min_version) for r in taken]
        for age in ages:
            self._stats.staleness_hist[age] = self._stats.staleness_hist.get(age, 0) + 1
        return Claim(claim_id, [r.payload for r in taken], ages)

    def ack(self, claim_id: str, new_version: int, commit: bool = False) -> None:
        taken = self._claims.pop(claim_id, None)
        if taken is None:
            raise KeyError(f"unknown or already acknowledged claim {claim_id!r}")
        self._acked[claim_id] = (new_version, taken)
        self._stats.bytes -= sum(r.nbytes for r in taken)
        self._stats.trained += len(taken)
        self._stats.live_trained += sum(r.group_id in self._live_ids for r in taken)
        self._stats.version = max(self._stats.version, new_version)
        if commit:
            self.commit(new_version)

    def commit(self, version: int) -> int:
        done = [cid for cid, (v, _) in self._acked.items() if v <= version]
        forgotten = [r.group_id for cid in done for r in self._acked.pop(cid)[1]]
        self._live_ids.difference_update(forgotten)
        return len(forgotten)

    def recover(self, checkpoint_version: int | None = None) -> int:
        """Requeue unacknowledged claims (and, with ``checkpoint_version``, the claims trained
        after it) ahead of newer groups, in claim order."""
        back = {cid: taken for cid, taken in self._claims.items()}
        self._claims.clear()
        if checkpoint_version is not None:
            self.commit(checkpoint_version)
            for cid, (_, taken) in self._acked.items():
                back[cid] = taken
                self._stats.bytes += sum(r.nbytes for r in taken)
                self._stats.trained -= len(taken)
                self._stats.live_trained -= sum(r.group_id in self._live_ids for r in taken)
            self._acked.clear()
            self._stats.version = checkpoint_version
        requeue = [item for cid in sorted(back, key=_claim_seq) for item in back[cid]]
        for record in reversed(requeue):
            queue = self._live if record.group_id in self._live_ids else self._ready
            queue[record.group_id] = record
            queue.move_to_end(record.group_id, last=False)
        return len(requeue)

    def stats(self) -> ReplayStats:
        s = self._stats
        s.ready = len(self._ready) + len(self._live)
        s.live_ready = len(self._live)
        s.live_held = self._live_held()
        s.claimed = sum(len(c) for c in self._claims.values())
        s.retained = sum(len(taken) for _, taken in self._acked.values())
        return ReplayStats(**{**s.__dict__, "refused": dict(s.refused), "evicted": dict(s.evicted),
                              "staleness_hist": dict(s.staleness_hist)})


def _claim_seq(claim_id: str) -> int:
    return int(claim_id[1:])
