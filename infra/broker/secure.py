"""The files and settings of a ``--secure`` local Kafka (``relax broker start --secure``):
a SASL_SSL client listener, SCRAM-SHA-256 user :data:`USER` with a random password, TLS
from a CA made here.

In the cluster's folder, made once when its storage is formatted:

- ``tls/ca.pem``: the CA certificate clients trust (``bus.ssl_cafile``); the CA's key is
  not kept (nothing else is ever signed with it);
- ``tls/server.pem``: the nodes' key (PKCS#8, unencrypted, mode 600) and certificate,
  signed by the CA, for ``127.0.0.1``, ``localhost``, the listen host and this machine's
  name (Kafka reads it as ``ssl.keystore.type=PEM``);
- ``client.password``: the user's password (mode 600, ``bus.sasl_password_file``); Kafka
  keeps only its salted SCRAM hash, written at format time
  (``StorageTool format --add-scram``);
- ``client.properties``: the same settings for Apache Kafka's own tools (mode 600: it
  holds the password), ``relax broker tool topics ... --command-config DIR/client.properties``.

Each node also listens on an ``INTERNAL`` PLAINTEXT listener on 127.0.0.1 (its
``internal_port``) for traffic between brokers and for the readiness check; clients
use the SASL_SSL port.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets
import socket
from pathlib import Path

USER = "relax"
"""The SCRAM user a ``--secure`` local Kafka is formatted with."""

MECHANISM = "SCRAM-SHA-256"
"""The SASL mechanism of a ``--secure`` local Kafka's client listener."""

PASSWORD_FILE = "client.password"
"""In the cluster's folder: :data:`USER`'s password (mode 600)."""

TOOLS_CONFIG = "client.properties"
"""In the cluster's folder: the client settings of Kafka's Java tools (mode 600)."""

CA_FILE = "tls/ca.pem"
"""In the cluster's folder: the CA certificate (PEM) that signed the nodes' certificate."""

SERVER_PEM = "tls/server.pem"
"""In the cluster's folder: the nodes' private key and certificate chain (PEM, mode 600)."""

CERT_DAYS = 3650
"""Validity of the CA and server certificates (days)."""


def make_tls(data_dir: Path, host: str) -> None:
    """Write :data:`CA_FILE` and :data:`SERVER_PEM` under ``data_dir``: an EC P-256 CA
    and a server certificate it signs, valid :data:`CERT_DAYS` days, whose subject
    alternative names are 127.0.0.1, localhost, ``host`` and this machine's name."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.UTC)
    start, end = now - dt.timedelta(hours=1), now + dt.timedelta(days=CERT_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                            f"relax local Kafka CA {secrets.token_hex(4)}")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                       False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for name in dict.fromkeys(["127.0.0.1", "localhost", host, socket.gethostname()]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            names.append(x509.DNSName(name))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    (data_dir / "tls").mkdir(parents=True, exist_ok=True)
    (data_dir / CA_FILE).write_bytes(ca.public_bytes(pem))
    _write_private(data_dir / SERVER_PEM, key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        + cert.public_bytes(pem) + ca.public_bytes(pem))


def make_password(data_dir: Path) -> str:
    """A new random password for :data:`USER`, written to :data:`PASSWORD_FILE` and into
    :data:`TOOLS_CONFIG` (both mode 600); returned for the format command only (never
    logged)."""
    password = secrets.token_urlsafe(24)  # [A-Za-z0-9_-]: nothing to quote anywhere
    _write_private(data_dir / PASSWORD_FILE, password.encode() + b"\n")
    _write_private(data_dir / TOOLS_CONFIG, (
        "security.protocol=SASL_SSL\n"
        f"sasl.mechanism={MECHANISM}\n"
        "sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required "
        f'username="{USER}" password="{password}";\n'
        "ssl.truststore.type=PEM\n"
        f"ssl.truststore.location={data_dir / CA_FILE}\n").encode())
    return password


def _write_private(path: Path, data: bytes) -> None:
    """``data`` to a new file only its owner reads (mode 600 from its creation)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def scram_arg(password: str) -> str:
    """``StorageTool format --add-scram`` value creating :data:`USER` with ``password``."""
    return f"{MECHANISM}=[name={USER},password={password}]"


def listener_properties(host: str, port: int, internal_port: int, controller_port: int,
                        data_dir: Path) -> dict[str, str]:
    """A secure node's listener settings for its ``server.properties``: SASL_SSL clients
    on ``host:port``, the INTERNAL PLAINTEXT listener on ``127.0.0.1:internal_port``
    between brokers, the KRaft controller on ``host:controller_port``."""
    return {
        "listeners": (f"SASL_SSL://{host}:{port},INTERNAL://127.0.0.1:{internal_port},"
                      f"CONTROLLER://{host}:{controller_port}"),
        "advertised.listeners": f"SASL_SSL://{host}:{port},INTERNAL://127.0.0.1:{internal_port}",
        "listener.security.protocol.map": ("SASL_SSL:SASL_SSL,INTERNAL:PLAINTEXT,"
                                           "CONTROLLER:PLAINTEXT"),
        "inter.broker.listener.name": "INTERNAL",
        "sasl.enabled.mechanisms": MECHANISM,
        f"listener.name.sasl_ssl.{MECHANISM.lower()}.sasl.jaas.config":
            "org.apache.kafka.common.security.scram.ScramLoginModule required;",
        "ssl.keystore.type": "PEM",
        "ssl.keystore.location": str(data_dir / SERVER_PEM),
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(data_dir / CA_FILE),
        "ssl.client.auth": "none",
    }


def client_settings(data_dir: Path) -> dict[str, str]:
    """The ``BusConfig`` settings (no secret: the password's file) of a client of the
    secure cluster in ``data_dir``."""
    return {"security_protocol": "SASL_SSL", "sasl_mechanism": MECHANISM,
            "sasl_username": USER, "sasl_password_file": str(data_dir / PASSWORD_FILE),
            "ssl_cafile": str(data_dir / CA_FILE)}


def settings_line(security: dict[str, str]) -> str:
    """``bus.security_protocol=SASL_SSL bus.sasl_mechanism=...``: recipe overrides for
    ``relax train`` (the environment variables of the tools are printed by
    ``relax broker start``)."""
    return " ".join(f"bus.{k}={v}" for k, v in security.items())
