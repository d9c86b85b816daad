"""The verbs layer with real pyverbs objects (no device needed to build them), the
"no device" detection, and which transports a client opens.

pyverbs comes from rdma-core (scripts/setup-rdma links Debian's python3-pyverbs into
the venv; CI runs it). Without it the pyverbs-object tests skip with that reason; the
fallback tests run either way, since a missing pyverbs is one more "no rdma here".
"""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest

import polarkv_lib.transport as registry
from polarkv_lib.errors import ConfigError
from polarkv_lib.transport import rdma_verbs, rdma_wire
from polarkv_lib.transport.rdma_verbs import RdmaUnavailable
from polarkv_lib.transport.rdma_wire import QpParams
from tests.conftest import ROOT

GID = bytes.fromhex("fe800000000000000202c9fffe001122")


def _pyverbs() -> rdma_verbs.Verbs:
    try:
        return rdma_verbs.verbs()
    except RdmaUnavailable as exc:
        pytest.skip(f"pyverbs not importable here: {exc}")


@pytest.fixture
def v() -> rdma_verbs.Verbs:
    return _pyverbs()


def _device_list_reason(v: rdma_verbs.Verbs) -> str | None:
    """What raw pyverbs says about devices, to compare the probe against."""
    try:
        devices = v.device.get_device_list()
    except v.error as exc:
        return f"raises {exc}"
    return None if devices else "empty"


@pytest.fixture
def fresh_probe() -> Iterator[None]:
    registry._probed.clear()
    yield
    registry._probed.clear()


def test_either_enum_module_is_accepted(
    v: rdma_verbs.Verbs, monkeypatch: pytest.MonkeyPatch
) -> None:
    # rdma-core 44 has only pyverbs.enums, the newest only pyverbs.libibverbs_enums,
    # some releases both: the newer is preferred, the older is the fallback.
    have_new = importlib.util.find_spec("pyverbs.libibverbs_enums") is not None
    have_old = importlib.util.find_spec("pyverbs.enums") is not None
    assert have_new or have_old
    chosen = rdma_verbs.enum_module()
    assert chosen.__name__ == ("pyverbs.libibverbs_enums" if have_new else "pyverbs.enums")
    mtu = v.IBV_MTU_1024
    if have_new and have_old:
        monkeypatch.setitem(sys.modules, "pyverbs.libibverbs_enums", None)  # as on an old release
        old = rdma_verbs.enum_module()
        assert old.__name__ == "pyverbs.enums" and int(old.IBV_MTU_1024) == mtu
    with pytest.raises(AttributeError):
        v.not_a_constant  # noqa: B018 - only IBV_* names resolve


def test_wire_constants_match_the_verbs_abi(v: rdma_verbs.Verbs) -> None:
    for code, name in rdma_wire._WC_NAMES.items():
        assert getattr(v, f"IBV_WC_{name}") == code
    assert v.IBV_WC_SUCCESS == 0
    for code, size in rdma_wire.MTU_BYTES.items():
        assert getattr(v, f"IBV_MTU_{size}") == code


def test_init_attributes(v: rdma_verbs.Verbs) -> None:
    access = rdma_verbs.access_flags(v, "LOCAL_WRITE", "REMOTE_READ", "REMOTE_WRITE")
    assert access == v.IBV_ACCESS_LOCAL_WRITE | v.IBV_ACCESS_REMOTE_READ | v.IBV_ACCESS_REMOTE_WRITE
    attr = rdma_verbs.init_attr(v, 2, access)
    assert (attr.qp_state, attr.port_num, attr.pkey_index) == (v.IBV_QPS_INIT, 2, 0)
    assert attr.qp_access_flags == access


