"""The rdma transport's exchange codec and grant bookkeeping: pure functions, no verbs.

A client connects its RC queue pair to a slab over the slab's tcp data-plane socket,
the control channel the slab already listens on:

  client -> slab  HELLO (exactly frames.REQUEST_SIZE bytes, so the data server can read
                  a fixed-size header and only then tell a hello from a READ/WRITE):
                  magic "PR" | version u8 | flags u8 | qpn u32 | psn u32 | lid u16 |
                  mtu u8 | 0 u8 | gid 16s | zero padding
  slab -> client  frames response OK, length ACCEPT_SIZE, then ACCEPT:
                  qpn u32 | psn u32 | lid u16 | mtu u8 | flags u8 | gid 16s |
                  rkey u32 | base u64 | length u64 | incarnation u64
                  (or a frames error response with a reason, then close)

The socket then stays open for the queue pair's life: the slab destroys the QP when it
closes. With memory windows (flag WINDOWS in the accept) each transfer first sends an
ordinary frames READ/WRITE request with its grant over the same socket; the slab
verifies it, binds a window over exactly the granted bytes and answers OK with a
4-byte body: the window's rkey.

Without windows the accept's rkey opens the whole registered buffer to that queue
pair; the client then holds itself to what the grant says (op, incarnation, bounds,
expiry) but cannot check its signature: only the slab has the key.
"""

from __future__ import annotations

import errno
import os
import struct
import time
from dataclasses import dataclass

from polarkv_lib.errors import (
    AccessDenied,
    NetworkError,
    OperationTimeout,
    PolarKVError,
    ProtocolError,
)
from polarkv_lib.wire import frames, grants
from polarkv_lib.wire.grants import Op

MAGIC = b"PR"
VERSION = 1
FLAG_WINDOWS = 0x01  # accept: every transfer needs a window bound for its grant

_HELLO_BODY = "<2sBBIIHBx16s"
_HELLO = struct.Struct(_HELLO_BODY + f"{frames.REQUEST_SIZE - struct.calcsize(_HELLO_BODY)}x")
HELLO_SIZE = _HELLO.size
_ACCEPT = struct.Struct("<IIHBB16sIQQQ")
ACCEPT_SIZE = _ACCEPT.size
_WINDOW = struct.Struct("<I")
WINDOW_SIZE = _WINDOW.size

# enum ibv_mtu: 1 = 256 bytes ... 5 = 4096 bytes (stable verbs ABI).
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
_PSN_MASK = (1 << 24) - 1  # QP numbers and packet sequence numbers are 24-bit


@dataclass(frozen=True, slots=True)
class QpParams:
    """What one side of an RC connection must tell the other to move its QP to RTR."""

    qpn: int
    psn: int
    lid: int
    mtu: int
    gid: bytes  # 16 bytes; all zero on InfiniBand without a global route

    def check(self) -> QpParams:
        if not 0 < self.qpn <= _PSN_MASK or not 0 <= self.psn <= _PSN_MASK:
            raise ProtocolError(f"qpn {self.qpn} / psn {self.psn} outside 24 bits")
        if self.mtu not in MTU_BYTES:
            raise ProtocolError(f"unknown path mtu code {self.mtu}")
        if len(self.gid) != 16 or not 0 <= self.lid <= 0xFFFF:
            raise ProtocolError("malformed gid or lid")
        return self

    @property
    def is_global(self) -> bool:
        """Whether the path needs a GRH (RoCE always; InfiniBand across subnets)."""
        return any(self.gid)


@dataclass(frozen=True, slots=True)
class RemoteBuffer:
    """A slab's registered buffer as the accept described it."""

    rkey: int
    base: int
    length: int
    incarnation: int
    windows: bool


@dataclass(frozen=True, slots=True)
class Target:
    """Where one transfer goes: remote address and how many bytes (rkey comes from the
    buffer, or from a window bound for this grant)."""

    address: int
    length: int
    op: Op


def encode_hello(local: QpParams, flags: int = 0) -> bytes:
    local.check()
    return _HELLO.pack(MAGIC, VERSION, flags, local.qpn, local.psn, local.lid, local.mtu, local.gid)


def is_hello(header: bytes | bytearray | memoryview) -> bool:
    """Whether a data-plane header the slab just read opens an rdma exchange."""
    return bytes(header[:2]) == MAGIC


def decode_hello(frame: bytes | bytearray | memoryview) -> tuple[QpParams, int]:
    if len(frame) != HELLO_SIZE:
        raise ProtocolError(f"an rdma hello is {HELLO_SIZE} bytes, got {len(frame)}")
    magic, version, flags, qpn, psn, lid, mtu, gid = _HELLO.unpack(frame)
    if magic != MAGIC:
        raise ProtocolError("not an rdma hello")
    if version != VERSION:
        raise ProtocolError(f"rdma hello version {version}; this slab speaks {VERSION}")
    return QpParams(qpn, psn, lid, mtu, gid).check(), flags


def encode_accept(local: QpParams, buffer: RemoteBuffer) -> bytes:
    local.check()
    body = _ACCEPT.pack(
        local.qpn,
        local.psn,
        local.lid,
        local.mtu,
        FLAG_WINDOWS if buffer.windows else 0,
        local.gid,
        buffer.rkey,
        buffer.base,
        buffer.length,
        buffer.incarnation,
    )
    return frames.encode_response(frames.Status.OK, len(body)) + body


