"""The one ``host:port`` rule (delayd.address), as a table: what it reads, what it
refuses and what the refusal tells the user to write instead."""

from __future__ import annotations

import ast
import pathlib

import pytest

from delayd.address import Address, format_address, parse_address

ACCEPTED = [
    ("127.0.0.1:20811", ("127.0.0.1", 20811)),
    ("broker.internal:1", ("broker.internal", 1)),
    ("localhost:65535", ("localhost", 65535)),
    ("[::1]:20811", ("::1", 20811)),
    ("[fe80::1%eth0]:20811", ("fe80::1%eth0", 20811)),
    ("[2001:db8::7]:80", ("2001:db8::7", 80)),
    ("h:020811", ("h", 20811)),
]

# text -> words the error must carry (besides the text itself)
REFUSED = [
    ("::1:20811", "brackets, as in [::1]:20811"),
    ("fe80::1", "[fe80::1]:PORT"),
    ("2001:db8::7:443", "[2001:db8::7]:443 if 443 is the port, else [2001:db8::7:443]:PORT"),
    ("fe80::zz:1", "[::1]:20811"),
    ("127.0.0.1", "no port"),
    ("[::1]", "no port"),
    ("localhost", "no port"),
    (":20811", "no host"),
    ("[::1]:", "port must be a number 1 to 65535"),
    ("host:", "port must be a number 1 to 65535"),
    ("host:0", "port must be 1 to 65535, not 0"),
    ("host:65536", "port must be 1 to 65535, not 65536"),
    ("host:99999999999", "not 99999999999"),
    ("host:port", "port must be a number"),
    ("host:+80", "port must be a number"),
    ("host:-1", "port must be a number"),
    ("host:\uff12\uff10\uff18\uff11\uff11", "port must be a number"),  # full-width 20811
    ("host:١٢", "port must be a number"),  # Arabic-Indic digits
    (" host:20811", "white space"),
    ("host:20811\n", "white space"),
    ("ho st:20811", "white space"),
    ("[localhost]:20811", "not an IPv6 address"),
    ("[::1:20811", "close the bracket"),
    ("::1]:20811", "brackets"),
    ("host]:20811", "brackets"),
    ("", "no port"),
]


@pytest.mark.parametrize(("text", "expected"), ACCEPTED)
def test_accepted(text: str, expected: tuple[str, int]) -> None:
    address = parse_address(text)
    assert address == expected and isinstance(address, Address)
    assert address.host == expected[0] and address.port == expected[1]


@pytest.mark.parametrize(("text", "words"), REFUSED)
def test_refused_naming_the_text_and_the_fix(text: str, words: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_address(text)
    message = str(caught.value)
    assert repr(text) in message
    assert words in message


def test_refusals_without_a_specific_fix_show_examples() -> None:
    for text in ("127.0.0.1", ":20811", " h:1"):
        with pytest.raises(ValueError, match=r'"127\.0\.0\.1:20811".*"\[::1\]:20811"'):
            parse_address(text)


def test_port_zero_only_when_the_caller_binds_a_free_port() -> None:
    assert parse_address("127.0.0.1:0", allow_port_zero=True) == ("127.0.0.1", 0)
    assert parse_address("[::]:0", allow_port_zero=True) == ("::", 0)
    with pytest.raises(ValueError, match=r"0 to 65535 \(0: a free port\), not 65536"):
        parse_address("h:65536", allow_port_zero=True)
    with pytest.raises(ValueError, match="1 to 65535, not 0"):
        parse_address("127.0.0.1:0")


def test_not_a_string() -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_address(("127.0.0.1", 20811))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("host", "port", "text"),
    [
        ("127.0.0.1", 1, "127.0.0.1:1"),
        ("::1", 20811, "[::1]:20811"),
        ("b.internal", 9, "b.internal:9"),
    ],
)
def test_format_round_trips(host: str, port: int, text: str) -> None:
    assert format_address(host, port) == text
    assert str(Address(host, port)) == text
    assert parse_address(text) == (host, port)


def test_the_rule_is_a_leaf_every_layer_may_import() -> None:
    source = pathlib.Path(__file__).resolve().parent.parent / "delayd" / "address.py"
    imported = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    assert not {name for name in imported if name.split(".")[0] == "delayd"}
