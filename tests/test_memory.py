"""Huge-page advice on fresh CPU outputs (opbridge.call.memory); the pool is tests/test_host_buffers.py.

The advice is visible in ``/proc/self/smaps`` as the ``hg`` VmFlag of the
mapping that holds the output: deterministic, whether or not the kernel then
found free huge pages.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from opbridge.call import memory

torch = pytest.importorskip("torch")

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_madvise_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not _THP.exists() or "[madvise]" not in _THP.read_text(),
    reason="transparent huge pages are not in [madvise] mode here: opbridge gives no advice",
)


def _vm_flags(addr: int) -> set[str]:
    """The VmFlags of the mapping of this process that contains *addr*."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.fixture
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Make memory.py resolve the environment again (it does so once per process)."""
    monkeypatch.setattr(memory, "_resolved", False)
    monkeypatch.setattr(memory, "_madvise", None)
    return monkeypatch


@needs_madvise_thp
@pytest.mark.parametrize("call", ["fast path", "dispatcher"])
def test_new_large_outputs_are_advised(call: str) -> None:
    from opbridge import ops

    x = torch.ones(1024, 2048)  # 8 MiB
    with torch.no_grad():
        out = ops.add(x, x) if call == "fast path" else torch.ops.opbridge.add(x, x)
    assert "hg" in _vm_flags(out.data_ptr() + out.nbytes // 2)
    assert torch.equal(out, x + x)


def test_small_outputs_and_caller_buffers_do_not_come_from_the_pool() -> None:
    from opbridge import ops

    ops.add(torch.ones(8), torch.ones(8))  # the module that registers the pool is loaded
    before = memory.host_stats()
    assert before is not None
    ops.gelu(torch.ones(8, 4096))  # 128 KiB: below MIN_BYTES
    x = torch.ones(1024, 2048)
    ops.add(x, x, out=torch.empty_like(x))  # the caller's memory is left as it is
    after = memory.host_stats()
    assert after is not None
    assert (after["mapped"], after["reused"]) == (before["mapped"], before["reused"])
    y = ops.add(x, x)
    after = memory.host_stats()
    assert after is not None and after["mapped"] + after["reused"] == before["mapped"] + before["reused"] + 1
    assert y.data_ptr() % (2 << 20) == 0


@needs_madvise_thp
def test_advise_fresh_gives_advice_only_where_it_can(fresh_state: pytest.MonkeyPatch) -> None:
    t = torch.empty(memory.MIN_BYTES // 4, dtype=torch.float32)
    assert memory.advise_fresh(t.data_ptr(), t.nbytes)
    assert not memory.advise_fresh(t.data_ptr(), memory.MIN_BYTES - 1)


def test_opbridge_hugepages_0_turns_the_advice_off(fresh_state: pytest.MonkeyPatch) -> None:
    fresh_state.setenv("OPBRIDGE_HUGEPAGES", "0")
    t = torch.empty(memory.MIN_BYTES // 4, dtype=torch.float32)
    assert not memory.advise_fresh(t.data_ptr(), t.nbytes)
    assert memory._resolved and memory._madvise is None  # no madvise was even looked up
