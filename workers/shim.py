"""The interpreter a user program runs in: started warm, told what to run, then it runs it.

``python -m fleet.workers.shim CONTROL_FD`` is started by the rank's launcher
(``workers/launcher.py``) before the attempt needs it. It imports torch at once (the
cost a torchrun restart pays for every rank) and says ``ready`` on its control socket
(a Unix socketpair end). When the attempt starts, the launcher sends one ``launch``
message: the rank's environment, working directory, log file and program. The shim then

  1. puts the variables into ``os.environ`` (torch reads them when the program creates
     its process group, not at import; ``OMP_NUM_THREADS`` is applied through
     ``torch.set_num_threads``, since the OpenMP runtime read it at import);
  2. sends its stdout and stderr to the rank's log file, line-buffered, stdin from
     /dev/null, and enables ``faulthandler`` (a fatal signal leaves a Python stack);
  3. rank 0 only: serves the rendezvous TCPStore from the listening socket the launcher
     passed along (bound to MASTER_ADDR only); every rank's ``env://`` init joins it
     as a client (``TORCHELASTIC_USE_AGENT_STORE=True``), as under torchrun's agent;
  4. starts fleet's ``Session`` (native flight recorder streamed to the node agent,
     ``fleet.step``, faults) and runs the module or script as ``__main__`` with
     ``sys.argv`` set as ``python -m``/``python script`` would;
  5. when the program succeeded, rank 0 keeps the store up until the other ranks'
     programs have ended too (bounded), as torchrun's agent does, and the others check
     out, with their output already closed (the log ends with the program's own lines);
     then it reports how it ended: the exit code is the program's (``sys.exit(n)``, 1 for
     an uncaught exception, whose traceback is printed to the log as Python would and
     sent to the launcher).

torch is imported at a lower CPU priority (``import_warm_modules``), so warming
spares never slows a training rank. It dies with its launcher (``PR_SET_PDEATHSIG``): a rank never outlives the process
fleet tracks it by. Imports nothing of the controller.
"""

from __future__ import annotations

import ctypes
import faulthandler
import importlib
import json
import os
import runpy
import signal
import socket
import sys
import threading
import traceback
from typing import Any

#: Longest message on the control socket (a launch carries the rank's environment).
MAX_MESSAGE = 4 * 1024 * 1024
#: Longest rank 0 keeps the rendezvous store up after its program ended, for the others.
STORE_LINGER_S = 30.0
_EXITED_KEY = "fleet/exited"
#: What a warm interpreter imports before it is needed (each ~0.1-1 s on first use).
WARM_MODULES = ("torch", "torch.distributed", "torch._dynamo", "torch.nn.parallel", "torch.utils.data",
                "torch.distributed.checkpoint", "torch.distributed.fsdp")
#: Nice value of the thread that imports them.
WARM_NICE = 19
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (the launcher) dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the launcher kills its child itself
        return


def send(sock: socket.socket, kind: str, **fields: Any) -> None:
    """One JSON message per line on the control socket."""
    sock.sendall((json.dumps({"kind": kind, **fields}) + "\n").encode())


def _receive_launch(sock: socket.socket) -> tuple[dict[str, Any], int | None]:
    """The launch message and the listening socket's descriptor passed with it (rank 0)."""
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, more_fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 4)
        if not chunk:
            raise SystemExit(0)  # the launcher went away before an attempt needed us
        data += chunk
        fds += more_fds
    return json.loads(data), (fds[0] if fds else None)


def _redirect_output(log_path: str) -> None:
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)


def _serve_store(listen_fd: int, launch: dict[str, Any]) -> Any:
    """Rank 0: the attempt's rendezvous TCPStore, on the launcher's listening socket."""
    from datetime import timedelta

    import torch.distributed as dist

    env = launch["env"]
    return dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), True,
                         timedelta(seconds=launch["pg_timeout_s"]), wait_for_workers=False,
                         master_listen_fd=listen_fd)


def _quiet_output() -> None:
    """Point stdout and stderr at /dev/null once the program has ended: what the shim does
    after it (c10d's own errors when rank 0's store is already gone, dozens of lines with a
    C++ stack) is not the program's output, and the rank's log tail must stay the program's."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    finally:
        os.close(devnull)


def _leave_rendezvous(store: Any, launch: dict[str, Any]) -> None:
    """Keep rank 0's store up until every other rank's program has ended (bounded by
    ``STORE_LINGER_S``), as torchrun's agent keeps its store; the others check out."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    env = launch["env"]
    world = int(env["WORLD_SIZE"])
    try:
        if store is not None:
            deadline = time.monotonic() + STORE_LINGER_S
            while store.add(_EXITED_KEY, 0) < world - 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        elif world > 1:
            client = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, False,
                                   timedelta(seconds=2))
            client.add(_EXITED_KEY, 1)
    except (RuntimeError, OSError):  # rank 0 is gone already: nobody to tell
        return


