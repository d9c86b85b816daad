"""pyverbs behind a small surface: finding a device, registering memory, one RC queue pair.

pyverbs is optional (the `[rdma]` extra, or Debian's python3-pyverbs): it is imported
on first use, never at module import, and either of its enum modules is accepted
(`pyverbs.libibverbs_enums` in recent rdma-core, `pyverbs.enums` before). A kernel
without RDMA makes `get_device_list()` raise; that, an empty list, a missing device or
a port that is not ACTIVE all mean "no device" and raise RdmaUnavailable with the
reason, which `auto` turns into a fallback to tcp and an explicit `rdma` into a
start-up error.

Completions are waited for in the calling (transfer) thread, never on an event loop:
poll the CQ a few times (a small transfer completes in microseconds), then wait on the
completion channel's fd with select(), which releases the GIL, until the deadline.
Older pyverbs (rdma-core 44, Debian bookworm's) exposes no fd; there the wait polls with
short sleeps.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import secrets
import select
import threading
import time
from types import ModuleType
from typing import Any

from polarkv_lib.errors import ConfigError, OperationTimeout, PolarKVError
from polarkv_lib.transport import rdma_wire
from polarkv_lib.transport.rdma_wire import QpParams

# RC retry settings (ibv_rc_pingpong's): ~4 s ack timeout x 7 retries before a dead peer
# shows as RETRY_EXC_ERR; the deadline, not these, bounds what a caller waits.
MIN_RNR_TIMER, TIMEOUT, RETRY_CNT, RNR_RETRY = 12, 14, 7, 7
HOP_LIMIT = 64
MAX_RD_ATOMIC = 16  # outstanding RDMA READs per QP, capped by the device's limit
_SPINS = 50  # CQ polls before sleeping on the channel
_MAX_NAP = 0.0002  # longest sleep between polls where the channel has no fd


class RdmaUnavailable(ConfigError):
    """No usable RDMA here: pyverbs missing, no device, or no active port."""


class Verbs:
    """The pyverbs modules this package uses, with enum lookup by name."""

    def __init__(self) -> None:
        names = ("device", "pd", "mr", "qp", "cq", "wr", "addr", "pyverbs_error")
        mods = _import_quietly(names)
        self.device, self.pd, self.mr, self.qp = mods["device"], mods["pd"], mods["mr"], mods["qp"]
        self.cq, self.wr, self.addr = mods["cq"], mods["wr"], mods["addr"]
        self.error: type[Exception] = mods["pyverbs_error"].PyverbsError
        self.rdma_error: type[Exception] = mods["pyverbs_error"].PyverbsRDMAError
        self.enums = enum_module()

    def __getattr__(self, name: str) -> int:
        """IBV_* constants: `v.IBV_MTU_1024`."""
        if not name.startswith("IBV_"):
            raise AttributeError(name)
        return int(getattr(self.enums, name))


def _import_quietly(names: tuple[str, ...]) -> dict[str, ModuleType]:
    """Import pyverbs modules without letting them configure logging: pyverbs.base calls
    logging.basicConfig(level=INFO) at import, which would put a stderr handler on the
    root logger of whatever process (an engine, a CLI with JSON logs) imported it."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        return {n: importlib.import_module(f"pyverbs.{n}") for n in names}
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def enum_module() -> ModuleType:
    try:
        return importlib.import_module("pyverbs.libibverbs_enums")
    except ImportError:
        return importlib.import_module("pyverbs.enums")


_loaded: Verbs | None = None
_load_lock = threading.Lock()


def verbs() -> Verbs:
    global _loaded
    with _load_lock:
        if _loaded is None:
            try:
                _loaded = Verbs()
            except ImportError as exc:
                raise RdmaUnavailable(
                    f"pyverbs is not installed ({exc}); install rdma-core's python3-pyverbs "
                    "(scripts/setup-rdma) or the [rdma] extra"
                ) from None
        return _loaded


def errno_of(exc: BaseException) -> int:
    code = getattr(exc, "error_code", 0)
    return code if isinstance(code, int) else 0