def test_connect_attributes_over_roce(v: rdma_verbs.Verbs) -> None:
    remote = QpParams(qpn=0x2A2A, psn=77, lid=0, mtu=5, gid=GID)
    attr = rdma_verbs.connect_attr(v, 1, 3, remote, mtu=3, local_psn=1234, rd_atomic=8)
    assert (attr.dest_qp_num, attr.rq_psn, attr.sq_psn) == (0x2A2A, 77, 1234)
    assert (attr.path_mtu, attr.max_rd_atomic, attr.max_dest_rd_atomic) == (3, 8, 8)
    assert (attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.min_rnr_timer) == (14, 7, 7, 12)
    ah = attr.ah_attr
    assert ah.is_global == 1 and ah.port_num == 1
    assert ah.sgid_index == 3 and ah.hop_limit == rdma_verbs.HOP_LIMIT
    assert rdma_verbs.gid_bytes(ah.dgid) == GID


def test_connect_attributes_over_infiniband_lid(v: rdma_verbs.Verbs) -> None:
    remote = QpParams(qpn=9, psn=1, lid=0x11, mtu=4, gid=bytes(16))
    ah = rdma_verbs.connect_attr(v, 1, 0, remote, mtu=4, local_psn=1, rd_atomic=1).ah_attr
    assert (ah.is_global, ah.dlid) == (0, 0x11)


def test_gid_text_is_what_pyverbs_parses(v: rdma_verbs.Verbs) -> None:
    text = rdma_verbs.gid_text(GID)
    assert v.addr.GID(text).gid == text
    assert rdma_verbs.gid_bytes(text) == GID
    with pytest.raises(ValueError):
        rdma_verbs.gid_bytes("fe80:0001")


def test_queue_pair_creation_attributes(v: rdma_verbs.Verbs) -> None:
    cap = rdma_verbs.qp_cap(v, 64)
    assert (cap.max_send_wr, cap.max_recv_wr, cap.max_send_sge, cap.max_recv_sge) == (64, 1, 1, 1)
    init = rdma_verbs.qp_init(v, None, 16)  # the CQ needs a device; the rest does not
    assert (init.qp_type, init.sq_sig_all, init.cap.max_send_wr) == (v.IBV_QPT_RC, 0, 16)


def test_large_transfers_split_at_the_message_size(v: rdma_verbs.Verbs) -> None:
    wrs = rdma_verbs.rdma_requests(v, v.IBV_WR_RDMA_READ, 0x1000, 5, 0x9000, 6, 2500, max_msg=1000)
    assert [w.wr_id for w in wrs] == [0, 1, 2]
    assert all(w.opcode == v.IBV_WR_RDMA_READ and w.num_sge == 1 for w in wrs)
    assert [w.send_flags for w in wrs] == [0, 0, v.IBV_SEND_SIGNALED]  # only the last
    assert len(rdma_verbs.rdma_requests(v, v.IBV_WR_RDMA_WRITE, 0, 1, 0, 1, 1000, 1000)) == 1


def test_probe_agrees_with_the_device_list(v: rdma_verbs.Verbs) -> None:
    raw = _device_list_reason(v)
    reason = rdma_verbs.probe()
    if raw is not None:  # no device here: the probe says why, in words an operator reads
        assert reason is not None and reason.startswith("no RDMA device")
        with pytest.raises(RdmaUnavailable, match="no RDMA device"):
            rdma_verbs.Hca()
    else:
        assert reason is None or "ACTIVE" in reason
        with pytest.raises(RdmaUnavailable, match="not found"):
            rdma_verbs.Hca("polarkv-no-such-device")


def test_missing_pyverbs_is_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rdma_verbs, "_loaded", None)
    monkeypatch.setitem(sys.modules, "pyverbs.device", None)
    with pytest.raises(RdmaUnavailable, match="pyverbs is not installed"):
        rdma_verbs.verbs()
    assert issubclass(RdmaUnavailable, ConfigError)


def test_choose_is_pure() -> None:
    assert registry.choose("auto") == ("shm", "rdma", "tcp")
    assert registry.choose("tcp") == ("tcp",)
    assert registry.choose("rdma") == ("rdma",)  # explicit: no silent fallback
    with pytest.raises(ValueError, match="auto, tcp, shm, rdma"):
        registry.choose("udp")


