"""`fleet up` attached to a Ray cluster started the way users start one: `ray start --head` and
`ray start --address` (two Ray nodes on 127.0.0.1, each its own `ray` CLI process that this
test owns), `ray.address` in cluster.yaml, Ray's token authentication on, the store on a real
PostgreSQL server and the agents' streams served by two ingest processes
(``controller.ingest_processes: 2``), as a large cluster runs.

Asserted: the job succeeds; the store's nodes are the Ray nodes (their IDs, named from the
address Ray reports); exactly one agent runs on each Ray node and each sent its host health; the
ranks run on both nodes (each rank's process descends from its node's raylet); every
listening socket of `fleet up`, the Ray daemons, the agents and the ranks is on loopback;
the cluster is still up afterwards with none of fleet's actors alive on it; and ending the two
CLI processes by PID leaves none of their processes behind; the two ingest processes shared
one port and every agent held its stream to it.

Why the second node starts through a two-line wrapper of Ray's own CLI entry point: with
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (Ray's switch that keeps a node on loopback) `ray
start --address` refuses to start, and with it on, the CLI replaces 127.0.0.1 by the host's
routable IP (``services.resolve_ip_for_localhost``), after which Ray listens on every
interface. On real hosts neither matters (their addresses are routable); here the wrapper
keeps the loopback address the test passes and is otherwise the `ray` command.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from fleet.controlplane.lifecycle import JobState
from fleet.controlplane.store import Store
from tests.integration.test_fleet_up import FleetUp, controller_job, write_cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

RAY_CLI = str(Path(sys.executable).with_name("ray"))
CPUS_PER_NODE = 2
STEPS = 4
_KEEP_LOOPBACK = (
    "import sys\n"
    "from ray._private import services\n"
    "services.resolve_ip_for_localhost = lambda host: host\n"
    "from ray.scripts.scripts import main\n"
    "sys.argv[0] = 'ray'\n"
    "sys.exit(main())\n"
)
_NODES = (
    "import json, sys, time, ray\n"
    "ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)\n"
    "deadline = time.monotonic() + float(sys.argv[2])\n"
    "while True:\n"
    "    alive = [n for n in ray.nodes() if n['Alive']]\n"
    "    if len(alive) >= 2 or time.monotonic() > deadline:\n"
    "        break\n"
    "    time.sleep(0.2)\n"
    "print(json.dumps([{'id': n['NodeID'], 'ip': n['NodeManagerAddress'], 'cpus': n['Resources'].get('CPU')}"
    " for n in alive]))\n"
    "ray.shutdown()\n"
)

#: After `fleet up`: the cluster's alive nodes, and fleet's actors on record and still alive.
_AFTER = (
    "import json, sys, ray\n"
    "from ray._private.state import actors\n"
    "ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)\n"
    "seen = list(actors().values())\n"
    "print(json.dumps({'nodes': sum(1 for n in ray.nodes() if n['Alive']), 'actors': len(seen),\n"
    "                  'alive': [a['Name'] or a['ActorID'] for a in seen if a['State'] == 'ALIVE']}))\n"
    "ray.shutdown()\n"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayCliNode:
    """One `ray start --block` process and, once captured, the processes under it."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self._log = log.open("w")
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def tree(self) -> dict[int, psutil.Process]:
        """The CLI process and its descendants now (empty once it is gone)."""
        try:
            root = psutil.Process(self.proc.pid)
            return {p.pid: p for p in (root, *root.children(recursive=True))}
        except psutil.Error:
            return {}

    def raylet_node_id(self) -> str:
        """The Ray node ID its raylet was started with."""
        for p in self.tree().values():
            try:
                if p.name() == "raylet":
                    return next(a.split("=", 1)[1] for a in p.cmdline() if a.startswith("--node_id="))
            except (psutil.Error, StopIteration):
                continue
        raise AssertionError(f"{self.name}: no raylet under the ray CLI process")

    def end(self, timeout_s: float = 30.0) -> list[int]:
        """SIGTERM the CLI (Ray then stops the node's processes); returns the pids of its
        tree still alive after ``timeout_s``, each killed by PID."""
        captured = self.tree()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()
        deadline = time.monotonic() + timeout_s
        alive = list(captured)
        while alive and time.monotonic() < deadline:
            alive = [pid for pid, p in captured.items() if _running(p)]
            time.sleep(0.1)
        for pid in alive:
            try:
                captured[pid].kill()
            except psutil.Error:
                pass
        return alive


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class AttachedFleetUp(FleetUp):
    """`fleet up` whose agents and ranks live under the ray CLI processes: samples those
    trees too (process names and listening sockets)."""

    def __init__(self, tmp: Path, cluster: Path, nodes: list[RayCliNode]) -> None:
        self._nodes = nodes
        #: (ray CLI node name, pid, first word of its command line) of every process seen under each CLI
        self.under: set[tuple[str, int, str]] = set()
        #: pid -> the port it listens on, of fleet up's ingest processes
        self.ingest: dict[int, int] = {}
        #: (agent pid, controller-side port) of every connection an agent was seen to hold
        self.agent_links: set[tuple[int, int]] = set()
        super().__init__(tmp, cluster)

    def sample(self, force: bool = False) -> None:
        super().sample(force=True)  # the agents' links and the ray CLI trees: every call counts
        trees = {node.name: node.tree() for node in self._nodes}
        everything = {pid: p for tree in trees.values() for pid, p in tree.items()}
        try:
            ours = {p.pid: p for p in psutil.Process(self.proc.pid).children(recursive=True)}
            sockets = psutil.net_connections(kind="inet")
        except psutil.Error:
            return
        for c in sockets:
            try:
                if c.status == psutil.CONN_LISTEN and c.pid in everything:
                    self.listening.add((c.laddr.ip, c.laddr.port, everything[c.pid].name()))
                elif c.status == psutil.CONN_LISTEN and c.pid in ours and \
                        "fleet.controlplane.ingest_shards" in ours[c.pid].cmdline():
                    self.ingest[c.pid] = c.laddr.port
                elif c.status == psutil.CONN_ESTABLISHED and c.pid in everything and c.raddr and \
                        everything[c.pid].cmdline()[:1] and everything[c.pid].cmdline()[0].startswith("ray::AgentActor"):
                    self.agent_links.add((c.pid, c.raddr.port))
            except psutil.Error:
                pass
        for name, tree in trees.items():
            for p in tree.values():
                try:
                    cmd = p.cmdline()
                except psutil.Error:
                    continue
                if cmd:
                    self.under.add((name, p.pid, cmd[0].split()[0]))

    def agents_on(self, node: str) -> set[int]:
        """Pids of the agent processes seen under ``node``'s CLI."""
        return {pid for name, pid, cmd in self.under if name == node and cmd.startswith("ray::AgentActor")}

    def pids_under(self, node: str) -> set[int]:
        return {pid for name, pid, _ in self.under if name == node}


