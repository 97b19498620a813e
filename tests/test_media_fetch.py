"""MediaLoader's http(s) path: SSRF guards (allow list, address classes, pinned connect,
checked redirects), limits and error shapes.

Everything runs on loopback: small http.server instances on 127.0.0.1 with ephemeral
ports, a fake resolver for made-up names (`media.example`, ...), and a "victim" listener
that never accepts, so any connection that reaches it, even one that never sends a byte,
sits in its backlog and is counted. Refused cases assert the victim got nothing.
"""

from __future__ import annotations

import datetime
import http.server
import ipaddress
import select
import socket
import ssl
import threading
import time
from pathlib import Path

import pytest

from deployments.ingress import media
from deployments.ingress.media import MediaLoader
from deployments.ingress.schemas import ApiError

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4  # not decoded here; just bytes
_real_getaddrinfo = socket.getaddrinfo


# ---------------------------------------------------------------------------------------
# Helpers


class Victim:
    """A listener that never accepts: a completed TCP handshake stays in its backlog, so
    `connections()` counts every connection attempt at the socket level."""

    def __init__(self, host: str = "127.0.0.1"):
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.bind((host, 0))
        self.sock.listen(16)
        self.host, self.port = host, self.sock.getsockname()[1]
        self._seen: list[socket.socket] = []

    def connections(self) -> int:
        while select.select([self.sock], [], [], 0.05)[0]:
            conn, _ = self.sock.accept()
            self._seen.append(conn)
        return len(self._seen)

    def close(self) -> None:
        for c in self._seen:
            c.close()
        self.sock.close()


class Server:
    """ThreadingHTTPServer on 127.0.0.1:0. `routes[path]` is (status, headers, body) or a
    callable(handler) that writes the response itself. Counts accepted connections and
    records (path, headers) of every request."""

    def __init__(self, routes: dict, ssl_context: ssl.SSLContext | None = None):
        outer = self
        self.routes = routes
        self.accepted = 0
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.sni: list[str | None] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def do_GET(self):
                outer.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                route = outer.routes.get(self.path.split("?", 1)[0])
                if route is None:
                    route = (404, {}, b"no such thing")
                if callable(route):
                    route(self)
                    return
                status, headers, body = route
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                if "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(body)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)

        class _HTTPServer(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def get_request(self):
                conn, addr = super().get_request()
                outer.accepted += 1
                return conn, addr

            def handle_error(self, request, client_address):  # quiet (TLS failures etc.)
                pass

        self.httpd = _HTTPServer(("127.0.0.1", 0), Handler)
        if ssl_context is not None:
            def sni_cb(sslobj, name, ctx):
                outer.sni.append(name)
            ssl_context.sni_callback = sni_cb
            self.httpd.socket = ssl_context.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class FakeDNS:
    """Made-up names -> address lists; numeric and unknown names go to the real resolver
    (which, for numeric hosts, needs no network). Records every lookup."""

    def __init__(self):
        self.names: dict[str, list[str] | object] = {}
        self.calls: list[str] = []

    def __call__(self, host, port, family=0, type=0, proto=0, flags=0):
        self.calls.append(host)
        entry = self.names.get(host)
        if entry is None:
            return _real_getaddrinfo(host, port, family, type, proto, flags)
        addrs = entry() if callable(entry) else entry
        out = []
        for a in addrs:
            ip = ipaddress.ip_address(a)
            if ip.version == 6:
                out.append((socket.AF_INET6, socket.SOCK_STREAM, 6, "", (a, port, 0, 0)))
            else:
                out.append((socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)))
        return out


class Recorder:
    """Stands in for media._open_socket: records where a connection would go and answers
    with a canned HTTP response over a socketpair (nothing leaves the process)."""

    def __init__(self, response: bytes | None = None):
        self.calls: list[tuple] = []
        self.response = response
        self.request = b""
        self._peers: list[socket.socket] = []

    def __call__(self, family, sockaddr, timeout):
        self.calls.append(sockaddr)
        if self.response is None:
            raise ConnectionRefusedError(111, "Connection refused (recorder)")
        ours, theirs = socket.socketpair()
        self._peers.append(theirs)
        ours.settimeout(timeout)

        def answer():
            buf = b""
            while b"\r\n\r\n" not in buf:
                piece = theirs.recv(4096)
                if not piece:
                    break
                buf += piece
            self.request = buf
            theirs.sendall(self.response)
            theirs.close()

        threading.Thread(target=answer, daemon=True).start()
        return ours

    def host_header(self) -> str:
        for line in self.request.decode("latin-1").split("\r\n"):
            if line.lower().startswith("host:"):
                return line.split(":", 1)[1].strip()
        return ""


