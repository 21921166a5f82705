"""The one host:port parser (elaunch.rendezvous.endpoint), as the CLI and the backends use it."""

from __future__ import annotations

import re

import pytest

from elaunch.rendezvous.contract import RendezvousConfigError
from elaunch.rendezvous.endpoint import parse_endpoint, parse_endpoints

# ---- the command line's form: brackets around IPv6, port 1-65535 ----


@pytest.mark.parametrize(
    "text, expected",
    [("h:1", ("h", 1)), ("h", ("h", None)), ("[::1]:29400", ("::1", 29400)), ("[fe80::1]", ("fe80::1", None))],
)
def test_strict_form(text, expected):
    assert parse_endpoint(text) == expected


@pytest.mark.parametrize("text", ["h:65536", "h:0", "h:x", ":1", "a:b:c", "[::1", "[::1]x", "h h:1", "::1"])
def test_strict_form_rejects(text):
    with pytest.raises(RendezvousConfigError, match=f"--rdzv-endpoint={re.escape(text)}"):
        parse_endpoint(text)
    assert parse_endpoint("h:0", allow_zero=True) == ("h", 0)


# ---- the backends' form (torch's parse_rendezvous_endpoint): port 0 and bare IPv6 too ----


@pytest.mark.parametrize("endpoint,expected", [
    ("", ("localhost", 7)), ("host", ("host", 7)), ("host:0", ("host", 0)), ("1.2.3.4:29400", ("1.2.3.4", 29400)),
    ("[::1]:80", ("::1", 80)), ("[::1]", ("::1", 7)), ("::1", ("::1", 7)), ("a.b-c:1", ("a.b-c", 1)),
])
def test_backend_form(endpoint, expected):
    assert parse_endpoint(endpoint, 7, allow_zero=True, bare_ipv6=True) == expected


@pytest.mark.parametrize("endpoint", ["host:x", "host:-1", "ho st:1", ":80", "host:99999"])
def test_backend_form_rejects(endpoint):
    with pytest.raises(RendezvousConfigError, match="--rdzv-endpoint="):
        parse_endpoint(endpoint, 7, allow_zero=True, bare_ipv6=True)


# ---- etcd server lists ----


def test_list_form():
    assert parse_endpoints("http://a:1, https://b/ ,[::1]:3", 2379) == (("a", 1), ("b", 2379), ("::1", 3))


@pytest.mark.parametrize("text, needle", [
    ("", "an etcd backend needs host"), ("a:1,,b:2", "empty endpoint"), ("a:0", "port '0'"), ("a:1,b:x", "port 'x'"),
])
def test_list_form_rejects(text, needle):
    with pytest.raises(RendezvousConfigError, match=needle):
        parse_endpoints(text, 2379)