def _tell_when_grouped(session: Any) -> None:
    """Report the default process group the moment ``init_process_group`` returns (the
    session's own check runs every 0.1 s, too late for a rank killed right after)."""
    import functools

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    original = distributed_c10d.init_process_group

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        session.pg_ready()
        return result

    dist.init_process_group = distributed_c10d.init_process_group = init_process_group


def _program_traceback(exc: BaseException) -> str:
    """The traceback of an exception the program raised, without the shim's own frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _run_program(launch: dict[str, Any]) -> None:
    workdir = launch["workdir"]
    if launch["module"]:
        sys.argv = [launch["module"], *launch["args"]]
        sys.path[0] = workdir  # as `python -m` puts the current directory first
        runpy.run_module(launch["module"], run_name="__main__", alter_sys=True)
    else:  # the working directory is workdir: the path runs as given, as `python script` would
        sys.argv = [launch["script"], *launch["args"]]
        sys.path[0] = os.path.dirname(os.path.abspath(launch["script"]))
        runpy.run_path(launch["script"], run_name="__main__")


def import_warm_modules(first: tuple[str, ...] = ()) -> None:
    """Import ``first``, then torch and what training programs load lazily
    (``WARM_MODULES``: the first optimizer alone pulls in ``torch._dynamo``, about a
    second) at a lower CPU priority.

    The imports run on a helper thread under Linux's ``SCHED_IDLE`` policy (and niced to
    ``WARM_NICE`` where that cannot be set): Linux schedules each thread on its own, so
    warm spares importing torch yield the CPU to ranks that are busy (a restart warms the
    next spares while the new attempt starts), and the main thread, which runs the
    program, keeps the priority it was started with. ``SCHED_IDLE`` rather than nice 19
    alone: a core running only idle-class work counts as free when a rank wakes from a
    collective's wait, so the rank gets it at once. It is not free on a small machine
    (caches, memory bandwidth): on 2 cores, 4 ranks' steps were still slower while spares
    warmed, if less than beside full-priority imports. A spare warms on the CPU time
    training leaves idle (collectives' waits, data loading); on a node with none it
    finishes once a failure stops the training, which is still before a cold interpreter
    would have imported torch."""
    def work() -> None:
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, WARM_NICE)
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError):  # not Linux: same priority (or nice), same result
            pass
        for name in (*first, *WARM_MODULES):
            try:
                importlib.import_module(name)
            except ImportError:  # an optional part this torch build lacks
                pass

    helper = threading.Thread(target=work, name="fleet-warm-import")
    helper.start()
    helper.join()


def main(argv: list[str]) -> int:
    _die_with_parent()
    control = socket.socket(fileno=int(argv[0]))
    import_warm_modules()
    import torch

    from fleet.proto import events_pb2
    from fleet.workers.session import Session
    from fleet.workers.spec import WorkerSpec

    send(control, "ready", pid=os.getpid())
    launch, listen_fd = _receive_launch(control)
    os.environ.update(launch["env"])
    os.chdir(launch["workdir"])
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    _redirect_output(launch["log_path"])
    faulthandler.enable()
    store = _serve_store(listen_fd, launch) if listen_fd is not None else None
    spec = WorkerSpec(**launch["spec"])
    session = Session(spec, on_pg_ready=lambda: send(control, "pg")).install()
    _tell_when_grouped(session)
    session.status(events_pb2.WorkerStatus.STARTING)
    code, detail = 0, ""
    try:
        _run_program(launch)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)  # sys.exit("message") prints it, as Python does
        detail = f"exited with code {code}"
    except BaseException as exc:  # noqa: BLE001 - the program's failure is reported, then ends us
        text = _program_traceback(exc)
        sys.stderr.write(text)
        code, detail = (130 if isinstance(exc, KeyboardInterrupt) else 1), text.strip().splitlines()[-1]
        send(control, "traceback", text=text)
    state = events_pb2.WorkerStatus.FINISHED if code == 0 else events_pb2.WorkerStatus.FAILED
    session.close(state, detail, timeout_s=1.0 if code else 5.0)
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0:  # a failure ends the attempt: nobody waits for a failed rank to check out
        _quiet_output()
        _leave_rendezvous(store, launch)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