def ok_response(body: bytes = PNG) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)


def refused(loader: MediaLoader, url: str, status: int = 400, *needles: str) -> ApiError:
    with pytest.raises(ApiError) as ei:
        loader.load(url, "image")
    e = ei.value
    assert e.status == status, e.message
    assert "\n" not in e.message and len(e.message) < 300, e.message
    assert e.message.startswith("image"), e.message
    for n in needles:
        assert n in e.message, (n, e.message)
    return e


def loader(hosts, networks=(), max_bytes=1 << 20) -> MediaLoader:
    return MediaLoader(allowed_dir=None, allowed_hosts=list(hosts), max_bytes=max_bytes,
                       allowed_networks=list(networks))


# ---------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(autouse=True)
def short_timeout(monkeypatch):
    # A regression that does connect to a silent victim fails in seconds, not 10 s.
    monkeypatch.setattr(media, "FETCH_TIMEOUT_S", 3.0)


@pytest.fixture
def dns(monkeypatch):
    fake = FakeDNS()
    fake.names["localhost"] = ["127.0.0.1"]  # deterministic whatever /etc/hosts says
    monkeypatch.setattr(media.socket, "getaddrinfo", fake)
    return fake


@pytest.fixture
def victim():
    v = Victim()
    yield v
    v.close()


@pytest.fixture
def victim2():
    """A victim on 127.0.0.2: loopback, but outside allowed_networks=['127.0.0.1/32']."""
    try:
        v = Victim("127.0.0.2")
    except OSError:
        pytest.skip("cannot bind 127.0.0.2 here")
    yield v
    v.close()


@pytest.fixture
def serve():
    servers: list[Server] = []

    def make(routes, ssl_context=None) -> Server:
        s = Server(routes, ssl_context)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


@pytest.fixture
def spy(monkeypatch):
    """Records every connect media makes, and lets it through."""
    calls: list[tuple] = []
    real = media._open_socket

    def open_socket(family, sockaddr, timeout):
        calls.append(sockaddr)
        return real(family, sockaddr, timeout)

    monkeypatch.setattr(media, "_open_socket", open_socket)
    return calls


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(media, "_open_socket", rec)
    return rec


# ---------------------------------------------------------------------------------------
# The fixture itself


def test_victim_counts_a_bare_connect(victim):
    assert victim.connections() == 0
    c = socket.create_connection(("127.0.0.1", victim.port), timeout=2)
    c.close()
    assert victim.connections() == 1


# ---------------------------------------------------------------------------------------
# 1-2: allowed names that resolve to loopback


def test_localhost_is_refused_as_loopback_without_allowed_networks(victim):
    # The real resolver: localhost is 127.0.0.1 (and maybe ::1); both are loopback.
    e = refused(loader(["localhost"]), f"http://localhost:{victim.port}/a.png", 400,
                "resolves to", "a loopback address; not fetched")
    assert "127.0.0.1" in e.message or "::1" in e.message
    assert victim.connections() == 0


def test_localhost_message_names_the_address(dns, victim):
    refused(loader(["localhost"]), f"http://localhost:{victim.port}/", 400,
            "'localhost' resolves to 127.0.0.1, a loopback address; not fetched")
    assert victim.connections() == 0


def test_allowed_network_lets_a_fetch_through(dns, serve):
    srv = serve({"/a.png": (200, {"Content-Type": "image/png"}, PNG)})
    got = loader(["localhost"], ["127.0.0.1/32"]).load(
        f"http://localhost:{srv.port}/a.png", "image")
    assert got == PNG
    assert srv.requests[0][0] == "/a.png"
    assert srv.requests[0][1]["host"] == f"localhost:{srv.port}"  # the name, not the IP


def test_allowed_network_with_the_real_resolver(serve):
    # Whatever order /etc/hosts gives (::1 first or not), with both loopbacks allowed the
    # fetch lands on the 127.0.0.1 server (a refused ::1 connect falls through).
    srv = serve({"/a.png": (200, {}, PNG)})
    got = loader(["LocalHost"], ["127.0.0.0/8", "::1/128"]).load(
        f"http://LOCALHOST:{srv.port}/a.png", "image")
    assert got == PNG


