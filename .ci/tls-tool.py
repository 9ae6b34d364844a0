#!/usr/bin/python3
"""NATS keys and TLS probes for idem's local TLS listeners (see .ci/tls.sh).

Standard library plus `cryptography` (Debian: python3-cryptography), nothing from the network.

  tls-tool.py nats-keys DIR      write DIR/user.nk, DIR/user.creds and DIR/nats/* if missing
  tls-tool.py nats PORT [--nk FILE | --creds FILE] [--cert C --key K] --ca CA [--host H] [--jetstream]
                                 INFO, TLS upgrade, CONNECT, PING: exit 0 on PONG (and with
                                 --jetstream on a $JS.API.INFO answer without error)
  tls-tool.py kafka PORT --ca CA [--host H]
                                 TLS, then Kafka ApiVersions v0 (exit 0 on error_code 0) and
                                 Metadata v0 (prints the advertised brokers)
  tls-tool.py amqp PORT --ca CA [--cert C --key K] [--host H] [--version 0-9-1|1.0] [--external]
                                 TLS, then the AMQP protocol header (exit 0 when the broker answers),
                                 with --external also a SASL EXTERNAL login with the certificate
Every probe takes --plaintext (no TLS; a TLS-only listener must refuse it). Exit 1 on a refusal.

NKeys (github.com/nats-io/nkeys): base32 (no padding) of prefix byte(s) + Ed25519 key + CRC-16
(XMODEM, little-endian). NATS JWTs (github.com/nats-io/jwt v2): base64url (no padding) of the
header {"typ":"JWT","alg":"ed25519-nkey"} and the claims, signed with the issuer's Ed25519 key.
"""
import argparse
import base64
import hashlib
import json
import os
import socket
import ssl
import struct
import sys
import time

PREFIX_SEED = 18 << 3
PREFIX_OPERATOR = 14 << 3
PREFIX_ACCOUNT = 0
PREFIX_USER = 20 << 3


def crc16(data):
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def b32(raw):
    raw += struct.pack("<H", crc16(raw))
    return base64.b32encode(raw).decode().rstrip("=")


def unb32(text):
    raw = base64.b32decode(text + "=" * (-len(text) % 8))
    body, crc = raw[:-2], struct.unpack("<H", raw[-2:])[0]
    if crc16(body) != crc:
        raise ValueError("nkey checksum mismatch")
    return body


class NKey:
    def __init__(self, prefix, seed=None):
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        self.prefix = prefix
        self.seed_bytes = seed if seed is not None else os.urandom(32)
        self.key = Ed25519PrivateKey.from_private_bytes(self.seed_bytes)
        self.public_bytes = self.key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    @classmethod
    def from_seed(cls, text):
        raw = unb32(text.strip())
        prefix = ((raw[0] & 7) << 5) | ((raw[1] & 0xF8) >> 3)
        if raw[0] & 0xF8 != PREFIX_SEED:
            raise ValueError("not an nkey seed")
        return cls(prefix, raw[2:34])

    @property
    def seed(self):
        return b32(bytes([PREFIX_SEED | (self.prefix >> 5), (self.prefix & 31) << 3]) + self.seed_bytes)

    @property
    def public(self):
        return b32(bytes([self.prefix]) + self.public_bytes)

    def sign(self, data):
        return self.key.sign(data)


def b64url(data):
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def jwt(issuer, subject_public, name, nats):
    claims = {"iat": int(time.time()), "iss": issuer.public, "name": name, "sub": subject_public, "nats": nats}
    claims["jti"] = base64.b32encode(hashlib.sha256(json.dumps(claims, sort_keys=True).encode()).digest()).decode().rstrip("=")
    head = b64url(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}, separators=(",", ":")).encode())
    body = b64url(json.dumps(claims, separators=(",", ":")).encode())
    return f"{head}.{body}.{b64url(issuer.sign(f'{head}.{body}'.encode()))}"


def write_private(path, text):
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


