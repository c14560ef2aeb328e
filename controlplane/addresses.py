"""Network addresses of cluster.yaml: what the controller and the agents bind, what agents dial.

Every listening socket fleet opens is named by cluster.yaml and is loopback by default:
``controller.host`` (the controller's gRPC and metrics servers), ``agent.host`` (each node
agent's worker channel, bound on every node, so it must exist on each: loopback or a
wildcard). Agents dial the controller at ``controller.advertise_host`` when set, else at
``controller.host``, except that a wildcard bind (``0.0.0.0``, ``::``) is not an address
anyone can dial from another host: then they dial the IP Ray reports for the node the
controller runs on (``dial_host``).

``check_host``/``check_ray_address`` are the validators cluster.yaml's schema uses; they
raise ``ValueError`` with one line saying what is wrong (the schema adds the key).
Pure: no sockets, no Ray.
"""

from __future__ import annotations

import ipaddress
import re

_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
_WILDCARDS = frozenset({"0.0.0.0", "::", "[::]"})


def check_host(value: str) -> str:
    """``value`` if it is an IP address or a DNS host name (no port, no scheme); else ValueError."""
    if not value:
        raise ValueError("an address cannot be empty")
    if any(c.isspace() for c in value) or "/" in value:
        raise ValueError(f"{value!r} is not a host (an IP address or a host name, without scheme or path)")
    bare = value[1:-1] if value.startswith("[") and value.endswith("]") else value
    try:
        ipaddress.ip_address(bare)
        return value
    except ValueError:
        pass
    if ":" in value:
        raise ValueError(f"{value!r} is not a host: give the address without a port (the port has its own key)")
    name = value.removesuffix(".")
    if len(name) > 253 or not all(_LABEL.match(label) for label in name.split(".")) or name.replace(".", "").isdigit():
        raise ValueError(f"{value!r} is not an IP address or a valid host name")
    return value


def is_wildcard(host: str) -> bool:
    """Whether binding ``host`` listens on every interface (not an address to dial)."""
    return host in _WILDCARDS


def check_ray_address(value: str) -> str:
    """``value`` if it is ``auto`` or a Ray GCS address ``HOST:PORT``; else ValueError."""
    if value == "auto":
        return value
    if "://" in value:
        raise ValueError(f"{value!r}: give the Ray cluster's GCS address as HOST:PORT (what `ray start --head` "
                         "prints), not a URL; `fleet up` runs on a node of the cluster, Ray Client is not supported")
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{value!r} is not HOST:PORT (e.g. 10.0.0.1:6379) or auto")
    try:
        check_host(host)
    except ValueError as exc:
        raise ValueError(f"{value!r}: {exc}") from None
    if is_wildcard(host):
        raise ValueError(f"{value!r}: {host} is not an address to connect to")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{value!r}: the port must be a number in 1..65535")
    return value


def join_host_port(host: str, port: int) -> str:
    """``host:port`` as gRPC dials it (an IPv6 literal in brackets)."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def dial_host(bind_host: str, advertise_host: str | None, node_ip: str) -> str:
    """The host agents dial to reach a controller bound to ``bind_host``: ``advertise_host`` when
    set, else ``bind_host``, else (a wildcard bind) ``node_ip``, the controller's node as Ray
    reports it."""
    if advertise_host:
        return advertise_host
    return node_ip if is_wildcard(bind_host) else bind_host


def port_of(address: str) -> int:
    """The port of a ``host:port`` address (IPv6 hosts bracketed or not)."""
    return int(address.rsplit(":", 1)[1])