def test_host_allow_list_is_case_insensitive_and_other_hosts_refused(dns, victim):
    ld = loader(["LocalHost"], ["127.0.0.1/32"])
    refused(ld, f"http://127.0.0.1:{victim.port}/", 400, "not allowed",
            "allowed_media_hosts")
    refused(ld, f"http://example.com:{victim.port}/", 400, "not allowed")
    assert victim.connections() == 0
    assert dns.calls == []  # refused before any lookup


# ---------------------------------------------------------------------------------------
# 3: redirects are checked hop by hop, before connecting


def test_redirect_to_a_host_not_on_the_list_is_refused(dns, serve, victim):
    srv = serve({"/r": (302, {"Location": f"http://127.0.0.1:{victim.port}/secret"}, b"")})
    e = refused(loader(["localhost"], ["127.0.0.1/32"]), f"http://localhost:{srv.port}/r",
                400, "redirect hop 1", "not allowed", f"127.0.0.1:{victim.port}/secret")
    assert "127.0.0.1" in e.message
    assert srv.accepted == 1
    assert victim.connections() == 0


def test_redirect_to_allowed_name_resolving_to_refused_address(dns, serve, victim2):
    dns.names["media.example"] = ["127.0.0.2"]
    srv = serve({"/r": (301, {"Location": f"http://media.example:{victim2.port}/"}, b"")})
    ld = loader(["localhost", "media.example"], ["127.0.0.1/32"])
    refused(ld, f"http://localhost:{srv.port}/r", 400, "redirect hop 1",
            "'media.example' resolves to 127.0.0.2, a loopback address; not fetched")
    assert victim2.connections() == 0


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_every_redirect_code_is_rechecked(dns, serve, victim, spy, code):
    # media.example -> 10.0.0.5 (private): no connect is even attempted for hop 1.
    dns.names["media.example"] = ["10.0.0.5"]
    srv = serve({"/r": (code, {"Location": f"http://media.example:{victim.port}/x"}, b"")})
    ld = loader(["localhost", "media.example"], ["127.0.0.1/32"])
    refused(ld, f"http://localhost:{srv.port}/r", 400, "redirect hop 1",
            "resolves to 10.0.0.5, a private address")
    assert spy == [("127.0.0.1", srv.port)]
    assert victim.connections() == 0


def test_name_with_one_public_and_one_private_address_is_refused(dns, recorder, victim):
    dns.names["media.example"] = ["93.184.216.34", "192.168.1.1"]
    refused(loader(["media.example"]), f"http://media.example:{victim.port}/", 400,
            "resolves to 192.168.1.1, a private address")
    assert recorder.calls == []
    assert victim.connections() == 0


def test_redirect_to_name_with_mixed_addresses_is_refused(dns, serve, victim2):
    dns.names["media.example"] = ["93.184.216.34", "127.0.0.2"]
    srv = serve({"/r": (302, {"Location": f"http://media.example:{victim2.port}/"}, b"")})
    refused(loader(["localhost", "media.example"], ["127.0.0.1/32"]),
            f"http://localhost:{srv.port}/r", 400, "redirect hop 1", "127.0.0.2",
            "loopback")
    assert victim2.connections() == 0


def test_connect_goes_to_the_checked_address_no_rebinding(dns, recorder):
    # First lookup: public. Any later lookup would say loopback. Only one lookup happens
    # and the connection goes to the address that was checked.
    answers = iter([["93.184.216.34"]])
    dns.names["rebind.example"] = lambda: next(answers, ["127.0.0.1"])
    recorder.response = ok_response()
    got = loader(["rebind.example"]).load("http://rebind.example/a.png", "image")
    assert got == PNG
    assert recorder.calls == [("93.184.216.34", 80)]
    assert dns.calls.count("rebind.example") == 1
    assert recorder.host_header() == "rebind.example"


def test_redirect_to_a_refused_scheme_or_userinfo(dns, serve, victim):
    srv = serve({"/ftp": (302, {"Location": "ftp://localhost/a.png"}, b""),
                 "/file": (302, {"Location": "file:///etc/passwd"}, b""),
                 "/cred": (302, {"Location": f"http://u:p@localhost:{victim.port}/"}, b""),
                 "/none": (302, {}, b"")})
    ld = loader(["localhost"], ["127.0.0.1/32"])
    base = f"http://localhost:{srv.port}"
    refused(ld, base + "/ftp", 400, "redirect hop 1", "scheme")
    refused(ld, base + "/file", 400, "redirect hop 1", "scheme")
    refused(ld, base + "/cred", 400, "redirect hop 1", "credentials")
    refused(ld, base + "/none", 400, "without a Location")
    assert victim.connections() == 0


