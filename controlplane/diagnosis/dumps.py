"""Native PyTorch flight-recorder dumps: find them, read them safely, make traces.

A dump folder holds one file per rank named ``<prefix><rank>`` (``torchfrtrace``'s
convention), each a pickle (``_dump_fr_trace``, ``_dump_nccl_trace``) or JSON
(``_dump_fr_trace_json``) document of format version 2.x with keys ``version,
pg_config, pg_status, entries``.

What is read, and how:
  * Pickles go through an unpickler that refuses every global, so a dump can only
    produce plain data: opening a dump from someone else's job runs none of their code.
  * Any unreadable file (truncated, corrupt, not a dump, unknown major version) stops
    the analysis with one ``DumpError`` naming the file; a rank with no file is reported
    as missing, and the analysis goes on with the others.
  * Group membership comes from ``pg_config`` when the backend fills it (NCCL). torch
    2.13's gloo leaves it empty, so membership is then inferred from the groups each
    rank's entries mention. (``pg_status`` is no help: gloo keys it by the rank-local
    ``pg_id``, not the group name, so ranks 2 and 3's key "1" may be group "2".)
  * This reader is an edge: op and dtype names become canonical here, once, as entries
    are read (``fleet.proto.vocab``), and an entry's completion follows the same rule as
    on the worker (``fleet.proto.flight_record``: ``retired`` or ``state == completed``).
  * Files are converted as they are read (one dump alive at a time per process); with
    many files a pool of processes shares the reading, each sending back compact traces.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import multiprocessing
import os
import pickle
import re
from array import array
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from operator import itemgetter
from pathlib import Path
from typing import Any

from fleet.controlplane.diagnosis.traces import GroupOps, GroupStatus, RankTrace, SignatureTable, TraceBuilder, TraceSet
from fleet.controlplane.errors import DumpError
from fleet.proto.flight_record import dtype_names, entry_op, is_done
from fleet.proto.kinds import Timing
from fleet.proto.vocab import split_op

#: Format major versions this reader understands (torch 2.x writes "2.<minor>").
SUPPORTED_MAJOR = 2

#: Below this many files the pool costs more than it saves.
POOL_MIN_FILES = 32

_NAME = re.compile(r"^(.*?)(\d+)$")

Progress = Callable[[int, int], None]


class _PlainDataUnpickler(pickle.Unpickler):
    """An unpickler for plain data only: dicts, lists, tuples, strings, numbers."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(
            f"the file asks for {module}.{name}; a flight-recorder dump holds only plain data")


def discover(folder: Path, prefix: str | None = None) -> dict[int, Path]:
    """The dump files of ``folder`` by rank; raises ``DumpError`` when there is nothing
    to read, or when the files do not make one set.

    Without ``prefix`` the names are ``<prefix><rank>``, the prefix inferred: one shared
    by every file, or per-host prefixes ``<prefix><host>_<rank>`` (pytorch/pytorch#140879:
    each host writes with its own name in the prefix), read as one set when those
    prefixes share a beginning, all end in ``_`` and no rank has two files. With
    ``prefix``: the files named ``<prefix><rank>``, else (when there are none) those
    named ``<prefix><anything>_<rank>``. A folder holding only folders is read through
    (every file below it)."""
    if not folder.is_dir():
        raise DumpError(f"{folder}: not a folder of flight-recorder dumps")
    by_prefix: dict[str, dict[int, Path]] = {}
    exact: dict[int, Path] = {}
    hosts: list[tuple[int, Path]] = []
    for name, path in _files(folder):
        if prefix is not None:
            rest = name[len(prefix):]
            m = _REST.match(rest) if name.startswith(prefix) else None
            if m and rest.isdigit():
                _add_file(folder, exact, int(rest), path)
            elif m:
                hosts.append((int(m.group(1)), path))
            continue
        m = _NAME.match(name)
        if m:
            by_prefix.setdefault(m.group(1), {})[int(m.group(2))] = path
    if prefix is not None:
        if not exact and not hosts:
            raise DumpError(f"{folder}: no dump files named {prefix}<rank> or {prefix}<host>_<rank>")
        if exact:  # <prefix><rank> files, when there are any, are the set
            return exact
        for rank, path in hosts:
            _add_file(folder, exact, rank, path)
        return exact
    if not by_prefix:
        raise DumpError(f"{folder}: no dump files named <prefix><rank>")
    if len(by_prefix) == 1:
        return next(iter(by_prefix.values()))
    if not _per_host(list(by_prefix)):
        counts = ", ".join(f"{p!r} ({len(f)} files)" for p, f in sorted(by_prefix.items()))
        raise DumpError(f"{folder}: files with several prefixes: {counts}; choose one with --prefix")
    chosen: dict[int, Path] = {}
    for files in by_prefix.values():
        for rank, path in files.items():
            _add_file(folder, chosen, rank, path)
    return chosen


