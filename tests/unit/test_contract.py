"""fleet.proto.contract: the wire constants follow the .proto files.

The uplink frames event batches by hand with the contract's field tags; these tests
fail when a renumbering of agent.proto would make that framing disagree with the
generated classes: the tags are checked against the descriptors, hand-framed bytes are
parsed with the generated ``AgentMessage``, and a renumbered copy of the .proto files is
compiled (grpc_tools.protoc, into a temporary folder) and loaded in a child process whose
derived tags must follow the new numbers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import google.protobuf
import pytest
from grpc_tools import protoc

from fleet.agent import uplink
from fleet.proto import agent_pb2, contract, events_pb2

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO / "proto" / "fleet" / "proto"


def _decode_varint(data: bytes, pos: int = 0) -> tuple[int, int]:
    """(value, position after it): an independent reading of protobuf's varint."""
    value, shift = 0, 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def test_wire_values_are_unchanged() -> None:
    # what agents and controllers of the previous release send and expect
    assert contract.TOKEN_METADATA_KEY == "x-fleet-token"
    assert contract.CONNECT_METHOD_PATH == "/fleet.v1.AgentService/Connect"
    assert (contract.AGENT_SERVICE, contract.CONTROL_SERVICE) == ("fleet.v1.AgentService", "fleet.v1.ControlService")
    assert (contract.AGENT_MESSAGE_BATCH_TAG, contract.EVENT_BATCH_EVENTS_TAG) == (b"\x12", b"\x22")
    assert contract.MESSAGE_HEADROOM_BYTES == 64 * 1024


def test_tags_are_the_descriptors_field_numbers() -> None:
    for tag, field in (
        (contract.AGENT_MESSAGE_BATCH_TAG, agent_pb2.AgentMessage.DESCRIPTOR.fields_by_name["batch"]),
        (contract.EVENT_BATCH_EVENTS_TAG, agent_pb2.EventBatch.DESCRIPTOR.fields_by_name["events"]),
    ):
        key, end = _decode_varint(tag)
        assert end == len(tag)
        assert (key >> 3, key & 7) == (field.number, contract.WIRETYPE_LENGTH_DELIMITED)
    # the uplink frames with exactly these
    assert uplink.AGENT_MESSAGE_BATCH_TAG is contract.AGENT_MESSAGE_BATCH_TAG
    assert uplink.EVENT_BATCH_EVENTS_TAG is contract.EVENT_BATCH_EVENTS_TAG
    assert uplink.CONNECT_METHOD_PATH is contract.CONNECT_METHOD_PATH


def test_varint_and_tag_rules() -> None:
    for n in (0, 1, 127, 128, 300, 16383, 16384, 2**31, 2**63):
        encoded = contract.encode_varint(n)
        assert _decode_varint(encoded) == (n, len(encoded))
    with pytest.raises(ValueError):
        contract.encode_varint(-1)
    with pytest.raises(ValueError, match="seq"):
        contract.length_delimited_tag(agent_pb2.EventBatch.DESCRIPTOR.fields_by_name["seq"])


def test_hand_framed_batch_parses_with_the_generated_class() -> None:
    events = [
        events_pb2.Event(step=events_pb2.StepEvent(job_id="j", attempt=1, rank=r, step=s, loss=1.0 / s))
        for r in range(3) for s in range(1, 400)
    ]
    header = agent_pb2.EventBatch(agent_id="agent-n0", epoch=7, seq=3).SerializeToString()
    # the uplink's framing: header, then each event as one EventBatch.events field, the
    # whole as AgentMessage.batch (a batch over 127 bytes needs a multi-byte length)
    batch = header + b"".join(uplink._length_delimited(contract.EVENT_BATCH_EVENTS_TAG, e.SerializeToString())
                              for e in events)
    framed = uplink._length_delimited(contract.AGENT_MESSAGE_BATCH_TAG, batch)
    assert len(batch) > 16384
    msg = agent_pb2.AgentMessage.FromString(framed)
    assert msg.WhichOneof("msg") == "batch"
    assert (msg.batch.agent_id, msg.batch.epoch, msg.batch.seq) == ("agent-n0", 7, 3)
    assert list(msg.batch.events) == events
    assert framed == agent_pb2.AgentMessage(batch=msg.batch).SerializeToString()


