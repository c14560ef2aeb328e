"""The wire contract's vocabularies as Python enums: fault kinds, incident kinds and
where a collective's duration comes from.

The ``.proto`` enums (``events.proto``: ``FaultKind``, ``IncidentKind``) are the source
of truth for which kinds exist; this module gives each the spelling users and the store
use and the properties every package asks of a kind, so that no package keeps its own
list. ``tests/unit/test_kinds.py`` fails when the two disagree.

Spelling: a fault kind is its proto name without the prefix, lower case, ``-`` between
words (``FAULT_KIND_NODE_DOWN`` -> ``node-down``, as ``fleet inject-fault --kind`` takes
it); an incident kind the same with ``_`` (``INCIDENT_KIND_AGENT_LOSS`` -> ``agent_loss``,
as stored in ``incidents.kind``).
"""

from __future__ import annotations

import enum

from fleet.proto import events_pb2


class Carrier(enum.StrEnum):
    """Who carries a fault out."""

    RANK = "rank"              # the rank itself, told through its node agent
    AGENT = "agent"            # the node's agent, acting on itself
    CONTROLLER = "controller"  # the controller (node-down, checkpoint damage, its own death)


class Aim(enum.StrEnum):
    """What a fault order names as its target."""

    RANK = "rank"  # one rank (or every rank of a node given with --node)
    NODE = "node"  # a node, given directly or as the node of a given rank
    JOB = "job"    # the whole job: neither a rank nor a node


class FaultKind(enum.StrEnum):
    """A fault chaos can inject."""

    CRASH = "crash"
    HANG = "hang"
    SLOW = "slow"
    NAN = "nan"
    NODE_DOWN = "node-down"
    AGENT_DOWN = "agent-down"
    PARTITION = "partition"
    CKPT_CORRUPT = "ckpt-corrupt"
    CONTROLLER_CRASH = "controller-crash"
    SDC = "sdc"
    SDC_GEMM = "sdc-gemm"

    @property
    def carrier(self) -> Carrier:
        return _FAULT_CARRIER[self]

    @property
    def aim(self) -> Aim:
        return _FAULT_AIM[self]

    @property
    def worker_timed(self) -> bool:
        """Given ``at_step``, a worker fires it itself at exactly that step (the rank
        kinds, and ckpt-corrupt, which rank 0 carries out at the top of the step)."""
        return self.carrier is Carrier.RANK or self is FaultKind.CKPT_CORRUPT

    @property
    def has_duration(self) -> bool:
        """``duration_s`` means something for this kind."""
        return self in _FAULT_DURATION

    @property
    def wire(self) -> int:
        """The ``events.proto`` ``FaultKind`` number."""
        return events_pb2.FaultKind.Value("FAULT_KIND_" + self.name)

    @classmethod
    def from_wire(cls, number: int) -> FaultKind:
        """The kind of a ``FaultSpec.kind``; ValueError for UNSPECIFIED or an unknown number."""
        name = events_pb2.FaultKind.Name(number)  # ValueError when unknown
        if name == "FAULT_KIND_UNSPECIFIED":
            raise ValueError("fault kind is unspecified")
        return cls[name.removeprefix("FAULT_KIND_")]


_FAULT_CARRIER = {
    FaultKind.CRASH: Carrier.RANK, FaultKind.HANG: Carrier.RANK, FaultKind.SLOW: Carrier.RANK,
    FaultKind.NAN: Carrier.RANK, FaultKind.AGENT_DOWN: Carrier.AGENT, FaultKind.PARTITION: Carrier.AGENT,
    FaultKind.NODE_DOWN: Carrier.CONTROLLER, FaultKind.CKPT_CORRUPT: Carrier.CONTROLLER,
    FaultKind.CONTROLLER_CRASH: Carrier.CONTROLLER, FaultKind.SDC: Carrier.RANK, FaultKind.SDC_GEMM: Carrier.AGENT,
}
_FAULT_AIM = {
    FaultKind.CRASH: Aim.RANK, FaultKind.HANG: Aim.RANK, FaultKind.SLOW: Aim.RANK, FaultKind.NAN: Aim.RANK,
    FaultKind.AGENT_DOWN: Aim.NODE, FaultKind.PARTITION: Aim.NODE, FaultKind.NODE_DOWN: Aim.NODE,
    FaultKind.CKPT_CORRUPT: Aim.JOB, FaultKind.CONTROLLER_CRASH: Aim.JOB, FaultKind.SDC: Aim.RANK,
    FaultKind.SDC_GEMM: Aim.NODE,
}
_FAULT_DURATION = frozenset({FaultKind.HANG, FaultKind.SLOW, FaultKind.AGENT_DOWN, FaultKind.PARTITION,
                             FaultKind.NODE_DOWN})


