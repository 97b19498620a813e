"""Media URIs -> bytes, with the operator's rules.

- `data:[<type>][;base64],<payload>`: always allowed; base64 is decoded strictly.
- `file:///abs/path`: only under `allowed_local_media_path` (after resolving symlinks and
  `..`), only regular files, at most `max_bytes`.
- `http(s)://host/...`: only when `host` is in `allowed_media_hosts`, and only when every
  address the host resolves to is public (not loopback / private / link-local / reserved /
  multicast / unspecified, IPv4-mapped and embedded IPv4 included) or inside one of the
  operator's `allowed_networks`. The connection goes to the address that was checked (no
  second DNS lookup, so no rebinding window); the Host header, TLS SNI and certificate
  check still use the host name. Redirects are followed by hand, at most MAX_REDIRECTS
  hops, and every hop is checked the same way before anything connects to it.
Anything else is refused with a 400 that says why. Decoding the bytes is the Processor's
job (pipeline.processing); this module never looks inside them.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import ipaddress
import os
import socket
import ssl
import threading
import time
import urllib.parse
import wave
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from deployments.ingress.schemas import ApiError

FETCH_TIMEOUT_S = 10.0  # the whole fetch: every hop's connect, TLS handshake and reads
MAX_REDIRECTS = 5
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_READ_CHUNK = 64 * 1024
_MAX_DETAIL = 200  # characters of an exception's text that go into a 400 message

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class MediaLoader:
    def __init__(self, *, allowed_dir: str | None, allowed_hosts: list[str], max_bytes: int,
                 allowed_networks: list[str] | tuple[str, ...] = ()):
        self.allowed_dir = Path(allowed_dir).resolve() if allowed_dir else None
        self.allowed_hosts = {_norm_host(h) for h in allowed_hosts}
        self.max_bytes = max_bytes
        if isinstance(allowed_networks, str):
            raise ValueError(f"allowed_networks: expected a list of CIDR strings, got the "
                             f"string {allowed_networks!r}")
        self.allowed_networks: tuple[IPNetwork, ...] = tuple(
            parse_network(n) for n in (allowed_networks or ()))
        # Verification on (CERT_REQUIRED + check_hostname); tests may swap in a context
        # that trusts their own CA.
        self.ssl_context = ssl.create_default_context()
        self.ssl_context.set_alpn_protocols(["http/1.1"])

    def load(self, uri: str, param: str) -> bytes:
        if not isinstance(uri, str) or not uri:
            raise ApiError(400, f"{param}: expected a non-empty URI string", param=param)
        scheme = uri.split(":", 1)[0].lower() if ":" in uri else ""
        if scheme == "data":
            return self._data(uri, param)
        if scheme == "file":
            return self._file(uri, param)
        if scheme in ("http", "https"):
            return self._http(uri, param)
        raise ApiError(400, f"{param}: unsupported URI scheme {scheme or uri[:16]!r}; use a "
                            "data: URI, an allowed file:// path or an allowed http(s) host",
                       param=param)

    def _data(self, uri: str, param: str) -> bytes:
        head, sep, payload = uri[5:].partition(",")
        if not sep:
            raise ApiError(400, f"{param}: malformed data: URI (no comma)", param=param)
        if head.endswith(";base64"):
            data = b64decode(payload, param)
        else:
            data = urllib.parse.unquote_to_bytes(payload)
        return self._sized(data, param)

    def _file(self, uri: str, param: str) -> bytes:
        if self.allowed_dir is None:
            raise ApiError(400, f"{param}: file:// media is disabled on this server "
                                "(allowed_local_media_path is not set)", param=param)
        parsed = urllib.parse.urlparse(uri)
        if parsed.netloc not in ("", "localhost"):
            raise ApiError(400, f"{param}: file:// URIs must not name a host", param=param)
        path = Path(urllib.parse.unquote(parsed.path))
        if not path.is_absolute():
            raise ApiError(400, f"{param}: file:// path must be absolute", param=param)
        real = path.resolve()
        if real != self.allowed_dir and self.allowed_dir not in real.parents:
            raise ApiError(400, f"{param}: {path} is outside the allowed media folder",
                           param=param)
        if not real.is_file():
            raise ApiError(400, f"{param}: no such file: {path}", param=param)
        size = os.path.getsize(real)
        if size > self.max_bytes:
            raise ApiError(413, f"{param}: file is {size} bytes, over the limit of "
                                f"{self.max_bytes}", param=param)
        return real.read_bytes()

    # -- http(s) ---------------------------------------------------------------------

    def _http(self, uri: str, param: str) -> bytes:
        deadline = time.monotonic() + FETCH_TIMEOUT_S
        watchdog = _Watchdog(deadline)
        url = uri
        try:
            for hop in range(MAX_REDIRECTS + 1):
                where = (f"{param}: redirect hop {hop} to {_clip(url)!r}" if hop else param)
                target = self._check_url(url, where, param)
                conn, sock, resp = self._request(target, url, where, param, deadline, watchdog)
                try:
                    if resp.status in REDIRECT_STATUSES:
                        location = resp.getheader("Location")
                        if not location:
                            raise ApiError(400, f"{where}: HTTP {resp.status} redirect without "
                                                "a Location header", param=param)
                        url = urllib.parse.urljoin(url, location.strip())
                        continue
                    if not 200 <= resp.status < 300:
                        raise ApiError(400, f"{where}: could not fetch {_clip(url)}: HTTP "
                                            f"{resp.status}", param=param)
                    data = self._body(resp, sock, url, where, param, deadline, watchdog)
                finally:
                    resp.close()
                    conn.close()
                return self._sized(data, param)
            raise ApiError(400, f"{param}: too many redirects (more than {MAX_REDIRECTS}); "
                                f"last one pointed to {_clip(url)!r}", param=param)
        finally:
            watchdog.cancel()

    def _check_url(self, url: str, where: str, param: str) -> _Target:
        """Everything about one URL that must hold before anything connects to it."""
        try:
            parts = urllib.parse.urlsplit(url)
            port = parts.port
        except ValueError as e:
            raise ApiError(400, f"{where}: malformed URL ({_detail(e)})", param=param) from e
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise ApiError(400, f"{where}: unsupported URI scheme {scheme or url[:16]!r}; only "
                                "http and https are fetched", param=param)
        if "@" in parts.netloc:
            raise ApiError(400, f"{where}: URLs with credentials (user:password@host) are not "
                                "accepted", param=param)
        host = _norm_host(parts.hostname or "")
        if not host or host not in self.allowed_hosts:
            raise ApiError(400, f"{where}: fetching media from {host or url[:32]!r} is not "
                                "allowed on this server (allowed_media_hosts)", param=param)
        if port is None:
            port = 443 if scheme == "https" else 80
        addrs = self._resolve(host, port, where, param)
        for ip, _family, _sockaddr in addrs:
            refused = self._refused(ip)
            if refused:
                raise ApiError(400, f"{where}: {host!r} resolves to {_show(ip)}, {refused}; not "
                                    "fetched", param=param)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        # Non-ASCII, spaces and control characters are percent-encoded, so nothing can be
        # smuggled into the request line.
        path = urllib.parse.quote(path, safe="!#$%&'()*+,/:;=?@[]~")
        return _Target(scheme, host, port, path, addrs)

    def _resolve(self, host: str, port: int, where: str, param: str
                 ) -> list[tuple[IPAddress, int, tuple]]:
        literal = _ip_literal(host)
        if literal is not None:
            family = socket.AF_INET6 if literal.version == 6 else socket.AF_INET
            sockaddr = (host, port, 0, 0) if literal.version == 6 else (host, port)
            return [(literal, family, sockaddr)]
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as e:
            raise ApiError(400, f"{where}: could not resolve {host!r} ({_detail(e)})",
                           param=param) from e
        addrs, seen = [], set()
        for family, _type, _proto, _canon, sockaddr in infos:
            if family not in (socket.AF_INET, socket.AF_INET6):
                continue
            ip = _ip_literal(str(sockaddr[0]))
            if ip is None:
                raise ApiError(400, f"{where}: {host!r} resolved to an unusable address "
                                    f"{str(sockaddr[0])[:64]!r}", param=param)
            if (ip, sockaddr) not in seen:
                seen.add((ip, sockaddr))
                addrs.append((ip, family, sockaddr))
        if not addrs:
            raise ApiError(400, f"{where}: {host!r} has no IPv4/IPv6 address", param=param)
        return addrs

    def _refused(self, ip: IPAddress) -> str | None:
        """Why `ip` must not be fetched ("a loopback address", ...), or None when it may."""
        if any(ip in net for net in self.allowed_networks):
            return None
        for candidate, how in _candidates(ip):
            label = address_class(candidate)
            if label and not any(candidate in net for net in self.allowed_networks):
                return label + how
        return None

    def _request(self, target: _Target, url: str, where: str, param: str, deadline: float,
                 watchdog: _Watchdog
                 ) -> tuple[http.client.HTTPConnection, socket.socket, http.client.HTTPResponse]:
        """Connect to one of `target`'s checked addresses (in resolver order; the next one
        only when a connect fails), send the GET, read the status line and headers."""
        last: Exception | None = None
        for _ip, family, sockaddr in target.addrs:
            remaining = _remaining(deadline)
            if remaining is None:
                break
            if target.scheme == "https":
                conn: http.client.HTTPConnection = _PinnedHTTPSConnection(
                    target.host, target.port, family=family, sockaddr=sockaddr,
                    timeout=remaining, watch=watchdog.watch, context=self.ssl_context)
            else:
                conn = _PinnedHTTPConnection(target.host, target.port, family=family,
                                             sockaddr=sockaddr, timeout=remaining,
                                             watch=watchdog.watch)
            try:
                conn.connect()
            except ssl.SSLError as e:  # TLS failures are not retried on the next address
                conn.close()
                raise self._fetch_error(e, url, where, param, watchdog) from e
            except OSError as e:
                conn.close()
                last = e
                continue
            sock = conn.sock
            try:
                conn.putrequest("GET", target.path)  # Host: the URL's name, not the address
                conn.putheader("User-Agent", "omniray-media/1")
                conn.putheader("Accept", "*/*")
                conn.putheader("Connection", "close")
                conn.endheaders()
                _arm(sock, deadline)
                return conn, sock, conn.getresponse()
            except Exception as e:
                conn.close()
                raise self._fetch_error(e, url, where, param, watchdog) from e
        raise self._fetch_error(last or TimeoutError("timed out"), url, where, param, watchdog)

    def _body(self, resp: http.client.HTTPResponse, sock: socket.socket, url: str,
              where: str, param: str, deadline: float, watchdog: _Watchdog) -> bytes:
        length = resp.getheader("Content-Length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_bytes:
            raise ApiError(413, f"{param}: media is {int(length)} bytes (Content-Length), over "
                                f"the limit of {self.max_bytes} bytes", param=param)
        chunks, total = [], 0
        try:
            while total <= self.max_bytes:
                _arm(sock, deadline)
                chunk = resp.read1(min(_READ_CHUNK, self.max_bytes + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
        except Exception as e:
            raise self._fetch_error(e, url, where, param, watchdog) from e
        if watchdog.fired:
            raise self._fetch_error(TimeoutError("timed out"), url, where, param, watchdog)
        if total <= self.max_bytes and resp.length:  # EOF before Content-Length was reached
            raise ApiError(400, f"{where}: could not fetch {_clip(url)}: connection closed "
                                f"after {total} of {total + resp.length} bytes", param=param)
        return b"".join(chunks)

    def _fetch_error(self, e: Exception, url: str, where: str, param: str,
                     watchdog: _Watchdog) -> ApiError:
        if isinstance(e, ApiError):
            return e
        if watchdog.fired or isinstance(e, (TimeoutError, socket.timeout)):
            why = f"timed out after {FETCH_TIMEOUT_S:g} s"
        else:
            why = _detail(e)
        return ApiError(400, f"{where}: could not fetch {_clip(url)}: {why}", param=param)

    def _sized(self, data: bytes, param: str) -> bytes:
        if len(data) > self.max_bytes:
            raise ApiError(413, f"{param}: media is over the limit of {self.max_bytes} bytes",
                           param=param)
        if not data:
            raise ApiError(400, f"{param}: media is empty", param=param)
        return data


class _Target(NamedTuple):
    scheme: str
    host: str  # the name from the URL: Host header, SNI, certificate check
    port: int
    path: str  # request target: path + query, percent-encoded
    addrs: list[tuple[IPAddress, int, tuple]]  # (checked address, family, sockaddr)


def parse_network(entry: str) -> IPNetwork:
    """One `allowed_networks` entry ("10.0.0.0/8", "::1/128") -> a network; ValueError that
    names the entry when it is not a CIDR."""
    try:
        if not isinstance(entry, str):
            raise ValueError("not a string")
        return ipaddress.ip_network(entry.strip(), strict=True)
    except ValueError as e:
        raise ValueError(f"allowed_networks: {entry!r} is not a valid CIDR network ({e})") from e


def address_class(ip: IPAddress) -> str | None:
    """The class that makes `ip` unfit to fetch from, or None for a public address."""
    if ip.is_unspecified:
        return "an unspecified address"
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_link_local:
        return "a link-local address"
    if ip.is_multicast:
        return "a multicast address"
    if isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local:
        return "a site-local address"
    if ip.is_reserved:
        return "a reserved address"
    if ip.is_private:
        return "a private address"
    if not ip.is_global:  # e.g. 100.64.0.0/10 (carrier-grade NAT)
        return "a non-public address"
    return None


def _candidates(ip: IPAddress) -> list[tuple[IPAddress, str]]:
    """What to classify for `ip`: an IPv4-mapped address is its IPv4 address (so
    ::ffff:127.0.0.1 is loopback, not IPv6 "reserved"); NAT64 and 6to4 addresses are
    checked both as themselves and as the IPv4 address they carry. Each comes with a note
    for the error message."""
    out: list[tuple[IPAddress, str]] = []
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:  # on the wire this *is* the IPv4 address
            return [(ip.ipv4_mapped, " (IPv4-mapped)")]
        if ip in _NAT64:
            out.append((ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF), " (NAT64-embedded)"))
        if ip.sixtofour is not None:
            out.append((ip.sixtofour, " (6to4-embedded)"))
    out.append((ip, ""))
    return out


def _show(ip: IPAddress) -> str:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return f"::ffff:{ip.ipv4_mapped}"
    return str(ip)


def _ip_literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _norm_host(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host


def _clip(url: str, n: int = 96) -> str:
    return url if len(url) <= n else url[: n - 3] + "..."


def _detail(e: BaseException) -> str:
    """One short line about an exception (SSL errors can be very long)."""
    if isinstance(e, ssl.SSLCertVerificationError) and e.verify_message:
        text = f"certificate verify failed: {e.verify_message}"
    elif isinstance(e, ssl.SSLError) and e.reason:
        text = f"TLS error: {e.reason}"
    else:
        text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    text = " ".join(text.split())
    return text if len(text) <= _MAX_DETAIL else text[: _MAX_DETAIL - 3] + "..."


def _remaining(deadline: float) -> float | None:
    left = deadline - time.monotonic()
    return left if left > 0 else None


def _arm(sock: socket.socket | None, deadline: float) -> None:
    """Before a blocking read: the socket's timeout is whatever is left of the fetch."""
    left = _remaining(deadline)
    if left is None:
        raise TimeoutError("timed out")
    if sock is not None:
        sock.settimeout(left)