def device_names(v: Verbs) -> list[str]:
    try:
        devices = v.device.get_device_list()
    except v.error as exc:
        raise RdmaUnavailable(
            f"no RDMA device: the kernel lists none ({exc}; no ib_uverbs, "
            "no rdma_rxe, or /sys/class/infiniband missing)"
        ) from None
    names = [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]
    if not names:
        raise RdmaUnavailable("no RDMA device: the device list is empty")
    return names


def probe(device: str = "", port: int = 1) -> str | None:
    """None when an RDMA device with an active port is usable here, else the reason."""
    try:
        hca = Hca(device, port)
    except RdmaUnavailable as exc:
        return str(exc)
    hca.close()
    return None


def gid_text(gid: bytes) -> str:
    """16 raw bytes -> pyverbs' 'xxxx:xxxx:...' (8 groups; it parses no '::' shorthand)."""
    h = gid.hex()
    return ":".join(h[i : i + 4] for i in range(0, 32, 4))


def gid_bytes(text: str) -> bytes:
    raw = bytes.fromhex(text.replace(":", ""))
    if len(raw) != 16:
        raise ValueError(f"not a gid: {text!r}")
    return raw


def access_flags(v: Verbs, *names: str) -> int:
    flags = 0
    for name in names:
        flags |= getattr(v, f"IBV_ACCESS_{name}")
    return flags


def init_attr(v: Verbs, port: int, access: int) -> Any:
    """RESET -> INIT: the port, and what the peer may do through this QP."""
    attr = v.qp.QPAttr(qp_state=v.IBV_QPS_INIT, port_num=port)
    attr.pkey_index = 0
    attr.qp_access_flags = access
    return attr


def connect_attr(
    v: Verbs, port: int, gid_index: int, remote: QpParams, mtu: int, local_psn: int, rd_atomic: int
) -> Any:
    """INIT -> RTR -> RTS towards `remote` (the attributes both transitions read)."""
    attr = v.qp.QPAttr(port_num=port)
    attr.path_mtu = mtu
    attr.dest_qp_num = remote.qpn
    attr.rq_psn = remote.psn
    attr.sq_psn = local_psn
    attr.max_dest_rd_atomic = rd_atomic
    attr.max_rd_atomic = rd_atomic
    attr.min_rnr_timer, attr.timeout = MIN_RNR_TIMER, TIMEOUT
    attr.retry_cnt, attr.rnr_retry = RETRY_CNT, RNR_RETRY
    if remote.is_global:
        route = v.addr.GlobalRoute(
            dgid=v.addr.GID(gid_text(remote.gid)), sgid_index=gid_index, hop_limit=HOP_LIMIT
        )
        attr.ah_attr = v.addr.AHAttr(port_num=port, is_global=1, gr=route, dlid=remote.lid)
    else:
        attr.ah_attr = v.addr.AHAttr(port_num=port, is_global=0, dlid=remote.lid)
    return attr


def qp_cap(v: Verbs, depth: int) -> Any:
    """Send queue only: the data path never posts receives."""
    return v.qp.QPCap(max_send_wr=depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)


def rdma_requests(
    v: Verbs, opcode: int, local: int, lkey: int, remote: int, rkey: int, length: int, max_msg: int
) -> list[Any]:
    """One READ or WRITE as WRs of at most the port's message size; only the last is
    signaled (an RC send queue completes in order, and any error is reported anyway)."""
    starts = range(0, length, max_msg)
    out = []
    for i, start in enumerate(starts):
        size = min(max_msg, length - start)
        last = i == len(starts) - 1
        wr = v.wr.SendWR(
            wr_id=i,
            opcode=opcode,
            num_sge=1,
            sg=[v.wr.SGE(local + start, size, lkey)],
            send_flags=v.IBV_SEND_SIGNALED if last else 0,
        )
        wr.set_wr_rdma(rkey, remote + start)
        out.append(wr)
    return out


def qp_init(v: Verbs, cq: Any, depth: int) -> Any:
    """An RC QP on one CQ; only WRs flagged SIGNALED complete (one per transfer)."""
    return v.qp.QPInitAttr(qp_type=v.IBV_QPT_RC, scq=cq, rcq=cq, cap=qp_cap(v, depth), sq_sig_all=0)