class IncidentKind(enum.StrEnum):
    """A kind of incident the controller records."""

    CRASH = "crash"
    ERROR = "error"
    HANG = "hang"
    DESYNC = "desync"
    STRAGGLER = "straggler"
    NAN = "nan"
    LOSS_SPIKE = "loss_spike"
    AGENT_LOSS = "agent_loss"
    NODE_LOSS = "node_loss"
    CONTROLLER_CRASH = "controller_crash"
    SDC = "sdc"
    SLOW_COMM = "slow_comm"

    @property
    def ends_attempt(self) -> bool:
        """The attempt is over once this is seen (a restart follows); the others are
        recorded and acted on while the attempt runs."""
        return self in _ENDS_ATTEMPT

    @property
    def hardware_like(self) -> bool:
        """Points at the machine rather than the code: a process that died, a rank that
        never entered a collective, a node that vanished. Errors and desyncs follow the code."""
        return self in _HARDWARE_LIKE

    @property
    def counts_for_quarantine(self) -> bool:
        """Counted by default towards quarantining the node it is blamed on
        (``policy.quarantine_kinds``): the hardware-like kinds a node can recur with."""
        return self in _QUARANTINE_DEFAULT

    @property
    def wire(self) -> int:
        """The ``events.proto`` ``IncidentKind`` number."""
        return events_pb2.IncidentKind.Value("INCIDENT_KIND_" + self.name)


_ENDS_ATTEMPT = frozenset({IncidentKind.CRASH, IncidentKind.ERROR, IncidentKind.HANG, IncidentKind.DESYNC,
                           IncidentKind.NAN, IncidentKind.NODE_LOSS, IncidentKind.CONTROLLER_CRASH})
#: sdc: a transient one is handled inside the attempt (rolled back in memory); a persistent
#: one ends it through the ranks' own failure (workers.failures.SdcError), not the watchdog
_HARDWARE_LIKE = frozenset({IncidentKind.CRASH, IncidentKind.HANG, IncidentKind.NODE_LOSS, IncidentKind.SDC})
#: a lost node is back (or gone) by itself; crashes and hangs that recur on one node are its fault.
#: sdc has its own rule (policy.decide_quarantine): persistent at once, transient on recurrence
_QUARANTINE_DEFAULT = frozenset({IncidentKind.CRASH, IncidentKind.HANG})


class Timing(enum.StrEnum):
    """Where a collective's measured duration comes from (``events.proto``
    ``CollectiveTiming``; the store keeps the wire number). Only a measured duration
    enters bandwidth figures: ``NOT_MEASURED`` ones are shown as such, never estimated."""

    NOT_MEASURED = "not measured"
    WRAPPER = "wrapper"   # a blocking call, timed by the thread that made it: all of it exposed
    ASYNC = "async"       # an async_op=True call: issue to its Work's completion (may overlap compute)
    NCCL = "nccl"         # NCCL's device timing (TORCH_NCCL_ENABLE_TIMING=1)

    @property
    def wire(self) -> int:
        """The ``events.proto`` ``CollectiveTiming`` number."""
        return _TIMING_WIRE[self]

    @classmethod
    def from_wire(cls, number: int) -> Timing:
        """The timing of a wire number; an unknown one reads as not measured."""
        return _TIMING_BY_WIRE.get(int(number), cls.NOT_MEASURED)


_TIMING_WIRE = {Timing.NOT_MEASURED: events_pb2.COLLECTIVE_TIMING_UNSPECIFIED,
                Timing.WRAPPER: events_pb2.COLLECTIVE_TIMING_WRAPPER,
                Timing.NCCL: events_pb2.COLLECTIVE_TIMING_NCCL, Timing.ASYNC: events_pb2.COLLECTIVE_TIMING_ASYNC}
_TIMING_BY_WIRE = {v: k for k, v in _TIMING_WIRE.items()}