# ---------------------------------------------------------------------------------------
# 4: redirect chains


def _chain_routes(n: int) -> dict:
    """/hop/k redirects toward /hop/k-1 (mixing codes and relative forms); /hop/0 is the
    media."""
    forms = [lambda k: f"/hop/{k}",        # absolute path
             lambda k: f"{k}",             # relative to /hop/
             lambda k: f"../hop/{k}?x=1",  # dot segments + query
             lambda k: f"./{k}"]
    codes = [301, 302, 303, 307, 308]
    routes = {"/hop/0": (200, {}, PNG)}
    for k in range(1, n + 1):
        routes[f"/hop/{k}"] = (codes[k % 5], {"Location": forms[k % 4](k - 1)}, b"")
    return routes


def test_five_redirects_are_followed_with_relative_locations(dns, serve):
    srv = serve(_chain_routes(6))
    got = loader(["localhost"], ["127.0.0.1/32"]).load(
        f"http://localhost:{srv.port}/hop/5", "image")
    assert got == PNG
    assert [p.split("?")[0] for p, _ in srv.requests] == [f"/hop/{k}" for k in range(5, -1, -1)]


def test_six_redirects_are_refused(dns, serve):
    srv = serve(_chain_routes(6))
    refused(loader(["localhost"], ["127.0.0.1/32"]), f"http://localhost:{srv.port}/hop/6",
            400, "too many redirects")
    # hop/6 .. hop/1 were asked (6 responses, all redirects); the 6th target never was.
    assert len(srv.requests) == 6
    assert "/hop/0" not in [p for p, _ in srv.requests]


def test_scheme_relative_redirect_is_checked(dns, serve, victim):
    srv = serve({"/r": (302, {"Location": f"//127.0.0.1:{victim.port}/x"}, b"")})
    refused(loader(["localhost"], ["127.0.0.1/32"]), f"http://localhost:{srv.port}/r", 400,
            "redirect hop 1", "not allowed")
    assert victim.connections() == 0


def test_redirect_loop_is_bounded(dns, serve):
    srv = serve({"/loop": (302, {"Location": "/loop"}, b"")})
    refused(loader(["localhost"], ["127.0.0.1/32"]), f"http://localhost:{srv.port}/loop",
            400, "too many redirects")
    assert len(srv.requests) == 6


# ---------------------------------------------------------------------------------------
# 5: address classes, as literals on the allow list (no connect is attempted)


@pytest.mark.parametrize("literal,label", [
    ("10.0.0.1", "a private address"),
    ("172.16.0.1", "a private address"),
    ("192.168.1.1", "a private address"),
    ("169.254.169.254", "a link-local address"),
    ("0.0.0.0", "an unspecified address"),
    ("127.0.0.1", "a loopback address"),
    ("::1", "a loopback address"),
    ("::", "an unspecified address"),
    ("::ffff:127.0.0.1", "a loopback address (IPv4-mapped)"),
    ("::ffff:169.254.169.254", "a link-local address (IPv4-mapped)"),
    ("fe80::1", "a link-local address"),
    ("fc00::1", "a private address"),
    ("224.0.0.1", "a multicast address"),
    ("ff02::1", "a multicast address"),
    ("240.0.0.1", "a reserved address"),
    ("100.64.0.1", "a non-public address"),
    ("2002:7f00:1::", "a loopback address (6to4-embedded)"),
    ("64:ff9b::a9fe:a9fe", "a link-local address (NAT64-embedded)"),
])
def test_refused_literals_never_connect(monkeypatch, recorder, literal, label):
    def no_dns(*a, **k):
        raise AssertionError("an IP literal needs no lookup")

    monkeypatch.setattr(media.socket, "getaddrinfo", no_dns)
    netloc = f"[{literal}]" if ":" in literal else literal
    e = refused(loader([literal]), f"http://{netloc}:8080/a.png", 400,
                f"resolves to {literal}, {label}; not fetched")
    assert "not allowed" not in e.message
    assert recorder.calls == []


