"""A DNS server of the tests' own on 127.0.0.1: authoritative A records that tests change live.

It stands in for a Kubernetes headless Service's DNS name: the LLM node is pointed at it
with --dns-server, and tests add or remove encoder addresses while traffic flows. Answers
have TTL 0 so nothing caches the pool; unknown names get NXDOMAIN; other record types of a
known name (AAAA) an empty NOERROR answer.
"""

from __future__ import annotations

import socket
import threading

import dns.flags
import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset


class LoopbackDNS:
    def __init__(self) -> None:
        self._records: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self.queries = 0
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="loopback-dns", daemon=True)
        self._thread.start()

    def set_addresses(self, name: str, addresses: list[str]) -> None:
        """Answer `name` with these A records (an empty list: the name exists, no addresses)."""
        with self._lock:
            self._records[name.lower().rstrip(".")] = list(addresses)

    def remove(self, name: str) -> None:
        """`name` no longer exists (NXDOMAIN)."""
        with self._lock:
            self._records.pop(name.lower().rstrip("."), None)

    def _answer(self, data: bytes) -> bytes:
        query = dns.message.from_wire(data)
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        question = query.question[0]
        with self._lock:
            addresses = self._records.get(question.name.to_text(omit_final_dot=True).lower())
        if addresses is None:
            response.set_rcode(dns.rcode.NXDOMAIN)
        elif question.rdtype == dns.rdatatype.A and addresses:
            response.answer.append(
                dns.rrset.from_text_list(question.name, 0, dns.rdataclass.IN, dns.rdatatype.A, addresses)
            )
        return response.to_wire()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self.sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            self.queries += 1
            try:
                self.sock.sendto(self._answer(data), peer)
            except Exception:  # noqa: BLE001 - a malformed query must not stop the server
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