def test_method_path_and_services_match_the_stubs() -> None:
    connect = agent_pb2.DESCRIPTOR.services_by_name["AgentService"].methods_by_name["Connect"]
    assert contract.method_path(connect) == contract.CONNECT_METHOD_PATH
    assert contract.CONNECT_METHOD == connect.name
    assert contract.NODE_AGENT_SERVICE == agent_pb2.DESCRIPTOR.services_by_name["NodeAgent"].full_name


def _renumber(text: str, message: str, field: str, number: int) -> str:
    """``text`` with ``field`` of ``message`` given field number ``number``."""
    block = re.search(rf"message {message} \{{.*?\n\}}", text, re.DOTALL)
    assert block is not None, message
    new, n = re.subn(rf"(\b{field} = )\d+;", rf"\g<1>{number};", block.group(0))
    assert n == 1, (message, field)
    return text[:block.start()] + new + text[block.end():]


# Runs against the renumbered stubs only: -S keeps site-packages (and with it the
# editable install of this checkout) off sys.path; PYTHONPATH names protobuf's folder.
_CHILD = r"""
import json, sys
from fleet.proto import agent_pb2, contract, events_pb2
assert agent_pb2.__file__.startswith(sys.argv[1]), agent_pb2.__file__
event = events_pb2.Event(step=events_pb2.StepEvent(job_id="j", step=5))
def field(tag, data):
    return tag + contract.encode_varint(len(data)) + data
header = agent_pb2.EventBatch(agent_id="a", seq=1).SerializeToString()
batch = header + field(contract.EVENT_BATCH_EVENTS_TAG, event.SerializeToString())
new = agent_pb2.AgentMessage.FromString(field(contract.AGENT_MESSAGE_BATCH_TAG, batch))
old = agent_pb2.AgentMessage.FromString(field(b"\x12", header + field(b"\x22", event.SerializeToString())))
print(json.dumps({
    "batch_tag": list(contract.AGENT_MESSAGE_BATCH_TAG),
    "events_tag": list(contract.EVENT_BATCH_EVENTS_TAG),
    "connect": contract.CONNECT_METHOD_PATH,
    "parsed": new.WhichOneof("msg") == "batch" and list(new.batch.events) == [event],
    "old_tags_parse": old.WhichOneof("msg"),
}))
"""


def test_derived_tags_follow_a_renumbered_proto(tmp_path: Path) -> None:
    src = tmp_path / "src" / "fleet" / "proto"
    out = tmp_path / "out"
    src.mkdir(parents=True)
    (out / "fleet" / "proto").mkdir(parents=True)
    for proto in PROTO_DIR.glob("*.proto"):
        shutil.copy(proto, src / proto.name)
    agent = (src / "agent.proto").read_text()
    agent = _renumber(agent, "AgentMessage", "batch", 17)    # key 138: two bytes on the wire
    agent = _renumber(agent, "EventBatch", "events", 15)
    (src / "agent.proto").write_text(agent)
    protos = [f"fleet/proto/{p.name}" for p in sorted(src.glob("*.proto"))]
    assert protoc.main(["grpc_tools.protoc", f"-I{tmp_path / 'src'}", f"--python_out={out}", *protos]) == 0
    (out / "fleet" / "__init__.py").write_text("")
    for name in ("__init__.py", "contract.py"):
        shutil.copy(PROTO_DIR / name, out / "fleet" / "proto" / name)

    protobuf_root = Path(google.protobuf.__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(out), str(protobuf_root)])}
    child = subprocess.run([sys.executable, "-S", "-c", _CHILD, str(out)], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=30)
    assert child.returncode == 0, child.stderr
    got = json.loads(child.stdout)
    assert got["batch_tag"] == [0x8A, 0x01]       # (17 << 3 | 2) as a varint
    assert got["events_tag"] == [15 << 3 | 2]   # one byte, as before
    assert got["connect"] == "/fleet.v1.AgentService/Connect"
    assert got["parsed"] is True
    # the old hard-coded tags would now frame an unknown field: no batch at all
    assert got["old_tags_parse"] is None