CREDS = """-----BEGIN NATS USER JWT-----
{jwt}
------END NATS USER JWT------

************************* IMPORTANT *************************
NKEY Seed printed below can be used to sign and prove identity.
NKEYs are sensitive and should be treated as secrets.

-----BEGIN USER NKEY SEED-----
{seed}
------END USER NKEY SEED------

*************************************************************
"""


def nats_keys(directory):
    """An nkey user (user.nk) and an operator > account > user chain (user.creds, nats/operator.conf).

    The operator also signs a system account, which JetStream needs in operator mode.
    """
    os.makedirs(os.path.join(directory, "nats"), exist_ok=True)
    nk_path = os.path.join(directory, "user.nk")
    if not os.path.exists(nk_path):
        write_private(nk_path, NKey(PREFIX_USER).seed + "\n")
    user = NKey.from_seed(open(nk_path).read())
    with open(os.path.join(directory, "user.nk.pub"), "w") as f:
        f.write(user.public + "\n")

    conf = os.path.join(directory, "nats", "operator.conf")
    creds = os.path.join(directory, "user.creds")
    if os.path.exists(conf) and os.path.exists(creds):
        return
    operator, account, creds_user = NKey(PREFIX_OPERATOR), NKey(PREFIX_ACCOUNT), NKey(PREFIX_USER)
    system = NKey(PREFIX_ACCOUNT)   # JetStream in operator mode needs a system account
    unlimited = -1
    operator_jwt = jwt(operator, operator.public, "idem-operator",
                       {"system_account": system.public, "type": "operator", "version": 2})
    system_jwt = jwt(operator, system.public, "SYS", {
        "limits": {"subs": unlimited, "data": unlimited, "payload": unlimited, "imports": unlimited,
                   "exports": unlimited, "wildcards": True, "conn": unlimited, "leaf": unlimited},
        "default_permissions": {"pub": {}, "sub": {}},
        "type": "account", "version": 2})
    account_jwt = jwt(operator, account.public, "idem-account", {
        "limits": {"subs": unlimited, "data": unlimited, "payload": unlimited, "imports": unlimited,
                   "exports": unlimited, "wildcards": True, "conn": unlimited, "leaf": unlimited,
                   "mem_storage": unlimited, "disk_storage": unlimited, "streams": unlimited,
                   "consumer": unlimited},
        "default_permissions": {"pub": {}, "sub": {}},
        "type": "account", "version": 2})
    user_jwt = jwt(account, creds_user.public, "idem-creds-user", {
        "pub": {}, "sub": {}, "subs": unlimited, "data": unlimited, "payload": unlimited,
        "type": "user", "version": 2})
    write_private(os.path.join(directory, "nats", "operator.seed"), operator.seed + "\n")
    write_private(os.path.join(directory, "nats", "account.seed"), account.seed + "\n")
    write_private(creds, CREDS.format(jwt=user_jwt, seed=creds_user.seed))
    write_private(conf, f'operator: "{operator_jwt}"\nsystem_account: {system.public}\nresolver: MEMORY\n'
                        f'resolver_preload: {{\n  {account.public}: "{account_jwt}"\n'
                        f'  {system.public}: "{system_jwt}"\n}}\n')


def secure(sock, args):
    """TLS over SOCK, verifying the server against --ca and --host; as is with --plaintext."""
    if args.plaintext:
        return sock
    ctx = ssl.create_default_context(cafile=args.ca)
    if args.cert:
        ctx.load_cert_chain(args.cert, args.key)
    return ctx.wrap_socket(sock, server_hostname=args.host)


def connect(args):
    return secure(socket.create_connection((args.host, args.port), timeout=5), args)


def transport(sock):
    return sock.version() if isinstance(sock, ssl.SSLSocket) else "plaintext"


def read_line(sock):
    data = b""
    while not data.endswith(b"\r\n"):
        chunk = sock.recv(1)
        if not chunk:
            raise ConnectionError(f"closed after {data!r}")
        data += chunk
    return data.decode()


def read_exact(sock, size):
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {size} bytes")
        data += chunk
    return data