def _files(folder: Path) -> list[tuple[str, Path]]:
    """The files to consider, by name: the folder's own, or, when it holds only folders
    (one per host, say), every file below it, as torchfrtrace walks them. Dot files (a
    dump being written) are skipped."""
    top = [(e.name, Path(e.path)) for e in os.scandir(folder) if e.is_file() and not e.name.startswith(".")]
    if top:
        return sorted(top)
    found = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [(n, Path(root) / n) for n in sorted(names) if not n.startswith(".")]
    return found


#: What follows a given --prefix: ``<rank>`` or ``<anything>_<rank>``.
_REST = re.compile(r"^(?:.*_)?(\d+)$")


def _per_host(prefixes: list[str]) -> bool:
    """Whether several inferred prefixes read as ``<prefix><host>_``: a shared beginning
    that ends in a separator (``nccl_trace_``, ``trace_node-``), then a host name and
    ``_``. Unrelated names (``fr_dump_`` and ``old_``, ``notes_`` and ``nccl_``) do not."""
    common = os.path.commonprefix(prefixes)
    return bool(_SHARED.match(common)) and all(p.endswith("_") for p in prefixes)


#: The beginning of a shared prefix up to its last separator, if it has one.
_SHARED = re.compile(r"^.*[^0-9A-Za-z]")


def _add_file(folder: Path, files: dict[int, Path], rank: int, path: Path) -> None:
    """File ``path`` as ``rank``'s dump; a second file for one rank is an error naming both."""
    other = files.get(rank)
    if other is not None:
        raise DumpError(f"{folder}: two files for rank {rank}: {other.name} and {path.name}; "
                        f"choose one set with --prefix")
    files[rank] = path