@pytest.mark.parametrize("spelling", ["2130706433", "127.1", "0x7f.0.0.1", "0177.0.0.1"])
def test_odd_ipv4_spellings_resolve_and_are_refused(recorder, spelling):
    # Not IP literals to ipaddress, but the resolver turns them into 127.0.0.1.
    refused(loader([spelling]), f"http://{spelling}/", 400, "127.0.0.1", "loopback")
    assert recorder.calls == []


def test_public_ipv4_literal_passes_the_check(recorder):
    recorder.response = ok_response()
    got = loader(["93.184.216.34"]).load("http://93.184.216.34/a.png", "image")
    assert got == PNG
    assert recorder.calls == [("93.184.216.34", 80)]
    assert recorder.request.startswith(b"GET /a.png HTTP/1.1\r\n")
    assert recorder.host_header() == "93.184.216.34"


def test_public_ipv6_literal_passes_the_check(recorder):
    recorder.response = ok_response()
    lit = "2606:2800:220:1:248:1893:25c8:1946"
    got = loader([f"[{lit}]"]).load(f"http://[{lit}]:8080/a.png", "image")
    assert got == PNG
    assert recorder.calls == [(lit, 8080, 0, 0)]
    assert recorder.host_header() == f"[{lit}]:8080"


def test_allowed_networks_open_exactly_their_range(recorder):
    recorder.response = ok_response()
    ld = loader(["10.1.2.3", "10.200.0.1", "fd00::5", "::ffff:10.1.2.3"],
                ["10.1.0.0/16", "fd00::/64"])
    assert ld.load("http://10.1.2.3/", "image") == PNG
    assert ld.load("http://[fd00::5]/", "image") == PNG
    assert ld.load("http://[::ffff:10.1.2.3]/", "image") == PNG  # mapped form of an allowed IP
    refused(ld, "http://10.200.0.1/", 400, "a private address")
    assert [c[0] for c in recorder.calls] == ["10.1.2.3", "fd00::5", "::ffff:10.1.2.3"]


def test_unresolvable_name_is_a_400(dns):
    def fail():
        raise socket.gaierror(-2, "Name or service not known")

    dns.names["nowhere.example"] = fail
    refused(loader(["nowhere.example"]), "http://nowhere.example/", 400, "could not resolve")


# ---------------------------------------------------------------------------------------
# 6: limits, statuses, timeouts


def test_content_length_over_the_limit_is_refused_before_the_body(dns, serve):
    sent_body = threading.Event()
    release = threading.Event()

    def big(h):
        h.send_response(200)
        h.send_header("Content-Length", str(10 * 1024 * 1024))
        h.end_headers()
        h.wfile.flush()
        release.wait(5)  # the body would only come after this: reading it would hang
        try:
            h.wfile.write(b"x" * 1024)
            sent_body.set()
        except OSError:
            pass

    srv = serve({"/big": big})
    t0 = time.monotonic()
    refused(loader(["localhost"], ["127.0.0.1/32"], max_bytes=1000),
            f"http://localhost:{srv.port}/big", 413, "over the limit of 1000",
            "Content-Length")
    assert time.monotonic() - t0 < 1.5
    assert not sent_body.is_set()
    release.set()


def test_body_streaming_past_the_limit_is_413(dns, serve):
    def stream(h):  # no Content-Length: read until close
        h.send_response(200)
        h.send_header("Connection", "close")
        h.end_headers()
        try:
            for _ in range(100):
                h.wfile.write(b"y" * 4096)
        except OSError:
            pass
        h.close_connection = True

    def chunked(h):
        h.send_response(200)
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        try:
            for _ in range(100):
                h.wfile.write(b"1000\r\n" + b"z" * 4096 + b"\r\n")
            h.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass

    srv = serve({"/stream": stream, "/chunked": chunked})
    ld = loader(["localhost"], ["127.0.0.1/32"], max_bytes=10_000)
    refused(ld, f"http://localhost:{srv.port}/stream", 413, "over the limit of 10000")
    refused(ld, f"http://localhost:{srv.port}/chunked", 413, "over the limit of 10000")


def test_body_of_exactly_the_limit_is_fine(dns, serve):
    srv = serve({"/a": (200, {}, b"q" * 1000), "/b": (200, {}, b"q" * 1001)})
    ld = loader(["localhost"], ["127.0.0.1/32"], max_bytes=1000)
    assert ld.load(f"http://localhost:{srv.port}/a", "image") == b"q" * 1000
    refused(ld, f"http://localhost:{srv.port}/b", 413, "over the limit of 1000")


