"""Co-located means one loopback: the same boot id and the same network namespace, both known."""

from __future__ import annotations

import os

import pytest

from encdis.pair_group import read_net_namespace, why_not_one_loopback

BOOT, NS = "0f2c-boot", "net:[4026531840]"


def test_this_process_reads_its_own_namespace_as_the_kernel_names_it() -> None:
    if not os.path.exists("/proc/self/ns/net"):
        pytest.skip("no /proc/self/ns/net (not Linux)")
    assert read_net_namespace() == os.readlink("/proc/self/ns/net")
    assert read_net_namespace().startswith("net:[")


@pytest.mark.parametrize("peer_boot, peer_ns, named", [
    ("other-boot", NS, "another host"),
    (BOOT, "net:[4026532999]", "another network namespace"),
    (BOOT, "", "another network namespace (unknown"),  # an encoder that does not say: not ours
    ("", NS, "another host"),
])
def test_a_peer_elsewhere_is_named_for_what_differs(peer_boot, peer_ns, named) -> None:
    why = why_not_one_loopback(BOOT, NS, peer_boot, peer_ns)
    assert why is not None and named in why


def test_unknown_ids_here_never_count_as_one_loopback() -> None:
    assert "boot id is unknown" in why_not_one_loopback("", NS, "", NS)
    assert "namespace is unknown" in why_not_one_loopback(BOOT, "", BOOT, "")


def test_equal_boot_id_and_namespace_is_one_loopback() -> None:
    assert why_not_one_loopback(BOOT, NS, BOOT, NS) is None
