"""A throwaway PKI for a local control plane: CA, serving cert, client certs, SA keys."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_DAYS = 30


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    admin_cert: Path
    admin_key: Path
    sa_key: Path  # private key that signs service-account tokens
    sa_pub: Path


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _write_key(key: rsa.RSAPrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path.chmod(0o600)


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def _cert(
    subject: x509.Name,
    key: rsa.RSAPrivateKey,
    issuer: x509.Name,
    issuer_key: rsa.RSAPrivateKey,
    *,
    ca: bool = False,
    server: bool = False,
    dns_names: tuple[str, ...] = (),
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=_DAYS))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        b = b.add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
    else:
        usage = [ExtendedKeyUsageOID.SERVER_AUTH] if server else [ExtendedKeyUsageOID.CLIENT_AUTH]
        b = b.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    if server:
        b = b.add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.DNSName("kubernetes"),
                    x509.DNSName("kubernetes.default"),
                    x509.DNSName("kubernetes.default.svc"),
                    x509.DNSName("kubernetes.default.svc.cluster.local"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    x509.IPAddress(ipaddress.ip_address("10.0.0.1")),
                    *(x509.DNSName(n) for n in dns_names),
                ]
            ),
            critical=False,
        )
    return b.sign(issuer_key, hashes.SHA256())


def _write_cert(cert: x509.Certificate, path: Path) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def make_pki(folder: Path) -> Pki:
    """Write a fresh CA, apiserver serving cert, admin client cert and SA key pair."""
    folder.mkdir(parents=True, exist_ok=True)
    p = Pki(
        ca_cert=folder / "ca.crt",
        ca_key=folder / "ca.key",
        serving_cert=folder / "apiserver.crt",
        serving_key=folder / "apiserver.key",
        admin_cert=folder / "admin.crt",
        admin_key=folder / "admin.key",
        sa_key=folder / "sa.key",
        sa_pub=folder / "sa.pub",
    )
    ca_key = _key()
    ca_name = _name("rankguard-test-ca")
    _write_key(ca_key, p.ca_key)
    _write_cert(_cert(ca_name, ca_key, ca_name, ca_key, ca=True), p.ca_cert)

    srv_key = _key()
    _write_key(srv_key, p.serving_key)
    _write_cert(_cert(_name("kube-apiserver"), srv_key, ca_name, ca_key, server=True), p.serving_cert)

    # O=system:masters is what makes this client cluster-admin under RBAC.
    adm_key = _key()
    _write_key(adm_key, p.admin_key)
    _write_cert(_cert(_name("rankguard-admin", "system:masters"), adm_key, ca_name, ca_key), p.admin_cert)

    sa_key = _key()
    _write_key(sa_key, p.sa_key)
    p.sa_pub.write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return p


def make_self_signed(folder: Path, cn: str, dns_names: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """A self-signed serving certificate for 127.0.0.1 (and localhost), written as `tls.crt`
    and `tls.key` in `folder` (the names controller-runtime's webhook server reads): a webhook
    that the API server reaches by `url`, its configuration's caBundle being the cert itself.
    `dns_names` adds names to it, such as the `<service>.<namespace>.svc` by which the API
    server's aggregator checks an APIService's backend (external_metrics.py)."""
    folder.mkdir(parents=True, exist_ok=True)
    key = _key()
    name = _name(cn)
    crt, key_path = folder / "tls.crt", folder / "tls.key"
    _write_key(key, key_path)
    _write_cert(_cert(name, key, name, key, server=True, dns_names=dns_names), crt)
    return crt, key_path
