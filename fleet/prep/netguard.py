"""The network under URL collection: which addresses may be reached, and for how long.

``AddressPolicy`` resolves a host and keeps only addresses on the public internet: loopback,
private, link-local (169.254.169.254, the cloud metadata address), CGNAT (100.64/10),
multicast, reserved and unspecified addresses are refused, IPv4 addresses embedded in IPv6
(mapped, 6to4, Teredo, NAT64) judged as the IPv4 address, unless the host name or the network
is listed as an exception. No address left: ``AddressRefused``.

``GuardedBackend`` is the httpcore network backend of the collector's connection pool. It asks
the policy at every connect and connects to the address the policy returned, so DNS answering
differently between the check and the connect (rebinding) changes nothing; the URL's host name
still goes out as the Host header and TLS server name and is what the certificate is checked
against. Every socket operation gets at most what is left of the current fetch's deadline (per
thread), so a server trickling one byte per read cannot stretch a fetch past it, headers
included: the read then fails with ``httpcore.ReadTimeout``.
"""

from __future__ import annotations

import ipaddress
import math
import socket
import ssl
import threading
from collections.abc import Callable, Iterable
from typing import Any

import httpcore


class AddressRefused(Exception):
    """The host resolves to no address the policy allows (or cannot be resolved)."""


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _is_public(ip: IPAddress) -> bool:
    """Reachable on the public internet: not loopback, private, link-local (169.254.169.254, the
    cloud metadata address, included), CGNAT, multicast, reserved or unspecified; IPv4 addresses
    embedded in IPv6 (mapped, 6to4, Teredo, NAT64) are judged as the IPv4 address."""
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            return _is_public(embedded)
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_unspecified)


class AddressPolicy:
    """Which addresses URL sources may connect to: public ones, plus the settings' exceptions."""

    def __init__(self, allow_hosts: Iterable[str], allow_networks: Iterable[IPNetwork],
                 resolve: Callable[..., list[Any]] = socket.getaddrinfo) -> None:
        self._hosts = {h.lower().rstrip(".") for h in allow_hosts}
        self._networks = list(allow_networks)
        self._resolve = resolve

    def allowed(self, host: str, port: int) -> list[str]:
        """The addresses ``host`` resolves to that may be reached, else SourceError."""
        try:
            infos = self._resolve(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise AddressRefused(f"cannot resolve {host!r} ({exc})") from exc
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
        if host.lower().rstrip(".") in self._hosts:
            return addresses
        allowed = [a for a in addresses if self._allows(ipaddress.ip_address(a.split("%", 1)[0]))]
        if not allowed:
            raise AddressRefused(
                f"{host!r} resolves to {', '.join(addresses)}: not a public address "
                "(collect.allow_hosts / collect.allow_networks list the exceptions)"
            )
        return allowed

    def _allows(self, ip: IPAddress) -> bool:
        return _is_public(ip) or any(ip in net for net in self._networks)


class _Deadline(threading.local):
    """The current fetch's deadline (clock reading), per thread: the pool is shared by threads."""

    at: float = math.inf


class GuardedBackend(httpcore.NetworkBackend):
    """The network under the HTTP pool: every connection goes to the address ``AddressPolicy``
    checked (resolved once, so DNS cannot rebind between check and connect; TLS still verifies
    the URL's host name), and no socket call outlives the fetch's deadline, so a server trickling
    one byte per read cannot stretch a fetch, headers included."""

    def __init__(self, policy: AddressPolicy, clock: Callable[[], float],
                 inner: httpcore.NetworkBackend | None = None) -> None:
        self.policy = policy
        self.clock = clock
        self.deadline = _Deadline()
        self._inner = inner or httpcore.SyncBackend()

    def left(self, timeout: float | None) -> float:
        left = self.deadline.at - self.clock()
        if left <= 0:
            raise httpcore.ReadTimeout("the fetch deadline passed")
        return left if timeout is None else min(timeout, left)

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        failure: httpcore.ConnectError | None = None
        for address in self.policy.allowed(host, port):  # like socket.create_connection
            try:
                stream = self._inner.connect_tcp(address, port, timeout=self.left(timeout),
                                                 local_address=local_address,
                                                 socket_options=socket_options)
            except httpcore.ConnectError as exc:
                failure = exc
                continue
            return _DeadlineStream(stream, self)
        raise failure or AddressRefused(f"no address to connect to for {host!r}")

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        raise AddressRefused("unix sockets are not collected")

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream, backend: GuardedBackend) -> None:
        self._inner = inner
        self._backend = backend

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, timeout=self._backend.left(timeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, timeout=self._backend.left(timeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        stream = self._inner.start_tls(ssl_context, server_hostname, timeout=self._backend.left(timeout))
        return _DeadlineStream(stream, self._backend)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)