def test_auto_probes_only_for_a_slab_that_offers_rdma(
    fresh_probe: None, caplog: pytest.LogCaptureFixture
) -> None:
    from polarkv_lib.transport.base import NodeTarget

    plain = NodeTarget("a", "10.0.0.9:1", 1, "", "elsewhere", ("tcp",))
    offers = NodeTarget("b", "10.0.0.8:1", 1, "", "elsewhere", ("tcp", "rdma"))
    with caplog.at_level(logging.DEBUG, logger="polarkv.client"):
        transports = registry.open_transports("auto")
        try:
            assert [t.name for t in transports] == ["shm", "rdma", "tcp"]
            assert registry.pick(transports, plain) is transports[2]
            assert not registry._probed  # no slab offered rdma: nothing imported or probed
            chosen = registry.pick(transports, offers)
            reason = registry.rdma_unavailable()
            if reason is None:
                pytest.skip("this machine has a usable RDMA device: auto uses it")
            assert chosen is transports[2]  # tcp
            registry.pick(transports, offers)  # again: no second probe, no second line
        finally:
            for t in transports:
                t.close()
    lines = [r for r in caplog.records if "rdma" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.DEBUG and reason in lines[0].getMessage()


def test_importing_pyverbs_leaves_logging_alone(v: rdma_verbs.Verbs) -> None:
    # pyverbs.base calls logging.basicConfig(level=INFO) at import; a client must not
    # inherit a stderr handler from that (engines and --log-format json own stderr).
    code = (
        "import logging; from polarkv_lib.transport import AutoRdma;"
        "from polarkv_lib.transport.base import NodeTarget;"
        "t = AutoRdma(1); t.usable(NodeTarget('b', '10.0.0.8:1', 1, '', 'x', ('tcp', 'rdma')));"
        "logging.getLogger('polarkv.client').info('must not show'); t.close();"
        "r = logging.getLogger(); print(len(r.handlers), r.level)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, cwd=ROOT, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.split() == [b"0", str(logging.WARNING).encode()]
    assert done.stderr == b""


def test_explicit_rdma_without_a_device_names_the_reason(fresh_probe: None) -> None:
    reason = registry.rdma_unavailable()
    if reason is None:
        pytest.skip("this machine has a usable RDMA device")
    with pytest.raises(RdmaUnavailable) as info:
        registry.open_transports("rdma")
    assert str(info.value) == reason


def test_slab_with_rdma_but_no_device_does_not_start(fresh_probe: None) -> None:
    from polarkv_lib.node import rdma_server
    from polarkv_lib.node.admission import Gate

    if registry.rdma_unavailable() is None:
        pytest.skip("this machine has a usable RDMA device")
    buffer = memoryview(bytearray(1 << 20))
    with pytest.raises(RdmaUnavailable, match=r"slab\.transports includes rdma, but"):
        rdma_server.start(buffer, Gate(len(buffer), 1, lambda: (), 5.0), "", 1, -1, False)
    buffer.release()  # nothing kept it exported


def test_pick_takes_the_first_usable() -> None:
    from polarkv_lib.transport.base import NodeTarget

    tcp, shm = registry.create("tcp"), registry.create("shm")
    try:
        far = NodeTarget("n", "10.0.0.9:1", 1, "", "elsewhere", ("tcp", "rdma"))
        assert registry.pick([shm, tcp], far) is tcp
        assert registry.pick([shm], far) is None
    finally:
        tcp.close()
        shm.close()


def test_client_asked_for_rdma_without_a_device_does_not_start(fresh_probe: None) -> None:
    from polarkv_lib.client.async_client import AsyncPolarKVClient

    reason = registry.rdma_unavailable()
    if reason is None:
        pytest.skip("this machine has a usable RDMA device")
    with pytest.raises(RdmaUnavailable) as info:
        AsyncPolarKVClient("http://127.0.0.1:1", transport="rdma")
    assert reason in str(info.value)
    with pytest.raises(ValueError, match="auto, tcp, shm, rdma"):
        AsyncPolarKVClient("http://127.0.0.1:1", transport="infiniband")
