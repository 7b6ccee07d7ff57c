"""Egress allowlist rules (issue 19 item 10): parsing, named sets, what a DNS answer may pin; the DNS
proxy's wire-format helpers on hand-made messages."""

from __future__ import annotations

import socket
import struct

import pytest

from shoal.egress import EgressPolicy, check_network, parse_rules
from shoal.errors import InvalidRequest
from shoal.node.dnsproxy import filter_answer, parse_question, reply


def test_rules_parse_and_expand_named_sets() -> None:
    p = parse_rules(["pypi", "*.example.com:443", "203.0.113.0/24:8000-8100", "198.51.100.7", "git.corp.test"])
    assert p.ports_for("pypi.org") == [(443, 443)] and p.ports_for("files.pythonhosted.org") == [(443, 443)]
    assert p.ports_for("a.b.example.com") == [(443, 443)] and p.ports_for("example.com") == []
    assert p.ports_for("GIT.corp.test.") == [(1, 65535)]
    assert p.ports_for("evil.test") == []
    assert [(str(c.net), c.ports) for c in p.cidrs] == [("203.0.113.0/24", (8000, 8100)),
                                                        ("198.51.100.7/32", (1, 65535))]
    assert EgressPolicy.from_dict(p.to_dict()) == p
    custom = parse_rules(["corp"], {"corp": ["10.1.0.0/16:443"]})
    assert [str(c.net) for c in custom.cidrs] == ["10.1.0.0/16"]


def test_answers_never_pin_private_or_link_local_unless_named() -> None:
    p = parse_rules(["x.test", "10.1.0.0/16"])
    assert p.allows_address("198.18.0.1")
    assert not p.allows_address("169.254.169.254") and not p.allows_address("10.89.0.1")
    assert not p.allows_address("192.168.1.1") and not p.allows_address("127.0.0.1")
    assert p.allows_address("10.1.2.3")  # named by a CIDR rule


@pytest.mark.parametrize("bad", [["nodots"], ["a..b"], ["x.test:0"], ["x.test:70000"], ["1.2.3.4/33"],
                                 ["::1"], [""], [5], "pypi.org", [], ["1.2.3.999"]])
def test_bad_rules_are_refused_with_the_rule_named(bad: object) -> None:
    with pytest.raises(InvalidRequest):
        check_network(bad)


def _query(name: str, qtype: int = 1) -> bytes:
    q = b"".join(bytes([len(x)]) + x.encode() for x in name.split(".")) + b"\0"
    return struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0) + q + struct.pack(">HH", qtype, 1)


def test_dns_wire_helpers() -> None:
    q = _query("Allowed.Test")
    assert parse_question(q) == (0x1234, "allowed.test", 1)
    nx = reply(q, 3)
    assert struct.unpack(">HHHHHH", nx[:12]) == (0x1234, 0x8183, 1, 0, 0, 0)
    # an answer: a CNAME to cdn.test, then two A records of cdn.test, one private (compressed names)
    cname_target = b"\x03cdn\x04test\x00"
    ans = b"\xc0\x0c" + struct.pack(">HHIH", 5, 1, 60, len(cname_target)) + cname_target
    tgt = 12 + len(q) - 12 + 12  # offset of cdn.test inside the message
    ans += struct.pack(">H", 0xC000 | tgt) + struct.pack(">HHIH", 1, 1, 60, 4) + socket.inet_aton("10.0.0.5")
    ans += struct.pack(">H", 0xC000 | tgt) + struct.pack(">HHIH", 1, 1, 60, 4) + socket.inet_aton("198.18.1.1")
    resp = q[:2] + struct.pack(">HHHHH", 0x8180, 1, 3, 0, 0) + q[12:] + ans
    out, ips = filter_answer(resp, parse_rules(["allowed.test"]).allows_address)
    assert ips == ["198.18.1.1"]
    assert struct.unpack(">H", out[6:8])[0] == 2  # the CNAME and the public A record
    assert socket.inet_aton("10.0.0.5") not in out and b"\x03cdn\x04test\x00" in out


# ---- issue 23: protected destinations, the operator's grants, non-overlapping set elements ----------
def test_overlapping_rules_become_disjoint_boxes() -> None:
    import ipaddress

    from shoal.egress import box, box_text, covered, disjoint

    n = ipaddress.IPv4Network
    boxes = [box(n("198.51.100.0/24"), (80, 80)), box(n("198.51.100.2/32"), (8080, 8080)),
             box(n("198.51.100.0/24"), (8000, 8050))]
    out = disjoint(boxes)
    # no two boxes overlap in both addresses and ports, and together they cover exactly the input
    for i, a in enumerate(out):
        for b in out[i + 1:]:
            assert not (a[0] <= b[1] and b[0] <= a[1] and a[2] <= b[3] and b[2] <= a[3]), (a, b)
    for b in boxes:
        assert covered(b, out)
    assert not covered(box(n("198.51.100.2/32"), (8051, 8051)), out)
    assert {box_text(b) for b in out} == {"198.51.100.0/31", "198.51.100.2", "198.51.100.3-198.51.100.255"}


def test_rules_into_protected_ranges_need_a_grant() -> None:
    import ipaddress

    from shoal.egress import check_policy, parse_grants
    from shoal.errors import EgressForbidden

    cluster = [ipaddress.IPv4Network("198.18.3.1/32")]
    for rule, kind in (("0.0.0.0/0", None), ("169.254.169.254/32:80", "metadata"), ("10.1.2.3:5432", "private"),
                       ("100.64.0.0/10", "private"), ("198.18.3.0/24", "cluster"), ("127.0.0.1", "reserved")):
        with pytest.raises(EgressForbidden, match="network rule") as ei:
            check_policy(parse_rules([rule]), parse_grants([]), cluster)
        assert ei.value.details["rule"] == rule and (kind is None or ei.value.details["kind"] == kind)
        assert ei.value.http_status == 403
    # public rules and domains need nothing; granted ones pass, and only as far as granted
    check_policy(parse_rules(["203.0.113.0/24:5432", "pypi", "198.18.4.0/24"]), parse_grants([]), cluster)
    check_policy(parse_rules(["10.1.2.3:5432"]), parse_grants(["10.1.0.0/16:5432"]), cluster)
    check_policy(parse_rules(["10.1.2.3", "192.168.1.0/24:22"]), parse_grants(["private"]), cluster)
    check_policy(parse_rules(["198.18.3.1:6379"]), parse_grants(["cluster"]), cluster)
    with pytest.raises(EgressForbidden):
        check_policy(parse_rules(["10.1.2.3:5433"]), parse_grants(["10.1.0.0/16:5432"]), cluster)
    with pytest.raises(InvalidRequest, match="neither a keyword"):
        parse_grants(["intranet"])
