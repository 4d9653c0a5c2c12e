"""Throw-away PKI for TLS tests: a CA, a server certificate for 127.0.0.1 / ::1 / localhost and
client certificates, made with ``cryptography`` (a test dependency) into PEM files.

The certificates are RFC 5280's: a Subject Key Identifier on each, an Authority Key
Identifier on each a CA issued, a critical basicConstraints on a CA. Python 3.13's
``ssl.create_default_context`` verifies strictly (``VERIFY_X509_STRICT``) and refused
this PKI's certificates without them (``Missing Authority Key Identifier``) where a test
is a strict client; ``Authority.issue(aki=False)`` still makes one without, as internal
PKIs do, for the proxy's own clients, which verify as Go does."""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pem:
    """A certificate and its key, as files."""

    cert: Path
    key: Path

    def server_context(self) -> ssl.SSLContext:
        """A listening context that serves this certificate and key and asks nothing of its
        clients: the one way the tests make one, so a change of how (a Python version's
        defaults, say) is made here once. Python's server defaults
        (``create_default_context``), which also honour ``SSLKEYLOGFILE``."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert, self.key)
        return ctx

    def client_context(self, ca_file: Path) -> ssl.SSLContext:
        """A client's context that trusts ``ca_file`` and presents this certificate: what
        the tests of client-certificate checks connect with."""
        ctx = ssl.create_default_context(cafile=str(ca_file))
        ctx.load_cert_chain(self.cert, self.key)
        return ctx


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _ski(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> x509.SubjectKeyIdentifier:
    """The Subject Key Identifier of ``key``'s certificate (RFC 5280's method 1, a SHA-1 of
    the public key)."""
    return x509.SubjectKeyIdentifier.from_public_key(key.public_key())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


class Authority:
    """A CA that issues server and client certificates into ``folder``."""

    _key: ec.EllipticCurvePrivateKey
    _cert: x509.Certificate

    def __init__(self, folder: Path, name: str = "test-ca", *,
                 issuer: Authority | None = None) -> None:
        """Self-signed (a root), or an intermediate CA ``issuer`` issued."""
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        b = (
            x509.CertificateBuilder().subject_name(_name(name))
            .issuer_name(issuer._cert.subject if issuer is not None else _name(name))
            .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(_ski(self._key), critical=False)
        )
        if issuer is not None:
            b = b.add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                issuer._key.public_key()), critical=False)
        self._cert = b.sign(issuer._key if issuer is not None else self._key, hashes.SHA256())
        self.ca_file = folder / f"{name}.pem"
        _write_cert(self.ca_file, self._cert)

    def intermediate(self, name: str) -> Authority:
        """A CA this one issued, its file ``name``.pem holding its certificate alone: a
        trust anchor for Go (every certificate of a root pool is one), for OpenSSL only
        with ``VERIFY_X509_PARTIAL_CHAIN``."""
        return Authority(self.folder, name, issuer=self)

    def issue(self, cn: str, *, server: bool, rsa_key: bool = False,
              valid: tuple[datetime.timedelta, datetime.timedelta] | None = None,
              aki: bool = True) -> Pem:
        """A leaf certificate: ``server`` for 127.0.0.1, ::1 and localhost, else a client's; an
        ECDSA key, or RSA with ``rsa_key``; valid from 5 min ago for a day, or from now
        plus ``valid[0]`` to now plus ``valid[1]``; without an Authority Key Identifier
        when not ``aki`` (what a strict verifier refuses and Go accepts)."""
        key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey = (
            rsa.generate_private_key(public_exponent=65537, key_size=2048) if rsa_key
            else ec.generate_private_key(ec.SECP256R1()))
        now = datetime.datetime.now(datetime.UTC)
        begin, end = valid or (datetime.timedelta(minutes=-5), datetime.timedelta(days=1))
        b = (
            x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(self._cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now + begin)
            .not_valid_after(now + end)
            .add_extension(x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False)
            .add_extension(_ski(key), critical=False)
        )
        if aki:
            b = b.add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                self._key.public_key()), critical=False)
        if server:
            b = b.add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                x509.IPAddress(ipaddress.ip_address("::1"))]),
                critical=False)
        cert = b.sign(self._key, hashes.SHA256())
        pem = Pem(self.folder / f"{cn}.crt", self.folder / f"{cn}.key")
        _write_cert(pem.cert, cert)
        _write_key(pem.key, key)
        return pem


@dataclass(frozen=True)
class Issued:
    """A certificate and the file of the CA that issued it, which its verifier trusts."""

    pem: Pem
    ca_file: Path


def without_aki(folder: Path, cn: str) -> Issued:
    """A server certificate ``cn`` an internal CA issued without an Authority Key
    Identifier, and that CA's file: what a strict verifier (Python 3.13's default
    context) refuses and Go takes, the case of the proxy's clients verifying as Go does."""
    ca = Authority(folder, "internal-ca")
    return Issued(ca.issue(cn, server=True, aki=False), ca.ca_file)


def self_signed_client(folder: Path, cn: str, *, ca: bool | None) -> Pem:
    """A client certificate that is its own issuer, as a bundle pins one: with
    ``CA:FALSE`` (``ca`` False), ``CA:TRUE`` (True), or no basicConstraints (None).
    OpenSSL trusts it as a trust anchor whatever its flag."""
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    b = (
        x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(_ski(key), critical=False)
    )
    if ca is not None:
        b = b.add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    pem = Pem(folder / f"{cn}.crt", folder / f"{cn}.key")
    _write_cert(pem.cert, b.sign(key, hashes.SHA256()))
    _write_key(pem.key, key)
    return pem


def install(src: Pem, dst: Pem) -> None:
    """Put ``src`` in ``dst``'s place the way a Secret volume does: a new file renamed over
    the old (a new inode), the certificate first, so a check can catch the pair half done."""
    for a, b in ((src.cert, dst.cert), (src.key, dst.key)):
        tmp = b.with_suffix(b.suffix + ".tmp")
        tmp.write_bytes(a.read_bytes())
        os.replace(tmp, b)
