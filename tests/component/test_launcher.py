"""A user program's rank under fleet's launcher: real interpreters, real exits and signals.

Each test starts ``workers.launcher.RankProcess`` (a real ``python -m fleet.workers.shim``
that imports torch), launches a small program in it and checks what a torchrun user
would: the environment, ``sys.argv``, the exit code, the traceback, the log file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from fleet.workers.failures import RankExitError
from fleet.workers.launcher import RankProcess, run_rank
from fleet.workers.spec import Launch, WorkerSpec


def _spec(tmp: Path, *, script: str = "", module: str = "", args: tuple[str, ...] = (), rank: int = 1,
          env: dict[str, str] | None = None) -> WorkerSpec:
    launch = Launch(module=module, script=script, args=args, workdir=str(tmp),
                    env={**os.environ, **(env or {})}, log_dir=str(tmp / "logs" / "attempt-2"))
    return WorkerSpec(job_id="j-test", attempt=2, rank=rank, world_size=4, node_name="node-0",
                      master_addr="127.0.0.1", master_port=29999, agent_address="", checkpoint_dir="",
                      launch=launch, local_rank=1, local_world_size=2, group_rank=0, group_world_size=2,
                      max_restarts=3, fr_buffer_entries=64)


def _program(tmp: Path, body: str, name: str = "prog.py") -> str:
    (tmp / name).write_text(textwrap.dedent(body))
    return name


def _run(spec: WorkerSpec) -> dict:
    process = RankProcess(spec.launch)
    try:
        return run_rank(spec, process, None)
    finally:
        process.kill()


def test_a_program_gets_torchruns_environment_argv_and_path(tmp_path: Path) -> None:
    out = tmp_path / "seen.json"
    script = _program(tmp_path, f"""
        import json, os, sys
        names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE",
                 "FLEET_JOB_ID", "FLEET_ATTEMPT", "MINE", "TORCH_FR_BUFFER_SIZE"]
        json.dump({{"env": {{n: os.environ.get(n) for n in names}}, "argv": sys.argv, "path0": sys.path[0],
                   "cwd": os.getcwd(), "main": __name__}}, open({str(out)!r}, "w"))
        print("hello from the program")
    """)
    result = _run(_spec(tmp_path, script=script, args=("--lr", "0.1", "-v"), env={"MINE": "yes"}))
    assert result["exit_code"] == 0 and result["reached_pg"] is False
    seen = json.loads(out.read_text())
    assert seen["env"] == {
        "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999",
        "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RUN_ID": "j-test",
        "TORCHELASTIC_ERROR_FILE": str(tmp_path / "logs" / "attempt-2" / "rank-1.error.json"),
        "TORCHELASTIC_USE_AGENT_STORE": "True", "FLEET_JOB_ID": "j-test", "FLEET_ATTEMPT": "2", "MINE": "yes",
        "TORCH_FR_BUFFER_SIZE": "64"}
    assert seen["argv"] == ["prog.py", "--lr", "0.1", "-v"]
    assert (seen["path0"], seen["cwd"], seen["main"]) == (str(tmp_path), str(tmp_path), "__main__")
    assert "hello from the program" in (tmp_path / "logs" / "attempt-2" / "rank-1.log").read_text()


def test_an_uncaught_exception_exits_1_with_its_traceback_in_the_log(tmp_path: Path) -> None:
    script = _program(tmp_path, """
        def load():
            raise FileNotFoundError("no shard 7 in /data")
        load()
    """)
    with pytest.raises(RankExitError) as err:
        _run(_spec(tmp_path, script=script))
    e = err.value
    assert (e.rank, e.exit_code) == (1, 1)
    assert e.traceback.startswith("Traceback (most recent call last):")
    assert "in load" in e.traceback and e.traceback.strip().endswith("FileNotFoundError: no shard 7 in /data")
    assert "fleet/workers/shim.py" not in e.traceback  # the launcher's own frames are not the program's
    assert "FileNotFoundError: no shard 7 in /data" in (tmp_path / "logs" / "attempt-2" / "rank-1.log").read_text()


def test_torchs_record_error_file_is_the_traceback_when_written(tmp_path: Path) -> None:
    script = _program(tmp_path, """
        from torch.distributed.elastic.multiprocessing.errors import record

        @record
        def main():
            raise KeyError("tokenizer")

        main()
    """)
    with pytest.raises(RankExitError) as err:
        _run(_spec(tmp_path, script=script))
    assert err.value.exit_code == 1
    assert "KeyError: 'tokenizer'" in err.value.traceback
    assert (tmp_path / "logs" / "attempt-2" / "rank-1.error.json").exists()


def test_sys_exit_codes_and_signals_are_the_programs(tmp_path: Path) -> None:
    with pytest.raises(RankExitError) as err:
        _run(_spec(tmp_path, script=_program(tmp_path, "import sys\nprint('bye')\nsys.exit(3)\n")))
    assert err.value.exit_code == 3 and "bye" in err.value.traceback  # the log's tail
    # a failed rank does not check out of the rendezvous: no c10d noise after the program's lines
    assert (tmp_path / "logs" / "attempt-2" / "rank-1.log").read_text().splitlines() == ["bye"]
    killer = _program(tmp_path, "import os, signal\nprint('about to die', flush=True)\n"
                      "os.kill(os.getpid(), signal.SIGKILL)\n", "kill.py")
    t0 = time.time()
    with pytest.raises(RankExitError) as err:
        _run(_spec(tmp_path, script=killer))
    assert err.value.exit_code == -signal.SIGKILL
    assert t0 <= err.value.exited_at <= time.time()
    assert "was killed by signal 9 (SIGKILL)" in str(err.value)


def test_a_module_runs_as_python_m_would(tmp_path: Path) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    out = tmp_path / "argv.json"
    (pkg / "train.py").write_text(f"import json, sys\njson.dump(sys.argv, open({str(out)!r}, 'w'))\n")
    assert _run(_spec(tmp_path, module="mypkg.train", args=("a", "b")))["exit_code"] == 0
    argv = json.loads(out.read_text())
    assert argv[1:] == ["a", "b"] and argv[0].endswith("mypkg/train.py")


def test_the_rank_process_dies_with_its_launcher(tmp_path: Path) -> None:
    launcher = tmp_path / "launcher.py"
    launcher.write_text(textwrap.dedent(f"""
        import os, sys, time
        from fleet.workers.launcher import RankProcess
        from fleet.workers.spec import Launch
        p = RankProcess(Launch(script="x.py", workdir={str(tmp_path)!r}, env=dict(os.environ)))
        p.ready.wait(120)
        print(p.pid, flush=True)
        time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(launcher)], stdout=subprocess.PIPE, text=True)
    try:
        child = psutil.Process(int(proc.stdout.readline()))
        assert child.is_running()
    finally:
        proc.kill()
        proc.wait()
    gone, alive = psutil.wait_procs([child], timeout=10)
    assert child in gone, "the rank's interpreter outlived its launcher"


def test_rank_0_serves_the_rendezvous_and_a_kill_after_init_is_known_to_be_after(tmp_path: Path) -> None:
    from fleet.workers.rendezvous import listen_on

    sock = listen_on("127.0.0.1", 0)
    script = _program(tmp_path, """
        import os, signal
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")            # env://, as a client of rank 0's launcher store
        t = torch.ones(3)
        dist.all_reduce(t)
        print("reduced", t.tolist(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)       # at once: no time for a periodic check
    """)
    spec = _spec(tmp_path, script=script, rank=0)
    spec = spec.__class__(**{**spec.__dict__, "world_size": 1, "master_port": sock.getsockname()[1],
                             "local_rank": 0, "local_world_size": 1, "group_world_size": 1})
    process = RankProcess(spec.launch)
    try:
        with pytest.raises(RankExitError) as err:
            run_rank(spec, process, sock)
    finally:
        process.kill()
    assert err.value.exit_code == -signal.SIGKILL and err.value.reached_pg
    assert "reduced [1.0, 1.0, 1.0]" in (tmp_path / "logs" / "attempt-2" / "rank-0.log").read_text()
