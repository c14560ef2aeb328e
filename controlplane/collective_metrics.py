"""Metrics fed by the batches the controller ingests: steps, collectives, MoE load, SDC checks.

``CollectiveMetrics.observe`` is an ``AgentServicer`` batch observer: it runs on the
gRPC loop thread, so it only queues the batch (O(1)); ``drain`` (the metrics refresher's
thread, ``job_metrics.MetricsRefresher``) folds the queued batches into the metrics and
publishes the gauges, O(rows) per drain plus O(ranks + experts). Collectives are read
column by column from the batches' ``CollectiveColumns`` blocks with numpy, all the
drain's blocks in one pass (``bench/metrics.py``: ~0.25 us per collective, a quarter of
what ``ingest.prepare`` spends on it). At most
``MAX_PENDING_EVENTS`` events wait; batches beyond that are skipped and counted in
``fleet_exporter_skipped_batches_total`` (metrics are a sample then, the store keeps all).

Only this controller's job is followed, and for the gauges only its newest attempt (a
new attempt resets them: ``start_attempt``). Histograms take every row of the job.

- ``fleet_step_duration_seconds{job_id}``: every rank's ``step_time_s``.
- ``fleet_tokens_per_second{job_id}``: sum over ranks of their newest step's tokens/s;
  ``fleet_loss{job_id}``: mean over ranks of their newest step's loss.
- ``fleet_collective_duration_seconds{job_id,op,timing}``: each completed collective's
  measured duration (``duration_ns``), else enter -> exit; ``timing`` is ``measured``, or
  ``poll_upper_bound`` when the exit is the
  reporter's poll time (gloo's native entries, ``exit_estimated``): an upper bound,
  never mixed with measured ones.
- ``fleet_collective_arrival_lag_seconds{job_id,rank}``: per rank, the mean over its last
  ``LAG_WINDOW`` completed matches of how late it entered a collective behind the first
  member to enter it. A match is one (group, seq) once every member (``group_size``) has
  entered it (``ArrivalMatcher``), sampled: every ``ARRIVAL_SAMPLE``-th seq of each group
  (seq divisible by it); point-to-point groups are left out (their sequence numbers count
  per pair). Enter times come from each rank's host clock: skew between
  hosts shows as lag. Jobs that send collective fronts instead of raw collectives (more
  ranks than ``agent.raw_ingest_max_ranks``) get no arrival lag: a front is a rank's
  newest position, so the members' enters of one collective are rarely all seen.
- ``fleet_collective_busbw_bytes_per_second{job_id,group,op}``: the median bus bandwidth
  (nccl-tests' definition) of the group's recent collectives of that op measured on every
  member; ``fleet_collective_utilization_ratio{job_id,group,op}``: that over the slowest
  link the group crosses (only with a ``topology`` that knows it and the attempt's
  placement, ``set_nodes``; a busbw above the declared link is logged and shown as 1);
  ``fleet_collective_arrival_skew_seconds{job_id,group}``: the median first-to-last enter
  of its recent collectives. Matched by ``collective_perf.CommTracker`` over the same
  sample as the arrival lag, its newest ``LAG_WINDOW`` samples per group.
- ``fleet_moe_expert_token_share_ratio{job_id,layer,expert}``: the expert's share of its
  layer's routed tokens, summed over ranks, in the newest step every rank of the attempt
  has reported (of the newest ``MOE_STEPS``; until one is complete the gauges keep what
  they showed); ``fleet_moe_layer_{min,max}_share_ratio{job_id,layer}`` the smallest and
  largest of those shares.
- ``fleet_sdc_checks_total{job_id,kind,result}``: SDC check rows, ``result`` ok|mismatch.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge

from fleet.controlplane.collective_perf import CommTracker, Topology, median_busbw, median_skew_s
from fleet.controlplane.metrics import BulkHistogram
from fleet.controlplane.store.ingest import SDC_KINDS, PreparedBatch
from fleet.controlplane.wavefront import intern
from fleet.proto import events_pb2
from fleet.proto.flight_record import P2P_SUFFIX
from fleet.proto.vocab import canonical_op

log = logging.getLogger(__name__)

#: Batches of at most this many events in all wait for ``drain``; later ones are skipped.
MAX_PENDING_EVENTS = 400_000
#: Completed matches per rank the arrival lag is the mean of.
LAG_WINDOW = 32
#: (group, seq) matches still missing members kept at most (the oldest go first: a rank
#: that died never completes them).
MAX_OPEN_MATCHES = 8192
#: Arrival lag is matched on every this-many-th sequence number of each group (a sample:
#: matching is the one Python step per row of the fold; the lag is a mean anyway).
ARRIVAL_SAMPLE = 8
#: Distinct strings of collective blocks remembered (ops, groups, sizes, ...); past it the
#: table starts over (codes already given stay valid).
MAX_NAMES = 4096
#: Newest steps whose MoE expert loads are summed while their ranks' reports come in.
MOE_STEPS = 4
STEP_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
COLLECTIVE_BUCKETS_S = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)


# -- pure -----------------------------------------------------------------------------------

def arrival_lags(enter_ns: Mapping[int, int]) -> dict[int, float]:
    """rank -> seconds it entered one collective after the first member did (0 for it)."""
    if not enter_ns:
        return {}
    first = min(enter_ns.values())
    return {rank: (t - first) / 1e9 for rank, t in enter_ns.items()}


def expert_shares(tokens: Sequence[float]) -> list[float]:
    """Each expert's share (0-1) of a layer's routed tokens; all 0 when none were routed."""
    total = float(sum(tokens))
    return [t / total for t in tokens] if total > 0 else [0.0] * len(tokens)


class ArrivalMatcher:
    """Matches one attempt's collectives across the members of each group by (group, seq)
    and keeps each rank's last ``window`` arrival lags (not thread-safe: one owner)."""

    def __init__(self, window: int = LAG_WINDOW, max_open: int = MAX_OPEN_MATCHES) -> None:
        self._window = window
        self._max_open = max_open
        self._open: dict[tuple[str, int], tuple[int, dict[int, int]]] = {}
        # matches already completed: a completion row arriving after its start must not
        # open the match again (bounded like the open ones, oldest first)
        self._closed: dict[tuple[str, int], None] = {}
        self._lags: dict[int, collections.deque[float]] = {}
        self.matched = 0

    def add(self, group: str, seq: int, group_size: int, rank: int, enter_ns: int) -> None:
        """One rank's entry into collective ``seq`` of ``group`` (a rank's second row of the
        same collective, e.g. its completion, changes nothing)."""
        self.add_members(group, seq, group_size, (rank,), (enter_ns,))

    def add_members(self, group: str, seq: int, group_size: int, ranks: Sequence[int],
                    enter_ns: Sequence[int]) -> None:
        """Several ranks' entries into collective ``seq`` of ``group`` (``enter_ns[i]`` is
        ``ranks[i]``'s): one call per collective, not per rank."""
        key = (group, seq)
        if group_size < 2 or key in self._closed or group.endswith(P2P_SUFFIX):
            return
        entry = self._open.get(key)
        if entry is None:
            if len(self._open) >= self._max_open:
                del self._open[next(iter(self._open))]
            entry = self._open[key] = (group_size, {})
        members = entry[1]
        for rank, t in zip(ranks, enter_ns):
            members.setdefault(rank, t)
        if len(members) < group_size:
            return
        del self._open[key]
        self._closed[key] = None
        if len(self._closed) > self._max_open:
            del self._closed[next(iter(self._closed))]
        self.matched += 1
        for r, lag in arrival_lags(members).items():
            window = self._lags.get(r)
            if window is None:
                window = self._lags[r] = collections.deque(maxlen=self._window)
            window.append(lag)

    def mean_lags(self) -> dict[int, float]:
        """rank -> mean arrival lag over its last completed matches (seconds)."""
        return {r: sum(w) / len(w) for r, w in self._lags.items() if w}