def decode_accept(body: bytes | bytearray | memoryview) -> tuple[QpParams, RemoteBuffer]:
    if len(body) != ACCEPT_SIZE:
        raise ProtocolError(f"an rdma accept is {ACCEPT_SIZE} bytes, got {len(body)}")
    qpn, psn, lid, mtu, flags, gid, rkey, base, length, incarnation = _ACCEPT.unpack(body)
    if length <= 0:
        raise ProtocolError("slab advertised an empty rdma buffer")
    remote = RemoteBuffer(rkey, base, length, incarnation, bool(flags & FLAG_WINDOWS))
    return QpParams(qpn, psn, lid, mtu, gid).check(), remote


def encode_window(rkey: int) -> bytes:
    return frames.encode_response(frames.Status.OK, WINDOW_SIZE) + _WINDOW.pack(rkey)


def decode_window(body: bytes | bytearray | memoryview) -> int:
    if len(body) != WINDOW_SIZE:
        raise ProtocolError(f"a window answer is {WINDOW_SIZE} bytes, got {len(body)}")
    rkey: int = _WINDOW.unpack(body)[0]
    return rkey


def path_mtu(local: int, remote: int) -> int:
    """Both ends must agree on a path MTU no larger than either port's active one."""
    if local not in MTU_BYTES or remote not in MTU_BYTES:
        raise ProtocolError(f"unknown path mtu code {local} / {remote}")
    return min(local, remote)


def target(
    buffer: RemoteBuffer,
    grant_blob: bytes,
    op: Op,
    offset: int,
    size: int,
    now_ms: int | None = None,
) -> Target:
    """The remote bytes a grant lets this transfer touch.

    Mirrors the slab's own checks (grants.verify) except the signature: the grant must
    be for this op and this incarnation, unexpired, inside the registered buffer, and
    agree with the region the manager described next to it."""
    grant = grants.decode(grant_blob)
    if grant.op is not op:
        raise AccessDenied("grant is for another operation")
    if grant.incarnation != buffer.incarnation:
        raise AccessDenied("grant is for another node or incarnation")
    if grant.expires_ms < (int(time.time() * 1000) if now_ms is None else now_ms):
        raise AccessDenied("grant expired")
    if grant.length <= 0 or grant.offset < 0 or grant.offset + grant.length > buffer.length:
        raise AccessDenied("grant is outside the buffer")
    if (grant.offset, grant.length) != (offset, size):
        raise ProtocolError(
            f"region {offset}+{size} does not match its grant {grant.offset}+{grant.length}"
        )
    return Target(buffer.base + grant.offset, grant.length, op)


# enum ibv_wc_status values (stable verbs ABI) -> what a failed completion means here.
_WC_NAMES = {
    1: "LOC_LEN_ERR",
    2: "LOC_QP_OP_ERR",
    3: "LOC_EEC_OP_ERR",
    4: "LOC_PROT_ERR",
    5: "WR_FLUSH_ERR",
    6: "MW_BIND_ERR",
    7: "BAD_RESP_ERR",
    8: "LOC_ACCESS_ERR",
    9: "REM_INV_REQ_ERR",
    10: "REM_ACCESS_ERR",
    11: "REM_OP_ERR",
    12: "RETRY_EXC_ERR",
    13: "RNR_RETRY_EXC_ERR",
    14: "LOC_RDD_VIOL_ERR",
    15: "REM_INV_RD_REQ_ERR",
    16: "REM_ABORT_ERR",
    17: "INV_EECN_ERR",
    18: "INV_EEC_STATE_ERR",
    19: "FATAL_ERR",
    20: "RESP_TIMEOUT_ERR",
    21: "GENERAL_ERR",
}
_WC_ACCESS = {6, 10, 15}  # the slab's HCA refused the rkey, window or range
_WC_UNREACHABLE = {5, 12, 13, 16, 19, 20}  # the peer is gone, or the QP broke


def wc_status_name(status: int) -> str:
    return "SUCCESS" if status == 0 else _WC_NAMES.get(status, f"status {status}")


def completion_error(status: int, where: str) -> PolarKVError:
    """The PolarKV error a failed work completion stands for."""
    name = wc_status_name(status)
    if status in _WC_ACCESS:
        return AccessDenied(f"{where}: slab refused the access ({name})")
    if status in _WC_UNREACHABLE:
        return NetworkError(f"{where}: slab unreachable or queue pair broken ({name})")
    return ProtocolError(f"{where}: transfer failed ({name})")


def setup_error(what: str, errno_code: int, detail: str = "") -> PolarKVError:
    """A failed verbs set-up call (errno from PyverbsRDMAError) as a PolarKV error with
    the hint an operator needs; registration failures are nearly always memlock."""
    text = f"{what}: {os.strerror(errno_code) if errno_code else detail or 'failed'}"
    if errno_code in (errno.ENOMEM, errno.EPERM, errno.EAGAIN) and "regist" in what:
        text += " (raise the memlock limit: ulimit -l unlimited / LimitMEMLOCK=infinity)"
    if errno_code == errno.ETIMEDOUT:
        return OperationTimeout(text)
    return NetworkError(text)