def buffer_address(view: memoryview) -> Any:
    """A ctypes anchor over a writable buffer: `ctypes.addressof(anchor)` is its address,
    and the buffer stays exported (cannot be unmapped or resized) while it lives."""
    return ctypes.c_char.from_buffer(view)


class Hca:
    """One opened device port: context, protection domain, and what the peer needs."""

    def __init__(self, device: str = "", port: int = 1, gid_index: int = -1) -> None:
        v = self.v = verbs()
        names = device_names(v)
        if device and device not in names:
            raise RdmaUnavailable(f"RDMA device {device!r} not found (have {', '.join(names)})")
        reasons = []
        for name in [device] if device else names:
            try:
                self._open(name, port, gid_index)
                return
            except RdmaUnavailable as exc:
                reasons.append(str(exc))
        raise RdmaUnavailable("; ".join(reasons))

    def _open(self, name: str, port: int, gid_index: int) -> None:
        v = self.v
        try:
            ctx = v.device.Context(name=name)
        except v.error as exc:
            raise RdmaUnavailable(f"cannot open RDMA device {name}: {exc}") from None
        try:
            attr = ctx.query_port(port)
            if int(attr.state) != v.IBV_PORT_ACTIVE:
                raise RdmaUnavailable(f"RDMA device {name} port {port} is not ACTIVE")
            self.gid_index, self.gid = self._gid(ctx, port, gid_index, int(attr.gid_tbl_len))
            dev = ctx.query_device()
            self.pd = v.pd.PD(ctx)
        except v.error as exc:
            ctx.close()
            raise RdmaUnavailable(f"cannot query RDMA device {name} port {port}: {exc}") from None
        except RdmaUnavailable:
            ctx.close()
            raise
        self.ctx, self.name, self.port = ctx, name, port
        self.lid, self.mtu = int(attr.lid), int(attr.active_mtu)
        self.max_msg = int(attr.max_msg_sz) or 1 << 31
        self.rd_atomic = max(1, min(MAX_RD_ATOMIC, int(dev.max_qp_rd_atom)))
        type2 = v.IBV_DEVICE_MEM_WINDOW_TYPE_2A | v.IBV_DEVICE_MEM_WINDOW_TYPE_2B
        self.windows = bool(int(dev.device_cap_flags) & type2)

    def _gid(self, ctx: Any, port: int, wanted: int, table: int) -> tuple[int, bytes]:
        """The configured GID index, else the first non-zero one, preferring RoCE v2
        (routable) over v1; InfiniBand ports answer index 0 (subnet prefix + GUID)."""
        if wanted >= 0:
            return wanted, gid_bytes(ctx.query_gid(port, wanted).gid)
        first: tuple[int, bytes] | None = None
        for index in range(table):
            try:
                raw = gid_bytes(ctx.query_gid(port, index).gid)
            except (self.v.error, ValueError):
                continue
            if not any(raw):
                continue
            try:
                v2 = int(ctx.query_gid_type(port, index)) == self.v.IBV_GID_TYPE_SYSFS_ROCE_V2
            except (self.v.error, AttributeError):
                v2 = False
            if v2:
                return index, raw
            first = first or (index, raw)
        return first or (0, bytes(16))

    def register(self, address: int, length: int, access: int, what: str) -> Any:
        try:
            return self.v.mr.MR(self.pd, length, access, address=address)
        except self.v.error as exc:
            raise rdma_wire.setup_error(
                f"registering {what} ({length} bytes) on {self.name}", errno_of(exc), str(exc)
            ) from None

    def close(self) -> None:
        """Close the PD (pyverbs closes what still hangs off it first), then the device."""
        for obj in (getattr(self, "pd", None), getattr(self, "ctx", None)):
            if obj is not None:
                try:
                    obj.close()
                except self.v.error:  # a QP still being torn down elsewhere: exit goes on
                    pass


