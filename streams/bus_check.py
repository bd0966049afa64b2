"""Can a Kafka cluster be reached with a :class:`~relax.streams.client.BusConfig`? One
line saying why not, within seconds (:func:`check_bus`).

kafka-python reports every failure to reach a broker (nothing listening, a CA it does
not trust, a wrong password, a PLAINTEXT client on a TLS port) alike: ``Unable to
bootstrap`` after 30 s. This check speaks to one bootstrap server itself, step by step,
and stops at the first step that fails:

1. TCP connect (refused, no answer, unknown host);
2. for SSL / SASL_SSL, the TLS handshake with the client's own settings
   (:func:`ssl_context`, as kafka-python builds it): an untrusted or misnamed
   certificate, or a port that does not speak TLS;
3. for PLAINTEXT / SASL_PLAINTEXT, a port that closes on a Kafka request but completes
   a TLS handshake is a TLS listener;
4. for SASL_*, ``SaslHandshake`` (the mechanism enabled?) and ``SaslAuthenticate``
   (PLAIN, or SCRAM's two rounds with kafka-python's ``ScramClient``): the broker's
   reason for a refused user or password;
5. a ``Metadata`` request: a listener that wants SASL closes the connection here.

Requests are Kafka's non-flexible versions (ApiVersions v0, SaslHandshake v1,
SaslAuthenticate v1, Metadata v1), which every broker since 1.0 answers. The password is
never part of a message.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time

from relax.streams.client import (
    SASL_PROTOCOLS,
    TLS_PROTOCOLS,
    BusConfig,
    sasl_password,
)

CHECK_TIMEOUT_S = 7.0
"""Default time limit of :func:`check_bus` for each bootstrap server (seconds). A broker
answers in milliseconds; on a 2-core machine at load 15 a SCRAM exchange took seconds."""

_API_VERSIONS, _SASL_HANDSHAKE, _SASL_AUTHENTICATE, _METADATA = 18, 17, 36, 3
_API_NAMES = {_API_VERSIONS: "ApiVersions", _SASL_HANDSHAKE: "SaslHandshake",
              _SASL_AUTHENTICATE: "SaslAuthenticate", _METADATA: "Metadata"}
_UNSUPPORTED_SASL_MECHANISM, _ILLEGAL_SASL_STATE = 33, 34
_CERT_HOSTNAME_MISMATCH = 62  # X509_V_ERR_HOSTNAME_MISMATCH
_CERT_IP_MISMATCH = 64  # X509_V_ERR_IP_ADDRESS_MISMATCH


class BusUnreachable(Exception):
    """The cluster cannot be used with these settings; the message is one line naming
    the server, the step and the setting to look at (never the password)."""


class _Closed(Exception):
    """The broker closed the connection before answering."""


def ssl_context(cfg: BusConfig) -> ssl.SSLContext:
    """The TLS context kafka-python makes from ``cfg`` (TLS 1.2+, the CA file or the
    system's CAs, the client certificate, hostname check as set).

    Raises:
        BusUnreachable: a CA, certificate or key file cannot be read.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = cfg.ssl_check_hostname
    try:
        if cfg.ssl_cafile:
            ctx.load_verify_locations(cfg.ssl_cafile)
        else:
            ctx.load_default_certs()
    except (OSError, ssl.SSLError) as e:
        raise BusUnreachable(f"bus.ssl_cafile {cfg.ssl_cafile!r}: not a readable PEM file of "
                             f"CA certificates ({_why(e)})") from None
    if cfg.ssl_certfile:
        try:
            ctx.load_cert_chain(cfg.ssl_certfile, cfg.ssl_keyfile)
        except (OSError, ssl.SSLError) as e:
            raise BusUnreachable(f"bus.ssl_certfile {cfg.ssl_certfile!r} / bus.ssl_keyfile "
                                 f"{cfg.ssl_keyfile!r}: not a readable PEM certificate and "
                                 f"key ({_why(e)})") from None
    return ctx


def check_bus(cfg: BusConfig, timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """Check that the cluster of ``cfg`` answers a Kafka request with ``cfg``'s security
    settings; returns at the first bootstrap server that does.

    Args:
        timeout_s: time limit for each bootstrap server tried (seconds).

    Raises:
        BusUnreachable: no bootstrap server could be used; the reason of the first one
            that was reached (else of the first one), in one line.
    """
    password = None
    if cfg.security_protocol in SASL_PROTOCOLS:
        try:
            password = sasl_password(cfg)
        except ValueError as e:
            raise BusUnreachable(str(e)) from None
    ctx = ssl_context(cfg) if cfg.security_protocol in TLS_PROTOCOLS else None
    reasons: list[tuple[bool, str]] = []
    for server in cfg.bootstrap_servers.split(","):
        try:
            _check_server(cfg, server.strip(), ctx, password, timeout_s)
            return
        except _NotReached as e:
            reasons.append((False, str(e)))
        except BusUnreachable as e:
            reasons.append((True, str(e)))
    reached = [r for ok, r in reasons if ok]
    raise BusUnreachable((reached or [r for _, r in reasons])[0])


class _NotReached(BusUnreachable):
    """Nothing Kafka-like answered at the address (try the next server)."""


def _check_server(cfg: BusConfig, server: str, ctx: ssl.SSLContext | None,
                  password: str | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    host, _, port_s = server.rpartition(":")
    host = host.strip("[]")
    if not host or not port_s.isdigit():
        raise _NotReached(f"bootstrap server {server!r} is not host:port")
    port = int(port_s)
    proto = cfg.security_protocol
    sock = _connect(host, port, deadline)
    conn = None
    try:
        if ctx is not None:
            sock = _tls(sock, ctx, host, port, cfg, deadline)
        conn = _Conn(sock, deadline)
        try:
            conn.request(_API_VERSIONS, 0, b"")
        except _Closed:
            if ctx is None and _speaks_tls(host, port, deadline):
                raise BusUnreachable(
                    f"{host}:{port} is a TLS port but bus.security_protocol is {proto}: set "
                    f"{'SASL_SSL' if proto == 'SASL_PLAINTEXT' else 'SSL or SASL_SSL'} (and "
                    f"bus.ssl_cafile, the CA that signed its certificate)") from None
            raise _NotReached(f"{host}:{port} closed the connection on a Kafka ApiVersions "
                              f"request: not a Kafka broker?") from None
        if password is not None:
            _authenticate(conn, cfg, password, host, port)
        try:
            conn.request(_METADATA, 1, struct.pack(">i", 0))
        except _Closed:
            raise BusUnreachable(
                f"{host}:{port} closed the connection on a Metadata request from a client "
                f"that did not authenticate: its listener wants SASL (bus.security_protocol "
                f"is {proto}; set {'SASL_SSL' if ctx else 'SASL_PLAINTEXT or SASL_SSL'}, "
                f"bus.sasl_mechanism, bus.sasl_username and a password)") from None
    except TimeoutError:
        step = f"no answer to {conn.step}" if conn and conn.step else "no answer"
        raise BusUnreachable(f"{host}:{port} accepted a connection but gave {step} within "
                             f"{timeout_s:g} s (a {proto} client; is the broker overloaded, "
                             f"or is this port another service?)") from None
    finally:
        sock.close()


def _connect(host: str, port: int, deadline: float) -> socket.socket:
    try:
        return socket.create_connection((host, port), timeout=_left(deadline))
    except ConnectionRefusedError:
        raise _NotReached(f"nothing listening on {host}:{port} (connection refused): is the "
                          f"broker running, and bootstrap_servers right?") from None
    except TimeoutError:
        raise _NotReached(f"no answer from {host}:{port} (connect timed out): a wrong "
                          f"address, or a firewall?") from None
    except socket.gaierror as e:
        raise _NotReached(f"cannot resolve host {host!r} ({e.strerror})") from None
    except OSError as e:
        raise _NotReached(f"cannot connect to {host}:{port} ({_why(e)})") from None


def _tls(sock: socket.socket, ctx: ssl.SSLContext, host: str, port: int, cfg: BusConfig,
         deadline: float) -> ssl.SSLSocket:
    sock.settimeout(_left(deadline))
    try:
        return ctx.wrap_socket(sock, server_hostname=host)
    except ssl.SSLCertVerificationError as e:
        if e.verify_code in (_CERT_HOSTNAME_MISMATCH, _CERT_IP_MISMATCH):
            raise BusUnreachable(f"the TLS certificate of {host}:{port} does not name "
                                 f"{host} ({e.verify_message}): connect by a name it holds, "
                                 f"or set bus.ssl_check_hostname=false") from None
        trusted = (f"the CA in bus.ssl_cafile {cfg.ssl_cafile!r}" if cfg.ssl_cafile
                   else "the system's CAs (bus.ssl_cafile is not set)")
        raise BusUnreachable(f"the TLS certificate of {host}:{port} is not signed by "
                             f"{trusted} ({e.verify_message})") from None
    except TimeoutError:
        raise BusUnreachable(f"{host}:{port} did not complete a TLS handshake in time "
                             f"(bus.security_protocol is {cfg.security_protocol}): is it a "
                             f"PLAINTEXT port?") from None
    except (ssl.SSLError, ConnectionError) as e:
        if "CERTIFICATE_REQUIRED" in str(e).upper():
            raise BusUnreachable(f"{host}:{port} asks for a client certificate: set "
                                 f"bus.ssl_certfile and bus.ssl_keyfile") from None
        raise BusUnreachable(f"{host}:{port} does not speak TLS ({_why(e)}) but "
                             f"bus.security_protocol is {cfg.security_protocol}: is it a "
                             f"PLAINTEXT or SASL_PLAINTEXT port?") from None


def _speaks_tls(host: str, port: int, deadline: float) -> bool:
    """Whether ``host:port`` completes a TLS handshake (any certificate)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with (socket.create_connection((host, port), timeout=_left(deadline)) as raw,
              ctx.wrap_socket(raw, server_hostname=host)):
            return True
    except (OSError, ssl.SSLError):
        return False


def _authenticate(conn: _Conn, cfg: BusConfig, password: str, host: str, port: int) -> None:
    from kafka.net.sasl.scram import ScramClient

    mech, user = cfg.sasl_mechanism, cfg.sasl_username
    body = conn.request(_SASL_HANDSHAKE, 1, _string(mech))
    (error,) = struct.unpack_from(">h", body)
    if error == _UNSUPPORTED_SASL_MECHANISM:
        offered = _strings(body, 2)
        raise BusUnreachable(f"{host}:{port} does not enable bus.sasl_mechanism {mech}; it "
                             f"offers {', '.join(offered) or 'none'}")
    if error == _ILLEGAL_SASL_STATE:
        raise BusUnreachable(f"{host}:{port} takes no SASL (a PLAINTEXT or SSL listener) but "
                             f"bus.security_protocol is {cfg.security_protocol}")
    if error:
        raise BusUnreachable(f"{host}:{port} answered SaslHandshake with Kafka error {error}")
    who = (f"user {user!r}, {mech}, password from "
           + (f"bus.sasl_password_file {cfg.sasl_password_file!r}" if cfg.sasl_password_file
              else "$RELAX_BUS_SASL_PASSWORD"))
    if mech == "PLAIN":
        tokens = [b"\0" + user.encode() + b"\0" + password.encode()]
        scram = None
    else:
        scram = ScramClient(user, password, mech)
        tokens = [scram.first_message()]
    for i in range(2 if scram else 1):
        try:
            body = conn.request(_SASL_AUTHENTICATE, 1, _bytes(tokens[i]))
        except _Closed:
            raise BusUnreachable(f"{host}:{port} closed the connection during SASL "
                                 f"authentication ({who})") from None
        error, message, reply = _sasl_reply(body)
        if error:
            reason = (message or f"Kafka error {error}").replace(password, "***")
            raise BusUnreachable(f"authentication failed at {host}:{port} ({who}): the broker "
                                 f"says: {reason}")
        if scram and i == 0:
            scram.process_server_first_message(reply)
            tokens.append(scram.final_message())
        elif scram:
            try:
                scram.process_server_final_message(reply)
            except ValueError:
                raise BusUnreachable(f"{host}:{port} accepted the password but its SCRAM "
                                     f"proof is wrong: not the server you meant?") from None


class _Conn:
    """Kafka requests over one socket: size-prefixed frames, request header v1, response
    header v0 (non-flexible API versions only)."""

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.deadline, self.correlation = sock, deadline, 0
        self.step = ""
        """the request last sent (for a time-out's message)"""

    def request(self, api_key: int, version: int, body: bytes) -> bytes:
        """The response body (after the correlation id) of one request.

        Raises:
            _Closed: the broker closed the connection before answering.
            TimeoutError: no answer before the deadline.
        """
        self.correlation += 1
        self.step = _API_NAMES[api_key]
        frame = struct.pack(">hhi", api_key, version, self.correlation) + _string("relax-check")
        frame += body
        self.sock.settimeout(_left(self.deadline))
        try:
            self.sock.sendall(struct.pack(">i", len(frame)) + frame)
            (size,) = struct.unpack(">i", self._read(4))
            data = self._read(size)
        except (ConnectionResetError, BrokenPipeError, ssl.SSLEOFError,
                ssl.SSLZeroReturnError):
            raise _Closed() from None
        except ssl.SSLError as e:  # a TLS alert instead of an answer
            raise _Closed() from e
        (correlation,) = struct.unpack_from(">i", data)
        if correlation != self.correlation:
            raise _Closed()
        return data[4:]

    def _read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            self.sock.settimeout(_left(self.deadline))
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise _Closed()
            out += chunk
        return out


def _sasl_reply(body: bytes) -> tuple[int, str | None, bytes]:
    """``(error code, error message, auth bytes)`` of a SaslAuthenticate v1 response."""
    (error, n) = struct.unpack_from(">hh", body)
    pos = 4
    message = None
    if n >= 0:
        message, pos = body[pos:pos + n].decode(errors="replace"), pos + n
    (m,) = struct.unpack_from(">i", body, pos)
    return error, message, body[pos + 4:pos + 4 + max(m, 0)]


def _string(s: str) -> bytes:
    data = s.encode()
    return struct.pack(">h", len(data)) + data


def _bytes(data: bytes) -> bytes:
    return struct.pack(">i", len(data)) + data


def _strings(body: bytes, pos: int) -> list[str]:
    (count,) = struct.unpack_from(">i", body, pos)
    pos += 4
    out = []
    for _ in range(max(count, 0)):
        (n,) = struct.unpack_from(">h", body, pos)
        out.append(body[pos + 2:pos + 2 + n].decode(errors="replace"))
        pos += 2 + n
    return out


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError()
    return left


def _why(e: BaseException) -> str:
    """A short, one-line reason of an OS or TLS error."""
    reason = getattr(e, "reason", None) or getattr(e, "strerror", None) or str(e) \
        or type(e).__name__
    return " ".join(str(reason).split())