def probe_nats(args):
    sock = socket.create_connection((args.host, args.port), timeout=5)
    info = read_line(sock)
    if not info.startswith("INFO "):
        raise ConnectionError(f"expected INFO, got {info!r}")
    info = json.loads(info[5:])
    if not info.get("tls_required") and not args.plaintext:
        raise ConnectionError("server does not require TLS")
    sock = secure(sock, args)
    hello = {"verbose": False, "pedantic": False, "tls_required": not args.plaintext,
             "name": "idem-tls-selftest", "lang": "python", "version": "0", "protocol": 1}
    nonce = info.get("nonce", "").encode()
    if args.nk:
        key = NKey.from_seed(open(args.nk).read())
        hello.update(nkey=key.public, sig=b64url(key.sign(nonce)))
    if args.creds:
        text = open(args.creds).read()
        blocks = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith(("---", "***"))
                  and " " not in line.strip()]
        user_jwt, seed = blocks[0], blocks[-1]
        hello.update(jwt=user_jwt, sig=b64url(NKey.from_seed(seed).sign(nonce)))
    sock.sendall(f"CONNECT {json.dumps(hello)}\r\nPING\r\n".encode())
    reply = read_line(sock)
    if reply.strip() != "PONG":
        raise ConnectionError(f"expected PONG, got {reply.strip()!r}")
    result = "PONG"
    if args.jetstream:
        sock.sendall(b"SUB _INBOX.idem-selftest 1\r\nPUB $JS.API.INFO _INBOX.idem-selftest 0\r\n\r\n")
        while True:
            line = read_line(sock).strip()
            if line == "PING":
                sock.sendall(b"PONG\r\n")
            elif line.startswith("MSG "):
                answer = json.loads(read_exact(sock, int(line.split()[-1]) + 2)[:-2])
                break
            elif line.startswith("-ERR"):
                raise ConnectionError(line)
        if "error" in answer:
            raise ConnectionError(f"JetStream: {answer['error']}")
        result += f", JetStream account info ({answer.get('streams', 0)} streams)"
    print(f"nats {args.host}:{args.port}: {transport(sock)}, {result}")


def probe_kafka(args):
    sock = connect(args)
    client = b"idem-tls-selftest"
    body = struct.pack(">hhih", 18, 0, 7, len(client)) + client   # ApiVersions v0, correlation id 7
    sock.sendall(struct.pack(">i", len(body)) + body)
    size = struct.unpack(">i", read_exact(sock, 4))[0]
    correlation, error = struct.unpack(">ih", read_exact(sock, size)[:6])
    if correlation != 7 or error != 0:
        raise ConnectionError(f"ApiVersions: correlation {correlation}, error {error}")
    # Metadata v0 (no topics): the brokers a client will connect to next.
    body = struct.pack(">hhih", 3, 0, 8, len(client)) + client + struct.pack(">i", 0)
    sock.sendall(struct.pack(">i", len(body)) + body)
    data = read_exact(sock, struct.unpack(">i", read_exact(sock, 4))[0])
    brokers, offset = [], 8
    for _ in range(struct.unpack(">i", data[4:8])[0]):
        length = struct.unpack(">h", data[offset + 4:offset + 6])[0]
        host = data[offset + 6:offset + 6 + length].decode()
        brokers.append(f"{host}:{struct.unpack('>i', data[offset + 6 + length:offset + 10 + length])[0]}")
        offset += 10 + length
    print(f"kafka {args.host}:{args.port}: {transport(sock)}, ApiVersions ok, brokers {' '.join(brokers)}")


def amqp091_frame(sock):
    kind, channel, size = struct.unpack(">BHI", read_exact(sock, 7))
    payload = read_exact(sock, size + 1)[:-1]
    return kind, payload