def _open_socket(family: int, sockaddr: tuple, timeout: float) -> socket.socket:
    """A TCP connection to an already-checked address (no name lookup here)."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(sockaddr)
    except BaseException:
        sock.close()
        raise
    return sock


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """HTTP to a fixed, pre-checked address; `host` is only used for the Host header."""

    def __init__(self, host: str, port: int, *, family: int, sockaddr: tuple, timeout: float,
                 watch: Callable[[socket.socket], None]):
        super().__init__(host, port, timeout=timeout)
        self._family, self._sockaddr, self._watch = family, sockaddr, watch

    def connect(self) -> None:
        self.sock = _open_socket(self._family, self._sockaddr, self.timeout)
        self._watch(self.sock)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """HTTPS to a fixed, pre-checked address; SNI and the certificate check use `host`."""

    def __init__(self, host: str, port: int, *, family: int, sockaddr: tuple, timeout: float,
                 watch: Callable[[socket.socket], None], context: ssl.SSLContext):
        super().__init__(host, port, timeout=timeout, context=context)
        self._family, self._sockaddr, self._watch = family, sockaddr, watch

    def connect(self) -> None:
        sock = _open_socket(self._family, self._sockaddr, self.timeout)
        try:
            # Handshake after the watchdog has the TLS socket, so it can cut a slow one.
            self.sock = self._context.wrap_socket(sock, server_hostname=self.host,
                                                  do_handshake_on_connect=False)
        except BaseException:
            sock.close()
            raise
        self._watch(self.sock)
        self.sock.do_handshake()


class _Watchdog:
    """The hard cap on a whole fetch. Socket timeouts bound each connect and read, but a
    server that trickles a byte at a time could still stretch the header read; at the
    deadline this shuts the current socket down, which ends any blocked read. The timer
    thread starts with the first connection, so a refused URL costs no thread."""

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.fired = False
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sock = sock
            if self.fired:
                self._shutdown()
            elif self._timer is None:
                self._timer = threading.Timer(max(0.0, self.deadline - time.monotonic()),
                                              self._fire)
                self._timer.daemon = True
                self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            self.fired = True
            self._shutdown()

    def _shutdown(self) -> None:
        if self._sock is not None:
            try:  # the plain-socket call, also on an SSLSocket: only the fd is touched
                socket.socket.shutdown(self._sock, socket.SHUT_RDWR)
            except OSError:  # already closed
                pass

    def cancel(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()


def b64decode(payload: str, param: str) -> bytes:
    try:
        return base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ApiError(400, f"{param}: invalid base64 ({e})", param=param) from e


def pcm16_to_wav(data: bytes, sample_rate: int = 16000) -> bytes:
    """Raw little-endian 16-bit mono PCM (`input_audio.format: pcm16`) -> a WAV file."""
    if len(data) % 2:
        raise ApiError(400, "input_audio: pcm16 data has an odd number of bytes",
                       param="input_audio")
    return wav_bytes_int16(np.frombuffer(data, dtype="<i2"), sample_rate)


def wav_bytes_int16(samples: np.ndarray, sample_rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(samples.astype("<i2").tobytes())
    return buf.getvalue()


def float_to_int16(pcm: np.ndarray) -> np.ndarray:
    return (np.clip(pcm, -1.0, 1.0) * 32767.0).round().astype("<i2")