def read_document(path: Path) -> dict[str, Any]:
    """One dump file as a dict, checked for the keys and version the engine needs."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DumpError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not data:
        raise DumpError(f"{path}: empty file")
    head = data.lstrip()[:1]
    try:
        if data[:1] == b"\x80":
            doc = _PlainDataUnpickler(_BytesReader(data)).load()
        elif head == b"{":
            doc = json.loads(data)
        else:
            raise DumpError(f"{path}: not a flight-recorder dump (neither pickle nor JSON)")
    except DumpError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError,
            AttributeError, OverflowError, MemoryError, RecursionError, UnicodeDecodeError) as exc:
        kind = "pickle" if data[:1] == b"\x80" else "JSON"
        raise DumpError(f"{path}: truncated or corrupt {kind} dump ({type(exc).__name__}: {exc})") from None
    if not isinstance(doc, dict):
        raise DumpError(f"{path}: not a flight-recorder dump (top level is {type(doc).__name__}, not a dict)")
    version = doc.get("version")
    if not isinstance(version, str) or not re.fullmatch(r"\d+\.\d+", version):
        raise DumpError(f"{path}: not a flight-recorder dump (no format version)")
    if int(version.split(".")[0]) != SUPPORTED_MAJOR:
        raise DumpError(f"{path}: unsupported format version {version} (fleet reads {SUPPORTED_MAJOR}.x)")
    if not isinstance(doc.get("entries", []), list):
        raise DumpError(f"{path}: 'entries' is not a list")
    return doc


class _BytesReader:
    """A minimal file object over bytes for the unpickler. ``peek`` matters: torch
    writes protocol-2 pickles, which have no frames, and without ``peek`` the C
    unpickler calls ``read`` once per opcode (tens of millions of calls per 512 ranks)
    instead of prefetching large blocks."""

    __slots__ = ("_data", "_pos")

    def __init__(self, data: bytes) -> None:
        self._data, self._pos = data, 0

    def read(self, n: int = -1) -> bytes:
        end = len(self._data) if n < 0 else self._pos + n
        chunk = self._data[self._pos:end]
        self._pos += len(chunk)
        return chunk

    def peek(self, n: int = 0) -> bytes:
        return self._data[self._pos:self._pos + max(n, 1)]

    def readline(self) -> bytes:
        end = self._data.find(b"\n", self._pos)
        end = len(self._data) if end < 0 else end + 1
        chunk = self._data[self._pos:end]
        self._pos = end
        return chunk

    def readinto(self, buf: Any) -> int:
        chunk = self.read(len(buf))
        buf[:len(chunk)] = chunk
        return len(chunk)


def _parse_ranks(value: Any) -> list[int]:
    if isinstance(value, (list, tuple)):
        return [int(r) for r in value]
    if isinstance(value, str) and value.strip():
        parsed = json.loads(value)
        if isinstance(parsed, list):
            return [int(r) for r in parsed]
    return []


def rank_trace(rank: int, path: Path, table: SignatureTable) -> RankTrace:
    """Read one file and convert its entries (raises ``DumpError`` naming the file)."""
    doc = read_document(path)
    builder = TraceBuilder(rank, table, source=str(path))
    try:
        for name, cfg in (doc.get("pg_config") or {}).items():
            if name and isinstance(cfg, dict):
                builder.declare_group(str(name), str(cfg.get("desc", "")), _parse_ranks(cfg.get("ranks")))
    except (TypeError, ValueError, AttributeError) as exc:
        raise DumpError(f"{path}: malformed pg_config ({type(exc).__name__}: {exc})") from None
    entries = doc.get("entries") or []
    pg_ids = _convert_entries(builder, entries, table)  # names the file and entry itself
    builder.trace.dumped_ns = _dumped_ns(doc, path)
    _read_status(builder.trace, doc.get("pg_status"), pg_ids, entries)
    return builder.finish()


def _dumped_ns(doc: dict[str, Any], path: Path) -> int:
    """When the dump was written: fleet's own dumps say so (``fleet_dump.time_ns``, see
    ``fleet.workers.flight``); for others the file's modification time stands in (a copy
    that did not keep it makes every last op look old, which only matters for a rank that
    left no file)."""
    marker = doc.get("fleet_dump")
    if isinstance(marker, dict) and isinstance(marker.get("time_ns"), int):
        return marker["time_ns"]
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


#: The fields every 2.x entry has, read in one C call per entry ...
_NCCL = Timing.NCCL.wire
_CORE = itemgetter("process_group", "profiling_name", "input_sizes", "output_sizes", "input_dtypes",
                   "output_dtypes", "time_created_ns", "collective_seq_id")
#: ... and with the ones that are there in every dump torch 2.4+ writes.
_FULL = itemgetter("process_group", "profiling_name", "input_sizes", "output_sizes", "input_dtypes",
                   "output_dtypes", "time_created_ns", "collective_seq_id", "retired", "state", "is_p2p",
                   "time_discovered_completed_ns")


def _convert_entries(builder: TraceBuilder, entries: list, table: SignatureTable) -> dict[str, str]:
    """Convert the entries into the builder's trace; returns the entries' ``pg_id`` ->
    group name (how gloo keys ``pg_status``). This loop is most of a dump's reading
    cost after unpickling, so the common case (an in-order collective with a signature
    seen before) is one field fetch, two dict lookups and five list appends."""
    trace = builder.trace
    # Raw-field key -> signature id: most entries repeat a handful of signatures, so a
    # cheap key of the raw fields avoids normalising sizes and names for every entry.
    local: dict[tuple, int] = {}
    named: dict[tuple, tuple] = {}  # (profiling name, dtypes) -> canonical (op, dtypes)
    kinds: dict[str, str] = {}      # profiling name -> canonical op
    prod = math.prod
    descs = trace.group_desc
    groups = trace.groups
    appends: dict[str, tuple] = {}  # group -> (its seqs, and the appends of its other lists)
    pg_ids: dict[str, str] = {}
    timeouts = trace.group_timeout_ms
    i = 0
    try:
        for i, e in enumerate(entries):
            try:
                pg, pn, ins, outs, ind, outd, enter, seq, retired, state, is_p2p, exit_ns = _FULL(e)
            except KeyError:  # an older minor version: only the core fields are certain
                pg, pn, ins, outs, ind, outd, enter, seq = _CORE(e)
                retired, state, is_p2p = e.get("retired"), e.get("state"), e.get("is_p2p")
                exit_ns = e.get("time_discovered_completed_ns")
            group = pg[0]
            if type(group) is not str:
                group = str(group)
            if group not in descs:
                descs[group] = str(pg[1]) if len(pg) > 1 else ""
                pg_ids[str(e.get("pg_id"))] = group
                timeouts[group] = int(e.get("timeout_ms") or 0)
            kind = kinds.get(pn)
            if kind is None:
                kind = kinds[pn] = split_op(entry_op(e))[0]
            single = len(ins) == 1 and len(outs) == 1 and len(ind) == 1 and len(outd) == 1
            if kind == "all_to_all":
                # uneven splits differ per rank and step: the signature keeps the shape
                # without its first dimension, the entry what it sent minus received
                if single:
                    i0, o0 = ins[0], outs[0]
                    delta = prod(i0) - prod(o0)
                    raw = (pn, ind[0], outd[0], -2, *i0[1:], -1, *o0[1:])
                else:
                    delta = sum(map(prod, ins)) - sum(map(prod, outs))
                    raw = (pn, -2, str([d[1:] for d in ins]), str([d[1:] for d in outs]), str(ind), str(outd))
            elif single:
                delta = 0
                raw = (pn, ind[0], outd[0], *ins[0], -1, *outs[0])  # the common case, ~8x cheaper than text
            else:
                delta = 0
                raw = (pn, str(ins), str(outs), str(ind), str(outd))
            sig = local.get(raw)
            if sig is None:
                nk = pn, str(ind), str(outd)
                names = named.get(nk)
                if names is None:
                    names = named[nk] = (kind, tuple(dtype_names(ind)), tuple(dtype_names(outd)))
                if kind == "all_to_all":
                    sizes = (tuple((-1, *map(int, d[1:])) for d in ins or ()),
                             tuple((-1, *map(int, d[1:])) for d in outs or ()))
                elif single:
                    sizes = (tuple(map(int, ins[0])),), (tuple(map(int, outs[0])),)
                else:
                    sizes = (tuple(tuple(map(int, d)) for d in ins or ()),
                             tuple(tuple(map(int, d)) for d in outs or ()))
                sig = local[raw] = table.intern_key((names[0], *sizes, names[1], names[2]))
            done = is_done(retired, state)
            if type(enter) is not int:
                enter = int(enter or 0)
            if is_p2p:
                op, meta = split_op(entry_op(e))
                builder.add_p2p(group, op, meta, int(e.get("p2p_seq_id") or 0), sig, enter, done)
                continue
            if type(seq) is not int:
                seq = int(seq)
            if seq <= 0:
                continue
            if type(exit_ns) is not int:
                exit_ns = int(exit_ns or 0)
            # NCCL's device timing (TORCH_NCCL_ENABLE_TIMING=1): the only measured duration a dump has
            dur = e.get("duration_ms")
            dur_ns = int(dur * 1e6) if done and type(dur) in (float, int) and dur > 0 else 0
            app = appends.get(group)
            if app is None:
                ops = groups.get(group)
                if ops is None:
                    ops = groups[group] = GroupOps()
                app = appends[group] = (ops.seqs, ops.sigs.append, ops.enter_ns.append, ops.exit_ns.append,
                                        ops.done.append, ops.delta.append, ops.dur_ns.append, ops.timing.append)
            seqs = app[0]
            if seqs and seq <= seqs[-1]:  # coalesced or out of order: the builder's slow path
                builder.add_collective(group, seq, sig, enter, exit_ns, done, delta, dur_ns, _NCCL if dur_ns else 0)
                continue
            seqs.append(seq)
            app[1](sig)
            app[2](enter)
            app[3](exit_ns)
            app[4](done)
            app[5](delta)
            app[6](dur_ns)
            app[7](_NCCL if dur_ns else 0)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        e = entries[i]
        if not isinstance(e, dict):
            raise DumpError(f"{trace.source}: entry {i} is {type(e).__name__}, not a dict") from None
        raise DumpError(f"{trace.source}: malformed entry {i} ({type(exc).__name__}: {exc})") from None
    if entries:
        try:
            trace.first_record = int(entries[0].get("record_id") or 0)
        except (TypeError, ValueError):
            raise DumpError(f"{trace.source}: malformed entry 0 (record_id)") from None
    trace.entries = len(entries)
    return pg_ids


def _read_status(trace: RankTrace, status: Any, pg_ids: dict[str, str], entries: list) -> None:
    """The dump's ``pg_status`` counters by group name.

    NCCL keys them by group name; gloo by the rank-local ``pg_id``, which the entries map
    to a name (``pg_ids``). A key neither maps is kept only when it is a group the dump
    declares (``pg_config``), or ``"0"``, the world under either scheme. gloo's counters
    include point-to-point ops it never records, so they are flagged as such (its
    entries' state is always ``scheduled``)."""
    if not isinstance(status, dict):
        return
    gloo_like = bool(entries) and all(e.get("state") == "scheduled" for e in entries[-8:])
    for key, counters in status.items():
        key = str(key)
        name = pg_ids.get(key) or (key if key in trace.group_ranks or key == "0" else None)
        if name is None or not isinstance(counters, dict):
            continue
        try:
            trace.status[name] = GroupStatus(
                int(counters.get("last_enqueued_collective", -1)),
                int(counters.get("last_started_collective", -1)),
                int(counters.get("last_completed_collective", -1)), counts_p2p=gloo_like)
        except (TypeError, ValueError):
            raise DumpError(f"{trace.source}: malformed pg_status for group {key!r}") from None


def _read_chunk(items: list[tuple[int, str]]) -> tuple[list[RankTrace], list]:
    """Pool task: convert some files with a private signature table (keys sent back)."""
    table = SignatureTable()
    with no_gc():
        traces = [rank_trace(rank, Path(path), table) for rank, path in items]
        for t in traces:
            for ops in t.groups.values():
                ops.compact()
    keys = [(s.op, s.input_sizes, s.output_sizes, s.input_dtypes, s.output_dtypes) for s in table.sigs]
    return traces, keys


def _remap(trace: RankTrace, mapping: list[int]) -> None:
    for ops in trace.groups.values():
        ops.sigs = array("q", map(mapping.__getitem__, ops.sigs))  # type: ignore[assignment]
    for p2p in trace.p2p.values():
        for op in p2p:
            op.sig = mapping[op.sig]


def load_traces(folder: str | os.PathLike, prefix: str | None = None, *, workers: int | None = None,
                progress: Progress | None = None) -> TraceSet:
    """Every rank's trace from a folder of native dumps.

    ``workers``: reader processes (default: the CPUs, when there are enough files);
    ``progress(done, total)`` is called as files finish."""
    with no_gc():
        return _load(Path(folder), prefix, workers, progress)


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Cyclic GC off while dumps load: they allocate millions of objects that are never
    cyclic, and each full collection would walk every trace kept so far (quadratic)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _load(folder: Path, prefix: str | None, workers: int | None, progress: Progress | None) -> TraceSet:
    files = discover(folder, prefix)
    table = SignatureTable()
    ranks: dict[int, RankTrace] = {}
    items = sorted((rank, str(path)) for rank, path in files.items())
    n_workers = workers if workers is not None else (os.cpu_count() or 1)
    if n_workers > 1 and len(items) >= POOL_MIN_FILES:
        chunk = max(4, len(items) // (n_workers * 4))
        chunks = [items[i:i + chunk] for i in range(0, len(items), chunk)]
        done = 0
        ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
        with ProcessPoolExecutor(max_workers=n_workers, mp_context=ctx) as pool:
            for traces, keys in pool.map(_read_chunk, chunks):
                mapping = [table.intern_key(k) for k in keys]
                for t in traces:
                    _remap(t, mapping)
                    ranks[t.rank] = t
                done += len(traces)
                if progress:
                    progress(done, len(items))
    else:
        for n, (rank, path) in enumerate(items, 1):
            ranks[rank] = rank_trace(rank, Path(path), table)
            if progress:
                progress(n, len(items))
    return TraceSet(source=f"dumps:{folder}", ranks=ranks, table=table)