# -- the metrics ----------------------------------------------------------------------------

class CollectiveMetrics:
    """The batch-fed metrics of one job. ``observe`` from any thread; ``drain`` and
    ``start_attempt`` from one (the refresher's)."""

    def __init__(self, registry: CollectorRegistry, job_id: str, *, arrival_sample: int = ARRIVAL_SAMPLE,
                 topology: Topology | None = None) -> None:
        """``arrival_sample``: match every this-many-th collective of each group for arrival
        lag and bandwidth; ``topology``: link bandwidths for the utilization ratio."""
        self.job_id = job_id
        self._sample = arrival_sample
        self._topology = topology
        self._placement: tuple[int, tuple[str, ...]] = (0, ())  # (attempt, node of each rank)
        r = registry
        self.step_s = BulkHistogram("fleet_step_duration_seconds", "Step time of every rank's steps (step_time_s).",
                                    ["job_id"], STEP_BUCKETS_S, r)
        self.tokens = Gauge("fleet_tokens_per_second", "Tokens per second: sum over ranks of their newest step's.",
                            ["job_id"], registry=r)
        self.loss = Gauge("fleet_loss", "Mean over ranks of their newest step's loss.", ["job_id"], registry=r)
        self.collective_s = BulkHistogram(
            "fleet_collective_duration_seconds",
            "Enter to exit of each completed collective, by op; timing=measured, or poll_upper_bound when the "
            "exit is the flight recorder's poll time (an upper bound).", ["job_id", "op", "timing"],
            COLLECTIVE_BUCKETS_S, r)
        self.lag = Gauge("fleet_collective_arrival_lag_seconds",
                         "How late the rank entered its recent collectives behind each one's first member "
                         "(mean over its last completed matches).", ["job_id", "rank"], registry=r)
        self.busbw = Gauge("fleet_collective_busbw_bytes_per_second",
                           "Median bus bandwidth (nccl-tests) of the group's recent collectives of the op "
                           "measured on every member.", ["job_id", "group", "op"], registry=r)
        self.utilization = Gauge("fleet_collective_utilization_ratio",
                                 "The group's median bus bandwidth over the slowest link it crosses (topology).",
                                 ["job_id", "group", "op"], registry=r)
        self.skew = Gauge("fleet_collective_arrival_skew_seconds",
                          "Median first-to-last member enter of the group's recent collectives.",
                          ["job_id", "group"], registry=r)
        self.share = Gauge("fleet_moe_expert_token_share_ratio",
                           "The expert's share of its MoE layer's routed tokens in the newest step (all ranks).",
                           ["job_id", "layer", "expert"], registry=r)
        self.min_share = Gauge("fleet_moe_layer_min_share_ratio", "The smallest expert share of the MoE layer.",
                               ["job_id", "layer"], registry=r)
        self.max_share = Gauge("fleet_moe_layer_max_share_ratio", "The largest expert share of the MoE layer.",
                               ["job_id", "layer"], registry=r)
        self.sdc = Counter("fleet_sdc_checks", "SDC check results (fingerprint, trigger, replay, verdict, gemm).",
                           ["job_id", "kind", "result"], registry=r)
        self.skipped = Counter("fleet_exporter_skipped_batches",
                               "Ingested batches the metrics skipped: too many were waiting to be folded in.",
                               registry=r)
        for kind in sorted(SDC_KINDS):
            for result in ("ok", "mismatch"):
                self.sdc.labels(job_id, kind, result)
        self._inbox: collections.deque[PreparedBatch] = collections.deque()
        self._inbox_lock = threading.Lock()
        self._pending_events = 0
        self._attempt = 0
        # names seen in collective blocks, as small codes (each block has its own string table)
        self._op_codes: dict[str, int] = {}
        self._op_names: list[str] = []
        self._group_codes: dict[str, int] = {}
        self._group_names: list[str] = []
        self._strings: dict[str, tuple[int, int, int, int]] = {}  # a block string -> its codes
        self._reset()

    def _reset(self) -> None:
        self._newest: dict[int, tuple[int, float, float]] = {}   # rank -> (step, tokens/s, loss)
        self._matcher = ArrivalMatcher()
        self._lag_ranks: set[int] = set()
        # the newest MOE_STEPS steps' routed tokens: step -> (layer -> tokens per expert, ranks in it)
        self._moe: dict[int, tuple[dict[int, np.ndarray], set[int]]] = {}
        self._moe_series: set[tuple[str, str]] = set()            # (layer, expert) published
        self._perf = CommTracker(self.job_id, self._attempt, LAG_WINDOW)
        self._perf_published = 0                                   # _perf.completed when published
        self._rate_series: set[tuple[str, str]] = set()            # (group, op) published
        self._util_series: set[tuple[str, str]] = set()
        self._skew_series: set[str] = set()
        self._over_link: set[tuple[str, str]] = set()              # (group, op) logged above its link

    def observe(self, node_name: str, batch: PreparedBatch) -> None:
        """The ``AgentServicer`` observer: queue ``batch`` for ``drain`` (O(1))."""
        if not (batch.steps or batch.collectives or batch.sdc):
            return
        with self._inbox_lock:
            if self._pending_events + batch.events > MAX_PENDING_EVENTS and self._inbox:
                self.skipped.inc()
                return
            self._pending_events += batch.events
            self._inbox.append(batch)

    def start_attempt(self, attempt: int) -> None:
        """The job's newest attempt is ``attempt``: forget an older one's gauges."""
        if attempt > self._attempt:
            self._new_attempt(attempt)

    def _new_attempt(self, attempt: int) -> None:
        self._attempt = attempt
        for rank in self._lag_ranks:
            self.lag.remove(self.job_id, str(rank))
        for layer, expert in self._moe_series:
            self.share.remove(self.job_id, layer, expert)
        for layer in {layer for layer, _ in self._moe_series}:
            self.min_share.remove(self.job_id, layer)
            self.max_share.remove(self.job_id, layer)
        for group, op in self._rate_series:
            self.busbw.remove(self.job_id, group, op)
        for group, op in self._util_series:
            self.utilization.remove(self.job_id, group, op)
        for group in self._skew_series:
            self.skew.remove(self.job_id, group)
        self._reset()
        self.tokens.labels(self.job_id).set(0.0)  # a new attempt has processed nothing yet

    def set_nodes(self, attempt: int, nodes_by_rank: Sequence[str], topology: Topology | None = None) -> None:
        """Attempt ``attempt`` runs rank r on ``nodes_by_rank[r]`` (for the utilization
        ratio; any thread); ``topology``, when given, replaces the one it was built with."""
        if topology is not None:
            self._topology = topology
        self._placement = (attempt, tuple(nodes_by_rank))

    def drain(self) -> int:
        """Fold every queued batch in and publish the gauges; the number of batches folded."""
        with self._inbox_lock:
            batches, self._inbox = list(self._inbox), collections.deque()
            self._pending_events = 0
        blocks = []
        for batch in batches:
            if batch.steps:
                self._steps(batch)
            blocks += batch.collective_blocks
            if batch.sdc:
                self._sdc(batch.sdc)
        if blocks:
            self._collectives(blocks)
        if batches:
            self._publish()
        return len(batches)

    def _steps(self, batch: PreparedBatch) -> None:
        job, durations = self.job_id, []
        for s in batch.step_rows():
            if s.job_id != job:
                continue
            durations.append(s.step_time_s)
            if s.attempt > self._attempt:
                self._new_attempt(s.attempt)
            if s.attempt != self._attempt:
                continue
            have = self._newest.get(s.rank)
            if have is None or s.step >= have[0]:
                self._newest[s.rank] = (s.step, s.tokens_per_s, s.loss)
            if s.expert_load != "[]":
                self._expert_load(s.rank, s.step, s.expert_load)
        self.step_s.observe_many((job,), durations)

    def _expert_load(self, rank: int, step: int, expert_load: str) -> None:
        entry = self._moe.get(step)
        if entry is None:
            if len(self._moe) >= MOE_STEPS and step < min(self._moe):
                return  # older than every step kept
            entry = self._moe[step] = ({}, set())
            if len(self._moe) > MOE_STEPS:
                del self._moe[min(self._moe)]
        sums, ranks = entry
        if rank in ranks:
            return  # a batch sent again
        ranks.add(rank)
        for layer in json.loads(expert_load):
            tokens = np.asarray(layer["tokens_per_expert"], dtype=np.float64)
            have = sums.get(layer["layer"])
            if have is None or len(have) != len(tokens):
                sums[layer["layer"]] = tokens
            else:
                have += tokens

    def _collectives(self, blocks: list[events_pb2.CollectiveColumns]) -> None:
        """Fold the drained batches' collectives in, all at once: numpy reads each block's
        columns (a few ns a value; string columns through a per-block table), then one pass
        over them all, so the per-call overhead is paid per drain, not per block."""
        cols = self._columns(blocks)
        if cols is None:
            return
        attempt, enter, exit_ns, done, estimated, op, group, seq, size, rank, dur = cols
        newest = int(attempt.max())
        if newest > self._attempt:
            self._new_attempt(newest)
        self._rate(blocks)
        done &= exit_ns > 0
        if done.any():
            # the measured duration where there is one (a wrapper's window, NCCL's device time)
            seconds = np.where(dur[done] > 0, dur[done], np.maximum(exit_ns[done] - enter[done], 0)) / 1e9
            ops, est = op[done], estimated[done]
            any_estimated = bool(est.any())
            for code in np.unique(ops).tolist():
                of_op = ops == code
                name = self._op_names[code]
                for timing, picked in (("measured", of_op & ~est if any_estimated else of_op),
                                       ("poll_upper_bound", of_op & est if any_estimated else None)):
                    if picked is not None and picked.any():
                        self.collective_s.observe_many((self.job_id, name, timing), seconds[picked])
        # arrival lag from every ARRIVAL_SAMPLE-th collective of each group, one matcher call
        # per collective: the sampled rows sorted by (group, seq), cut where that changes
        picked = np.flatnonzero((seq % self._sample == 0) & (attempt == self._attempt) & (size >= 2))
        if not len(picked):
            return
        order = picked[np.lexsort((seq[picked], group[picked]))]
        g, q = group[order], seq[order]
        cuts = (np.flatnonzero((np.diff(g) != 0) | (np.diff(q) != 0)) + 1).tolist()
        ranks, enters = rank[order].tolist(), enter[order].tolist()
        g_list, q_list, sizes = g.tolist(), q.tolist(), size[order].tolist()
        add, names = self._matcher.add_members, self._group_names
        for a, b in zip([0, *cuts], [*cuts, len(order)]):
            add(names[g_list[a]], q_list[a], sizes[a], ranks[a:b], enters[a:b])

    def _rate(self, blocks: list[events_pb2.CollectiveColumns]) -> None:
        """Feed ``_perf`` the attempt's completed collectives of the arrival lag's sample
        (one Python call per row picked)."""
        add, job, attempt, codes, ops = self._perf.add_entry, self.job_id, self._attempt, self._string_codes, \
            self._op_names
        for b in blocks:
            seq = np.asarray(b.seq, dtype=np.int64)
            picked = np.flatnonzero((seq % self._sample == 0) & (np.asarray(b.attempt, dtype=np.int64) == attempt)
                                    & (np.asarray(b.group_size, dtype=np.int64) >= 2))
            s, dur, timing = b.strings, b.duration_ns, b.timing
            for i in picked.tolist():
                if s[b.job_id[i]] != job or s[b.state[i]] != "completed":
                    continue
                add(s[b.group[i]], b.seq[i], b.group_size[i], b.rank[i], ops[codes(s[b.op[i]])[2]],
                    s[b.input_sizes[i]], s[b.input_dtypes[i]], s[b.output_sizes[i]], s[b.output_dtypes[i]],
                    b.enter_ns[i], dur[i] if dur else 0, timing[i] if timing else 0)

    def _columns(self, blocks: list[events_pb2.CollectiveColumns]) -> tuple[np.ndarray, ...] | None:
        """This job's rows of ``blocks`` as arrays: attempt, enter_ns, exit_ns, completed,
        exit_estimated, op (a code into ``_op_names``, canonical), group (a code into
        ``_group_names``), seq, group_size, rank, duration_ns (0: not measured). None without any."""
        parts: list[tuple[np.ndarray, ...]] = []
        for block in blocks:
            strings = list(block.strings)
            if self.job_id not in strings:
                continue
            # a block's string table, as codes: ours? completed? op code, group code
            table = np.asarray([self._string_codes(text) for text in strings], dtype=np.int64)
            job = table[np.asarray(block.job_id, dtype=np.int64), 0]
            part = (np.asarray(block.attempt, dtype=np.int64), np.asarray(block.enter_ns, dtype=np.int64),
                    np.asarray(block.exit_ns, dtype=np.int64),
                    table[np.asarray(block.state, dtype=np.int64), 1].astype(bool),
                    np.asarray(block.exit_estimated, dtype=bool), table[np.asarray(block.op, dtype=np.int64), 2],
                    table[np.asarray(block.group, dtype=np.int64), 3], np.asarray(block.seq, dtype=np.int64),
                    np.asarray(block.group_size, dtype=np.int64), np.asarray(block.rank, dtype=np.int64),
                    np.asarray(block.duration_ns, dtype=np.int64) if len(block.duration_ns) else
                    np.zeros(len(block.job_id), dtype=np.int64))
            parts.append(part if job.all() else tuple(c[job.astype(bool)] for c in part))
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else tuple(np.concatenate(c) for c in zip(*parts))

    def _string_codes(self, text: str) -> tuple[int, int, int, int]:
        """(is this job's id, is "completed", op code, group code) of a block's string: each
        string is looked at once, then looked up (a job has a few ops and groups)."""
        codes = self._strings.get(text)
        if codes is None:
            if len(self._strings) >= MAX_NAMES:
                self._strings.clear()
            codes = self._strings[text] = (
                int(text == self.job_id), int(text == "completed"),
                intern(self._op_codes, self._op_names, canonical_op(text)) if text else -1,
                intern(self._group_codes, self._group_names, text))
        return codes

    def _sdc(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            if row["job_id"] in (self.job_id, ""):
                self.sdc.labels(self.job_id, row["kind"], "ok" if row["ok"] else "mismatch").inc()

    def _publish(self) -> None:
        job = self.job_id
        if self._newest:
            self.tokens.labels(job).set(sum(v[1] for v in self._newest.values()))
            losses = [v[2] for v in self._newest.values()]
            self.loss.labels(job).set(sum(losses) / len(losses) if all(map(math.isfinite, losses)) else math.nan)
        for rank, lag in self._matcher.mean_lags().items():
            self.lag.labels(job, str(rank)).set(lag)
            self._lag_ranks.add(rank)
        if self._perf.completed != self._perf_published:
            self._perf_published = self._perf.completed
            self._publish_rates()
        # the newest step every rank of the attempt has reported; until there is one, the
        # gauges keep what they showed
        complete = [step for step, (_, ranks) in self._moe.items() if ranks >= self._newest.keys()]
        moe = self._moe[max(complete)][0] if complete else {}
        for layer, tokens in moe.items():
            shares = expert_shares(tokens.tolist())
            for expert, share in enumerate(shares):
                self.share.labels(job, str(layer), str(expert)).set(share)
                self._moe_series.add((str(layer), str(expert)))
            if shares:
                self.min_share.labels(job, str(layer)).set(min(shares))
                self.max_share.labels(job, str(layer)).set(max(shares))

    def _publish_rates(self) -> None:
        """The bandwidth gauges of every group with samples."""
        job, topology = self.job_id, self._topology
        attempt, nodes = self._placement
        placed = topology is not None and attempt == self._attempt and nodes
        for group, window in self._perf.windows.items():
            skew = median_skew_s(window)
            if skew is not None:
                self.skew.labels(job, group).set(skew)
                self._skew_series.add(group)
            on = {nodes[r] for r in self._perf.members.get(group, ()) if 0 <= r < len(nodes)} if placed else set()
            path = topology.path(sorted(on)) if topology is not None and on else None
            for op in sorted({s.op for s in window if s.busbw is not None}):
                busbw = median_busbw(window, op)
                assert busbw is not None
                self.busbw.labels(job, group, op).set(busbw)
                self._rate_series.add((group, op))
                if path is None or path.bandwidth_bps <= 0:
                    continue
                ratio = busbw / path.bandwidth_bps
                if ratio > 1 and (group, op) not in self._over_link:
                    self._over_link.add((group, op))
                    log.warning("group %s %s: median busbw %.3g bytes/s is above its slowest link, %s "
                                "(%.3g bytes/s): the topology understates it; utilization shown as 1",
                                group, op, busbw, path.link, path.bandwidth_bps)
                self.utilization.labels(job, group, op).set(min(ratio, 1.0))
                self._util_series.add((group, op))