def _cluster_yaml(tmp: Path, address: str, store_url: str) -> Path:
    path = write_cluster(tmp, steps=STEPS, checkpoint_interval=STEPS, nodes=2, ranks_per_node=1,
                         spare_workers_per_node=0, warmup_steps=1)
    cfg = yaml.safe_load(path.read_text())
    cfg["ray"] = {"address": address}
    cfg["sdc"] = {"preflight": False}
    # as a large cluster runs: the store on PostgreSQL, the agents' streams served by two
    # ingest processes on their own port (controller.ingest_processes)
    cfg["store"] = {"url": store_url}
    cfg.setdefault("controller", {})["ingest_processes"] = 2
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_fleet_up_attaches_to_a_cluster_started_with_the_ray_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 postgres_server) -> None:  # noqa: ANN001
    t0 = time.monotonic()
    store_url = postgres_server.create_database()
    port = _free_port()
    address = f"127.0.0.1:{port}"
    # fleet up is a Ray driver like any: it needs the cluster's token (it inherits this environment)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
    base = {**os.environ, "RAY_worker_niceness": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    common = ["--block", "--node-ip-address", "127.0.0.1", "--num-cpus", str(CPUS_PER_NODE),
              "--object-store-memory", str(128 * 1024 * 1024), "--disable-usage-stats"]
    nodes: list[RayCliNode] = []
    run: AttachedFleetUp | None = None
    try:
        nodes.append(RayCliNode(
            "head", [RAY_CLI, "start", "--head", "--port", str(port), "--include-dashboard", "false", *common],
            {**base, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}, tmp_path / "ray-head.log"))
        nodes.append(RayCliNode(
            "worker", [sys.executable, "-c", _KEEP_LOOPBACK, "start", "--address", address, *common],
            {**base, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}, tmp_path / "ray-worker.log"))
        seen = subprocess.run([sys.executable, "-c", _NODES, address, "60"], env=base, capture_output=True,
                              text=True, timeout=120)
        assert seen.returncode == 0, seen.stderr[-3000:]
        ray_nodes = json.loads(seen.stdout.strip().splitlines()[-1])
        assert len(ray_nodes) == 2, f"the cluster did not reach 2 alive nodes: {ray_nodes}"
        assert all(n["cpus"] == CPUS_PER_NODE for n in ray_nodes), ray_nodes
        by_cli = {node.name: node.raylet_node_id() for node in nodes}
        assert {n["id"] for n in ray_nodes} == set(by_cli.values())

        run = AttachedFleetUp(tmp_path, _cluster_yaml(tmp_path, address, store_url), nodes)
        run.wait_until(lambda: controller_job(tmp_path), 90, "the controller to start")
        summary = run.finish(timeout_s=150)
        assert summary["state"] == "SUCCEEDED" and summary["final_step"] == STEPS, summary

        with Store(store_url) as store:
            job = store.get_job(summary["job_id"])
            assert job.state is JobState.SUCCEEDED and job.attempts == 1
            rows = store.list_nodes()
            ranks = store.ranks(job.id, 1)
            health = {n.name: store.health_samples(n.name) for n in rows}
        # the store's nodes are the Ray nodes, named from what Ray reports
        assert {n.ray_node_id for n in rows} == {n["id"] for n in ray_nodes}
        ip_of = {n["id"]: n["ip"] for n in ray_nodes}
        for n in rows:
            assert n.name == f"{ip_of[n.ray_node_id]}-{n.ray_node_id[:8]}"
            assert n.hostname == socket.gethostname()   # as each agent's Hello reports its host
            assert health[n.name], f"no host health from the agent of {n.name}"
        # exactly one agent process on each Ray node
        agents = {cli.name: run.agents_on(cli.name) for cli in nodes}
        assert all(len(pids) == 1 for pids in agents.values()), f"agents per Ray node: {agents}"
        # the ranks ran on both nodes: each rank's process under its own node's raylet
        name_of = {n.ray_node_id: n.name for n in rows}
        assert sorted(r.rank for r in ranks) == [0, 1]
        assert {r.node for r in ranks} == {name_of[by_cli["head"]], name_of[by_cli["worker"]]}
        for r in ranks:
            cli = next(c for c in nodes if name_of[by_cli[c.name]] == r.node)
            assert r.pid in run.pids_under(cli.name), f"rank {r.rank} (pid {r.pid}) not under {cli.name}'s raylet"
        # two ingest processes shared one port, and the agents streamed to it
        assert len(run.ingest) == 2 and len(set(run.ingest.values())) == 1, run.ingest
        ingest_port = next(iter(run.ingest.values()))
        streaming = {pid for pid, port in run.agent_links if port == ingest_port}
        assert streaming == set().union(*agents.values()), (run.agent_links, agents)
        run.assert_loopback_only()
        run.assert_tree_gone()
        # the cluster fleet attached to is still up, with none of fleet's actors left on it
        after = subprocess.run([sys.executable, "-c", _AFTER, address], env=base, capture_output=True,
                               text=True, timeout=120)
        assert after.returncode == 0, after.stderr[-3000:]
        state = json.loads(after.stdout.strip().splitlines()[-1])
        assert state["nodes"] == 2 and state["actors"] >= 4, state   # 2 agents and 2 ranks on record
        assert state["alive"] == [], f"fleet left actors running: {state['alive']}"
    finally:
        if run is not None and run.proc.poll() is None:
            run.proc.kill()
            run.wait(30)
        left = {node.name: node.end() for node in reversed(nodes)}
        postgres_server.drop_database(store_url)
    assert not any(left.values()), f"processes of the ray CLI nodes outlived them: {left}"
    print(f"ray CLI attach: {time.monotonic() - t0:.1f} s in all")