def probe_amqp(args):
    """The protocol header; with --external also a SASL EXTERNAL login as the certificate's CN."""
    sock = connect(args)
    if args.version == "0-9-1":
        sock.sendall(b"AMQP\x00\x00\x09\x01")
        kind, payload = amqp091_frame(sock)
        if kind != 1 or payload[:4] != b"\x00\x0a\x00\x0a":
            raise ConnectionError(f"expected connection.start, got frame {kind} {payload[:8]!r}")
        table = struct.unpack(">I", payload[6:10])[0]
        offset = 10 + table
        mechanisms = payload[offset + 4:offset + 4 + struct.unpack(">I", payload[offset:offset + 4])[0]].decode()
        result = f"mechanisms {mechanisms}"
        if args.external:
            if "EXTERNAL" not in mechanisms.split():
                raise ConnectionError(f"EXTERNAL not offered ({mechanisms})")
            body = (b"\x00\x0a\x00\x0b" + struct.pack(">I", 0) + b"\x08EXTERNAL" + struct.pack(">I", 0)
                    + b"\x05en_US")
            sock.sendall(struct.pack(">BHI", 1, 0, len(body)) + body + b"\xce")
            try:
                kind, payload = amqp091_frame(sock)
            except ConnectionError as err:
                raise ConnectionError(f"EXTERNAL login refused ({err})")
            if payload[:4] != b"\x00\x0a\x00\x1e":
                raise ConnectionError(f"EXTERNAL login refused: {payload[:60]!r}")
            result += ", EXTERNAL login ok (connection.tune)"
    else:
        header = b"AMQP\x03\x01\x00\x00"                # the SASL layer
        sock.sendall(header)
        if read_exact(sock, 8) != header:
            raise ConnectionError("AMQP 1.0: the SASL header was not echoed")
        size = struct.unpack(">I", read_exact(sock, 4))[0]
        mechanisms = read_exact(sock, size - 4)
        result = "sasl-mechanisms " + ",".join(
            m.decode() for m in (b"PLAIN", b"AMQPLAIN", b"EXTERNAL", b"ANONYMOUS") if m in mechanisms)
        if args.external:
            # sasl-init (0x41): mechanism and an empty initial-response. RabbitMQ 3.10 fails the
            # connection (amqp:internal-error) when initial-response is absent.
            init = b"\x00\x53\x41\xc0" + bytes([1 + 10 + 2, 2]) + b"\xa3\x08EXTERNAL" + b"\xa0\x00"
            sock.sendall(struct.pack(">IBBH", 8 + len(init), 2, 1, 0) + init)
            size = struct.unpack(">I", read_exact(sock, 4))[0]
            outcome = read_exact(sock, size - 4)[4:]
            # sasl-outcome: descriptor 0x44, then a list whose first field is the code (ubyte, 0 = ok)
            if outcome[:3] != b"\x00\x53\x44" or b"\x50\x00" not in outcome[3:9]:
                raise ConnectionError(f"EXTERNAL login refused: {outcome!r}")
            result += ", EXTERNAL login ok (sasl-outcome ok)"
    print(f"amqp {args.version} {args.host}:{args.port}: {transport(sock)}, {result}")


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    keys = sub.add_parser("nats-keys")
    keys.add_argument("dir")
    for name in ("nats", "kafka", "amqp"):
        p = sub.add_parser(name)
        p.add_argument("port", type=int)
        p.add_argument("--host", default="localhost")
        p.add_argument("--ca", required=True)
        p.add_argument("--cert")
        p.add_argument("--key")
        p.add_argument("--plaintext", action="store_true", help="no TLS (expected to be refused)")
        if name == "nats":
            p.add_argument("--nk")
            p.add_argument("--creds")
            p.add_argument("--jetstream", action="store_true", help="also ask for JetStream account info")
        if name == "amqp":
            p.add_argument("--version", choices=["0-9-1", "1.0"], default="0-9-1")
            p.add_argument("--external", action="store_true")
    args = parser.parse_args()
    try:
        {"nats-keys": lambda: nats_keys(args.dir), "nats": lambda: probe_nats(args),
         "kafka": lambda: probe_kafka(args), "amqp": lambda: probe_amqp(args)}[args.cmd]()
    except (OSError, ValueError, ConnectionError) as err:
        print(f"{args.cmd}: {type(err).__name__}: {err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