def test_http_errors_and_empty_bodies_are_400(dns, serve):
    srv = serve({"/empty": (200, {}, b""), "/boom": (500, {}, b"oops"),
                 "/notmod": (304, {"Content-Length": "0"}, b"")})
    ld = loader(["localhost"], ["127.0.0.1/32"])
    base = f"http://localhost:{srv.port}"
    refused(ld, base + "/missing.png", 400, "could not fetch", "HTTP 404")
    refused(ld, base + "/boom", 400, "HTTP 500")
    refused(ld, base + "/notmod", 400, "HTTP 304")
    refused(ld, base + "/empty", 400, "media is empty")


def test_truncated_body_is_400(dns, serve):
    def short(h):
        h.send_response(200)
        h.send_header("Content-Length", "5000")
        h.send_header("Connection", "close")
        h.end_headers()
        h.wfile.write(b"s" * 100)
        h.close_connection = True

    srv = serve({"/short": short})
    refused(loader(["localhost"], ["127.0.0.1/32"]), f"http://localhost:{srv.port}/short",
            400, "connection closed after 100 of 5000 bytes")


def test_server_that_never_answers_times_out(dns, monkeypatch, victim):
    # The victim listener never accepts: the connect succeeds, nothing ever comes back.
    monkeypatch.setattr(media, "FETCH_TIMEOUT_S", 0.5)
    t0 = time.monotonic()
    refused(loader(["localhost"], ["127.0.0.1/32"]), f"http://localhost:{victim.port}/", 400,
            "timed out after 0.5 s")
    assert time.monotonic() - t0 < 2.0
    assert victim.connections() == 1  # it did get there: this is the allowed case


def test_trickling_server_is_cut_at_the_total_deadline(dns, monkeypatch, serve):
    # One header byte every 50 ms: each read is quick, the fetch as a whole is not.
    stop = threading.Event()

    def trickle(h):
        try:
            for b in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 10_000:
                if stop.is_set():
                    return
                h.wfile.write(bytes([b]))
                h.wfile.flush()
                time.sleep(0.05)
        except OSError:
            pass

    srv = serve({"/slow": trickle})
    monkeypatch.setattr(media, "FETCH_TIMEOUT_S", 0.6)
    t0 = time.monotonic()
    refused(loader(["localhost"], ["127.0.0.1/32"]), f"http://localhost:{srv.port}/slow", 400,
            "timed out after 0.6 s")
    assert time.monotonic() - t0 < 2.0
    stop.set()


def test_garbage_response_is_400(dns, serve):
    def garbage(h):
        h.wfile.write(b"SSH-2.0-OpenSSH_9.6\r\n")
        h.close_connection = True

    srv = serve({"/g": garbage})
    refused(loader(["localhost"], ["127.0.0.1/32"]), f"http://localhost:{srv.port}/g", 400,
            "could not fetch")


def test_connection_refused_is_400(dns):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    refused(loader(["localhost"], ["127.0.0.1/32"]), f"http://localhost:{port}/", 400,
            "could not fetch", "refused")


# ---------------------------------------------------------------------------------------
# 7: URL shapes and constructor validation


@pytest.mark.parametrize("url", ["http://user:pass@localhost/a.png", "http://user@localhost/",
                                 "https://:pw@localhost/", "http://@localhost/"])
def test_userinfo_is_refused(dns, recorder, url):
    refused(loader(["localhost"], ["127.0.0.1/32"]), url, 400, "credentials")
    assert recorder.calls == [] and dns.calls == []


def test_malformed_urls_are_400(dns):
    ld = loader(["localhost"], ["127.0.0.1/32"])
    refused(ld, "http://localhost:99999/", 400, "malformed URL")
    refused(ld, "http://localhost:abc/", 400, "malformed URL")
    refused(ld, "http:///nohost", 400, "not allowed")


def test_request_target_is_percent_encoded(dns, serve):
    srv = serve({"/a b/é.png": (200, {}, PNG), "/a%20b/%C3%A9.png": (200, {}, PNG)})
    got = loader(["localhost"], ["127.0.0.1/32"]).load(
        f"http://localhost:{srv.port}/a b/é.png?x=1\r\nX-Injected: 1", "image")
    assert got == PNG
    path, headers = srv.requests[0]
    # (urlsplit already drops CR/LF/TAB; whatever is left is encoded, never a header)
    assert path.startswith("/a%20b/%C3%A9.png?x=1") and " " not in path
    assert "x-injected" not in headers