class QueuePair:
    """One RC queue pair with its own CQ and completion channel: used by one thread at a
    time (the pooled connection that owns it)."""

    def __init__(self, hca: Hca, depth: int, remote_access: int) -> None:
        v = self.v = hca.v
        self.hca = hca
        self._channel: Any = None
        self._cq: Any = None
        self.qp: Any = None
        try:
            self._channel = v.cq.CompChannel(hca.ctx)
            self._cq = v.cq.CQ(hca.ctx, depth + 1, None, self._channel, 0)
            self.qp = v.qp.QP(
                hca.pd, qp_init(v, self._cq, depth), init_attr(v, hca.port, remote_access)
            )
        except v.error as exc:
            self.close()
            raise rdma_wire.setup_error(
                f"creating a queue pair on {hca.name}", errno_of(exc), str(exc)
            ) from None
        self.psn = secrets.randbits(24)
        self._fd: int | None = getattr(self._channel, "fd", None)
        self._armed = False

    def params(self) -> QpParams:
        assert self.qp is not None
        return QpParams(int(self.qp.qp_num), self.psn, self.hca.lid, self.hca.mtu, self.hca.gid)

    def connect(self, remote: QpParams) -> None:
        assert self.qp is not None
        mtu = rdma_wire.path_mtu(self.hca.mtu, remote.mtu)
        attr = connect_attr(
            self.v, self.hca.port, self.hca.gid_index, remote, mtu, self.psn, self.hca.rd_atomic
        )
        try:
            self.qp.to_rts(attr)
        except self.v.error as exc:
            raise rdma_wire.setup_error(
                "connecting the queue pair", errno_of(exc), str(exc)
            ) from None

    def post_rdma(
        self, opcode: int, local: int, lkey: int, remote: int, rkey: int, length: int
    ) -> None:
        for wr in rdma_requests(
            self.v, opcode, local, lkey, remote, rkey, length, self.hca.max_msg
        ):
            self._post(wr)

    def bind_window(self, window: Any, mr: Any, address: int, length: int, access: int) -> int:
        """Bind a type 2 window over [address, address + length) for the peer of this
        QP; returns its rkey. The window must be invalid (new, or invalidated)."""
        v = self.v
        bind = v.wr.SendWR(opcode=v.IBV_WR_BIND_MW, send_flags=v.IBV_SEND_SIGNALED)
        bind.set_bind_wr(window, v.mr.MWBindInfo(mr, address, length, access))
        self._post(bind)
        return int(bind.rkey)

    def invalidate_window(self, rkey: int) -> None:
        """Post the invalidation of a bound window (signaled: wait() for it)."""
        v = self.v
        inv = v.wr.SendWR(opcode=v.IBV_WR_LOCAL_INV, send_flags=v.IBV_SEND_SIGNALED)
        inv.imm_data = rkey  # a union with invalidate_rkey in ibv_send_wr
        self._post(inv)

    def _post(self, wr: Any) -> None:
        assert self.qp is not None
        try:
            self.qp.post_send(wr)
        except self.v.error as exc:
            raise rdma_wire.setup_error("posting a work request", errno_of(exc), str(exc)) from None

    def wait(self, deadline: float, where: str) -> None:
        """Wait for the one signaled completion; raise what a failed one means."""
        try:
            self._wait(deadline, where)
        except self.v.error as exc:  # the CQ or its channel itself failed
            raise rdma_wire.setup_error(
                f"{where}: waiting for the completion", errno_of(exc), str(exc)
            ) from None

    def _wait(self, deadline: float, where: str) -> None:
        assert self._cq is not None
        spins, nap = 0, 0.00001
        while True:
            n, wcs = self._cq.poll(1)
            if n:
                status = int(wcs[0].status)
                if status:
                    raise rdma_wire.completion_error(status, where)
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise OperationTimeout(f"{where}: no completion before the deadline")
            if spins < _SPINS:
                spins += 1
            elif self._fd is None:
                time.sleep(min(nap, left))
                nap = min(nap * 2, _MAX_NAP)
            elif not self._armed:
                self._cq.req_notify()  # then poll once more: a completion may beat the arming
                self._armed = True
            elif select.select([self._fd], [], [], left)[0]:
                self._channel.get_cq_event(self._cq)
                self._cq.ack_events(1)
                self._armed = False

    def close(self) -> None:
        """Destroy the QP first: after that no work request of it can touch memory."""
        for name in ("qp", "_cq", "_channel"):
            obj = getattr(self, name, None)
            if obj is not None:
                try:
                    obj.close()
                except PolarKVError:
                    raise
                except Exception:
                    pass
                setattr(self, name, None)
