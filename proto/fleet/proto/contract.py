"""The wire constants every side of fleet's gRPC contract shares, derived from the stubs.

Service names, method paths and field tags are read from the generated descriptors
(``agent_pb2``, ``control_pb2``), never spelled by hand, so a change to a ``.proto`` file
(a renamed service, a renumbered field) reaches every user of these names when the stubs
are regenerated. The only values defined here rather than derived are the ones the
``.proto`` language has no place for: the metadata key that carries the run's token, and
the headroom a gRPC message keeps for framing.

The agent's uplink frames event batches by hand (it concatenates already encoded events
instead of re-encoding them; see ``fleet.agent.uplink``): ``AGENT_MESSAGE_BATCH_TAG`` and
``EVENT_BATCH_EVENTS_TAG`` are the encoded field keys it writes, computed with
protobuf's wire-format rule (key = field number << 3 | wire type, as a varint).
``tests/unit/test_contract.py`` checks that they follow a renumbering of the ``.proto``.
"""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor, MethodDescriptor

from fleet.proto import agent_pb2, control_pb2

#: gRPC metadata key whose value is the run's token, on every call to the controller
#: (lower case: gRPC metadata keys are).
TOKEN_METADATA_KEY = "x-fleet-token"

#: Room left in a gRPC message for an event batch's header and framing, bytes: an event
#: batch of up to ``max_message_bytes - MESSAGE_HEADROOM_BYTES`` still fits one message.
MESSAGE_HEADROOM_BYTES = 64 * 1024

#: Protobuf wire type of a length-delimited field (strings, bytes, messages, packed).
WIRETYPE_LENGTH_DELIMITED = 2

_AGENT_SERVICE = agent_pb2.DESCRIPTOR.services_by_name["AgentService"]
_NODE_AGENT_SERVICE = agent_pb2.DESCRIPTOR.services_by_name["NodeAgent"]
_CONTROL_SERVICE = control_pb2.DESCRIPTOR.services_by_name["ControlService"]

#: Fully qualified service names, as gRPC routes and health-checks them.
AGENT_SERVICE = _AGENT_SERVICE.full_name
NODE_AGENT_SERVICE = _NODE_AGENT_SERVICE.full_name
CONTROL_SERVICE = _CONTROL_SERVICE.full_name


def encode_varint(n: int) -> bytes:
    """``n`` (>= 0) as a protobuf base-128 varint."""
    if n < 0:
        raise ValueError(f"a varint here is never negative: {n}")
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def method_path(method: MethodDescriptor) -> str:
    """The HTTP/2 path gRPC calls ``method`` at: ``/<package.Service>/<Method>``."""
    return f"/{method.containing_service.full_name}/{method.name}"


def length_delimited_tag(field: FieldDescriptor) -> bytes:
    """The encoded key that precedes each value of ``field`` on the wire.

    Only for fields encoded length-delimited one value at a time (messages, strings,
    bytes): a hand-framed value of any other field would need another wire type.
    """
    if field.type not in (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
        raise ValueError(f"{field.full_name} is not a length-delimited field")
    return encode_varint(field.number << 3 | WIRETYPE_LENGTH_DELIMITED)


#: AgentService.Connect: the agent's one bidirectional stream.
CONNECT_METHOD = _AGENT_SERVICE.methods_by_name["Connect"].name
CONNECT_METHOD_PATH = method_path(_AGENT_SERVICE.methods_by_name["Connect"])

#: Key of ``AgentMessage.batch`` (an ``EventBatch``), for a batch framed by hand.
AGENT_MESSAGE_BATCH_TAG = length_delimited_tag(agent_pb2.AgentMessage.DESCRIPTOR.fields_by_name["batch"])
#: Key of each element of ``EventBatch.events`` (repeated ``Event``): a repeated message
#: field is encoded as the concatenation of its elements, each under this key.
EVENT_BATCH_EVENTS_TAG = length_delimited_tag(agent_pb2.EventBatch.DESCRIPTOR.fields_by_name["events"])
#: Key of each element of ``EventBatch.marks`` (repeated ``ReportMark``): the agent's
#: write-ahead log puts one after the last event of each worker report.
EVENT_BATCH_MARKS_TAG = length_delimited_tag(agent_pb2.EventBatch.DESCRIPTOR.fields_by_name["marks"])