@pytest.mark.parametrize("bad", ["10.0.0.0/33", "not-a-net", "10.0.0.1/8", "", "::1/129"])
def test_bad_cidr_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError) as ei:
        MediaLoader(allowed_dir=None, allowed_hosts=[], max_bytes=10, allowed_networks=[bad])
    assert repr(bad) in str(ei.value)
    assert "allowed_networks" in str(ei.value)


def test_good_cidrs_and_default():
    ld = MediaLoader(allowed_dir=None, allowed_hosts=[], max_bytes=10,
                     allowed_networks=["10.0.0.0/8", "127.0.0.1/32", "::1/128", "127.0.0.1"])
    assert [str(n) for n in ld.allowed_networks] == ["10.0.0.0/8", "127.0.0.1/32", "::1/128",
                                                     "127.0.0.1/32"]
    assert MediaLoader(allowed_dir=None, allowed_hosts=[], max_bytes=10).allowed_networks == ()
    assert MediaLoader(allowed_dir=None, allowed_hosts=[], max_bytes=10,
                       allowed_networks=None).allowed_networks == ()
    with pytest.raises(ValueError, match="list of CIDR"):
        MediaLoader(allowed_dir=None, allowed_hosts=[], max_bytes=10,
                    allowed_networks="10.0.0.0/8")


def test_data_uris_are_untouched():
    ld = loader([])
    assert ld.load("data:text/plain;base64,aGk=", "image") == b"hi"
    assert ld.load("data:,hi%21", "image") == b"hi!"


# ---------------------------------------------------------------------------------------
# HTTPS: connect to the pinned IP, but SNI and the certificate check use the name


def _cert(name: str):
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "omniray test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(hours=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                       crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False,
                                       decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return ca.public_bytes(pem).decode(), leaf.public_bytes(pem), key_pem


def _tls_server(serve, tmp_path: Path, name: str) -> tuple[Server, str]:
    ca_pem, cert_pem, key_pem = _cert(name)
    (tmp_path / "cert.pem").write_bytes(cert_pem)
    (tmp_path / "key.pem").write_bytes(key_pem)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    return serve({"/a.png": (200, {}, PNG)}, ctx), ca_pem


def test_https_pins_the_ip_but_verifies_the_name(dns, serve, tmp_path):
    dns.names["media.example"] = ["127.0.0.1"]
    srv, ca_pem = _tls_server(serve, tmp_path, "media.example")
    ld = loader(["media.example"], ["127.0.0.1/32"])
    ld.ssl_context.load_verify_locations(cadata=ca_pem)
    got = ld.load(f"https://media.example:{srv.port}/a.png", "image")
    assert got == PNG
    assert srv.sni == ["media.example"]
    assert srv.requests[0][1]["host"] == f"media.example:{srv.port}"
    assert ld.ssl_context.verify_mode == ssl.CERT_REQUIRED and ld.ssl_context.check_hostname


def test_https_certificate_for_another_name_is_400(dns, serve, tmp_path):
    dns.names["media.example"] = ["127.0.0.1"]
    srv, ca_pem = _tls_server(serve, tmp_path, "other.example")
    ld = loader(["media.example"], ["127.0.0.1/32"])
    ld.ssl_context.load_verify_locations(cadata=ca_pem)
    refused(ld, f"https://media.example:{srv.port}/a.png", 400, "certificate verify failed")
    assert srv.requests == []


def test_https_untrusted_certificate_is_400(dns, serve, tmp_path):
    dns.names["media.example"] = ["127.0.0.1"]
    srv, _ = _tls_server(serve, tmp_path, "media.example")
    refused(loader(["media.example"], ["127.0.0.1/32"]),
            f"https://media.example:{srv.port}/a.png", 400, "certificate verify failed")
    assert srv.requests == []


def test_https_to_a_plain_http_server_is_400(dns, serve):
    srv = serve({"/a.png": (200, {}, PNG)})
    refused(loader(["localhost"], ["127.0.0.1/32"]), f"https://localhost:{srv.port}/a.png",
            400, "could not fetch")
