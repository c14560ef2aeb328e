"""cluster.yaml's network addresses: loopback by default, bad ones named by key, what agents dial."""

from __future__ import annotations

import pytest

from fleet.controlplane.addresses import check_host, check_ray_address, dial_host, join_host_port, port_of
from fleet.controlplane.config import parse_cluster_yaml
from fleet.controlplane.errors import ConfigError

SRC = "cluster.yaml"


def test_every_listen_address_is_loopback_by_default() -> None:
    cfg = parse_cluster_yaml("{}", SRC)
    assert (cfg.controller.host, cfg.controller.advertise_host, cfg.agent.host) == ("127.0.0.1", None, "127.0.0.1")
    assert cfg.ray.address is None


def test_addresses_are_read_from_their_keys() -> None:
    cfg = parse_cluster_yaml(
        "ray: {address: '10.0.0.1:6379'}\ncontroller: {host: 0.0.0.0, advertise_host: head.example.com}\n"
        "agent: {host: localhost}\n", SRC)
    assert cfg.ray.address == "10.0.0.1:6379"
    assert (cfg.controller.host, cfg.controller.advertise_host, cfg.agent.host) == \
        ("0.0.0.0", "head.example.com", "localhost")
    assert parse_cluster_yaml("ray: {address: auto}", SRC).ray.address == "auto"
    assert parse_cluster_yaml("controller: {host: '::1'}", SRC).controller.host == "::1"


@pytest.mark.parametrize(("text", "key", "words"), [
    ("controller: {host: '127.0.0.1:5000'}", "controller.host", "without a port"),
    ("controller: {host: ''}", "controller.host", "cannot be empty"),
    ("controller: {host: 'http://x'}", "controller.host", "is not a host"),
    ("controller: {host: 'bad_name!'}", "controller.host", "valid host name"),
    ("controller: {host: '300.1.1.1'}", "controller.host", "valid host name"),
    ("controller: {advertise_host: 0.0.0.0}", "controller.advertise_host", "agents can dial"),
    ("controller: {advertise_host: 'a b'}", "controller.advertise_host", "is not a host"),
    ("agent: {host: '127.0.0.1:1'}", "agent.host", "without a port"),
    ("agent: {host: '-x.example'}", "agent.host", "valid host name"),
    ("ray: {address: '10.0.0.1'}", "ray.address", "HOST:PORT"),
    ("ray: {address: '10.0.0.1:99999'}", "ray.address", "1..65535"),
    ("ray: {address: '10.0.0.1:port'}", "ray.address", "1..65535"),
    ("ray: {address: 'ray://10.0.0.1:10001'}", "ray.address", "not a URL"),
    ("ray: {address: '0.0.0.0:6379'}", "ray.address", "not an address to connect to"),
    ("ray: {address: 'bad host:6379'}", "ray.address", "is not a host"),
])
def test_a_bad_address_is_one_line_naming_the_key(text: str, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_cluster_yaml(text, SRC)
    message = str(err.value)
    assert "\n" not in message
    assert key in message and words in message, message


def test_hosts_accepted_and_refused() -> None:
    for good in ("127.0.0.1", "0.0.0.0", "::", "::1", "[::1]", "localhost", "node-7.cluster.local", "h."):
        assert check_host(good) == good
    for bad in ("", "1.2.3.4:5", "a..b", "x" * 64, "1.2.3", "héllo"):
        with pytest.raises(ValueError):
            check_host(bad)
    assert check_ray_address("[::1]:6379") == "[::1]:6379"


def test_agents_dial_the_advertised_host_then_the_bound_one_then_the_node_ip() -> None:
    assert dial_host("0.0.0.0", "head.example.com", "10.0.0.5") == "head.example.com"
    assert dial_host("10.0.0.5", None, "") == "10.0.0.5"
    assert dial_host("127.0.0.1", None, "10.0.0.5") == "127.0.0.1"
    assert dial_host("0.0.0.0", None, "10.0.0.5") == "10.0.0.5"
    assert dial_host("::", None, "fd00::5") == "fd00::5"


def test_host_and_port_join_and_split() -> None:
    assert join_host_port("10.0.0.5", 7000) == "10.0.0.5:7000"
    assert join_host_port("fd00::5", 7000) == "[fd00::5]:7000"
    assert join_host_port("[fd00::5]", 7000) == "[fd00::5]:7000"
    assert port_of("0.0.0.0:4242") == 4242 and port_of("[::1]:4242") == 4242
