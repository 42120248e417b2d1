"""Turning the LLM node's encoder targets (`host:port`) into encoder addresses.

A target is an IP literal (one encoder) or a DNS name (every address it resolves to is
an encoder: a Kubernetes headless Service resolves to all ready encoder pods). Names go
to the system resolver (getaddrinfo: /etc/hosts, search domains, as every other program
on the host) unless `--dns-server HOST:PORT` names a DNS server, which is then asked
directly with dnspython (tests run their own server on loopback this way).

`resolve` distinguishes "the name has no addresses" (an empty list: the encoders are
gone) from "could not ask" (None: keep what we had), so a DNS hiccup never empties the
pool.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket

log = logging.getLogger(__name__)


def split_host_port(target: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` -> (host, port); ValueError naming the problem."""
    t = target.strip()
    if t.startswith("["):
        host, sep, rest = t[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"encoder address {target!r}: expected [IPv6]:port")
        port_text = rest[1:]
    else:
        host, sep, port_text = t.rpartition(":")
        if not sep or not host:
            raise ValueError(f"encoder address {target!r}: expected host:port")
        if ":" in host:
            raise ValueError(f"encoder address {target!r}: write IPv6 addresses as [addr]:port")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"encoder address {target!r}: port {port_text!r} is not a number") from None
    if not 0 < port < 65536:
        raise ValueError(f"encoder address {target!r}: port {port} out of range")
    return host, port


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class Resolver:
    """Resolves host names to IP addresses with the system resolver or one DNS server."""

    def __init__(self, dns_server: str | None = None, *, timeout: float = 2.0) -> None:
        self.timeout = timeout
        self._dns = None
        if dns_server:
            import dns.asyncresolver

            host, port = split_host_port(dns_server)
            if not is_ip_literal(host):
                raise ValueError(f"--dns-server {dns_server!r}: give the server as IP:port")
            r = dns.asyncresolver.Resolver(configure=False)
            r.nameservers = [host]
            r.port = port
            r.timeout = timeout
            r.lifetime = timeout
            self._dns = r

    async def resolve(self, host: str) -> list[str] | None:
        """Sorted unique IP addresses of `host`; [] if it has none; None if the lookup failed."""
        if is_ip_literal(host):
            return [host]
        if self._dns is not None:
            return await self._resolve_dns(host)
        return await self._resolve_system(host)

    async def _resolve_system(self, host: str) -> list[str] | None:
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(host, None, type=socket.SOCK_STREAM), timeout=self.timeout
            )
        except socket.gaierror as e:
            if e.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
                return []
            log.warning("resolving %s failed: %s; keeping its previous addresses", host, e)
            return None
        except (TimeoutError, asyncio.TimeoutError, OSError) as e:
            log.warning("resolving %s failed: %r; keeping its previous addresses", host, e)
            return None
        return sorted({info[4][0] for info in infos})

    async def _resolve_dns(self, host: str) -> list[str] | None:
        import dns.exception
        import dns.resolver

        addresses: set[str] = set()
        for rdtype in ("A", "AAAA"):
            try:
                answer = await self._dns.resolve(host, rdtype, search=False)
            except dns.resolver.NXDOMAIN:
                return []
            except dns.resolver.NoAnswer:
                continue
            except (dns.exception.DNSException, OSError) as e:
                log.warning("resolving %s %s at %s failed: %s; keeping its previous addresses",
                            host, rdtype, self._dns.nameservers, e)
                return None
            addresses.update(r.address for r in answer)
        return sorted(addresses)
