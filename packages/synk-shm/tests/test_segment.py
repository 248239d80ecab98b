"""SharedArray (create / attach / close / unlink), the /dev/shm capacity check, run names and sweep."""

from __future__ import annotations

import os
import re

import numpy as np
import posix_ipc
import pytest
from hypothesis import given, settings
from hypothesis.extra import numpy as hnp
from shm_testutil import own_entries, proc_start_time

import synk_shm
from synk_shm import SharedArray, SharedMemoryFullError, naming
from synk_shm.segment import format_bytes

PROPS = settings(max_examples=50, deadline=None)


def _entry(name: str) -> str:
    return name.lstrip("/")


# --- create / attach / close / unlink ------------------------------------------------------------

def test_create_is_zero_filled_named_and_registered():
    a = SharedArray.create((3, 4), "float32")
    try:
        assert a.owner and not a.closed
        assert a.array.shape == (3, 4) and a.array.dtype == np.float32
        assert not a.array.any()
        assert a.capacity == 3 * 4 * 4
        assert a.name.startswith(synk_shm.run_prefix())
        assert _entry(a.name) in os.listdir("/dev/shm")
        assert a.name in naming._created
    finally:
        a.unlink()
        a.close()
    assert _entry(a.name) not in os.listdir("/dev/shm")
    assert a.name not in naming._created


def test_create_int_shape_and_capacity_reserve():
    a = SharedArray.create(5, "int16", capacity=1000)
    try:
        assert a.array.shape == (5,)
        assert a.capacity == 1000
        assert os.stat("/dev/shm/" + _entry(a.name)).st_size == 1000
        assert a.view(500, "int16").shape == (500,)  # the reserve is usable
    finally:
        a.unlink()
        a.close()


def test_capacity_never_below_the_array():
    a = SharedArray.create((10,), "float64", capacity=8)
    try:
        assert a.capacity == 80
    finally:
        a.unlink()
        a.close()


def test_empty_array_gets_a_one_byte_segment():
    a = SharedArray.create((0, 3), "float32")
    try:
        assert a.array.shape == (0, 3)
        assert a.capacity == 1
    finally:
        a.unlink()
        a.close()


def test_attach_sees_writes_both_ways():
    a = SharedArray.create((2, 3), "float32")
    b = SharedArray.attach(a.name, (2, 3), "float32")
    try:
        assert not b.owner
        assert b.capacity == a.capacity
        a.array[1, 2] = 5.0
        assert b.array[1, 2] == 5.0
        b.array[0] = [1, 2, 3]
        np.testing.assert_array_equal(a.array[0], [1, 2, 3])
    finally:
        b.close()
        a.unlink()
        a.close()


def test_attach_with_other_shape_and_dtype_reinterprets_bytes():
    a = SharedArray.create(4, "uint8")
    a.array[:] = [1, 0, 0, 0]
    b = SharedArray.attach(a.name, 1, "<u4")
    try:
        assert b.array[0] == 1
    finally:
        b.close()
        a.unlink()
        a.close()


def test_attach_missing_name_raises_file_not_found():
    name = naming.new_name("x")
    with pytest.raises(FileNotFoundError, match=re.escape(repr(name))):
        SharedArray.attach(name, 3, "float32")


def test_attach_after_unlink_fails_but_mappings_stay_valid():
    a = SharedArray.create(3, "float64")
    b = SharedArray.attach(a.name, 3, "float64")
    a.unlink()
    try:
        with pytest.raises(FileNotFoundError, match="freed or its creator exited"):
            SharedArray.attach(a.name, 3, "float64")
        a.array[:] = 7
        np.testing.assert_array_equal(b.array, [7, 7, 7])
    finally:
        b.close()
        a.close()


def test_object_dtype_is_refused_before_any_segment_is_made():
    before = own_entries()
    with pytest.raises(TypeError, match="holds Python objects"):
        SharedArray.create(3, object)
    assert own_entries() == before


def test_close_and_unlink_are_idempotent():
    a = SharedArray.create(3, "float32")
    a.unlink()
    a.unlink()
    a.close()
    a.close()
    assert a.closed
    assert "closed" in repr(a)
    assert a.array.size == 0


def test_view_after_close_is_a_clear_error():
    a = SharedArray.create(3, "float32")
    a.unlink()
    a.close()
    with pytest.raises(ValueError, match="is closed"):
        a.view(3, "float32")


def test_close_with_live_views_keeps_them_usable():
    a = SharedArray.create(3, "float32")
    view = a.array
    a.unlink()
    a.close()  # the mapping stays until the view goes
    view[:] = 2
    assert view.sum() == 6


def test_view_bounds_and_offset():
    a = SharedArray.create(8, "float32")
    try:
        a.array[:] = np.arange(8)
        np.testing.assert_array_equal(a.view(2, "float32", offset=8), [2, 3])
        with pytest.raises(ValueError, match="needs 36 bytes"):
            a.view((3, 3), "float32")
        with pytest.raises(ValueError, match="at offset 4"):
            a.view(8, "float32", offset=4)
    finally:
        a.unlink()
        a.close()


def test_create_with_taken_name_fails_and_leaves_the_original():
    a = SharedArray.create(3, "float32")
    try:
        with pytest.raises(posix_ipc.ExistentialError):
            SharedArray.create(3, "float32", name=a.name)
        assert _entry(a.name) in os.listdir("/dev/shm")
    finally:
        a.unlink()
        a.close()


@PROPS
@given(hnp.arrays(dtype=hnp.scalar_dtypes(), shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=5)))
def test_roundtrip_through_attach(value):
    a = SharedArray.create(value.shape, value.dtype)
    try:
        a.array[...] = value
        b = SharedArray.attach(a.name, value.shape, value.dtype)
        try:
            np.testing.assert_array_equal(b.array, value)
            assert b.array.dtype == value.dtype
        finally:
            b.close()
    finally:
        a.unlink()
        a.close()


# --- /dev/shm capacity ---------------------------------------------------------------------------

def test_shm_free_bytes_is_plausible():
    st_ = os.statvfs("/dev/shm")
    free = synk_shm.shm_free_bytes()
    assert 0 <= free <= st_.f_blocks * st_.f_frsize


def test_full_dev_shm_is_a_clear_error():
    huge = 100 * 2**40  # 100 TiB
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(SharedMemoryFullError) as info:
        SharedArray.create(1, "uint8", capacity=huge, purpose="Data 'x'")
    msg = str(info.value)
    assert isinstance(info.value, MemoryError)
    assert "100.0 TiB" in msg and "for Data 'x'" in msg
    assert format_bytes(synk_shm.shm_free_bytes())[:-4] in msg  # the free room, roughly
    assert "free of" in msg and "--shm-size" in msg and "free_memory()" in msg
    assert set(os.listdir("/dev/shm")) == before  # nothing half-made is left


@pytest.mark.parametrize(("n", "text"), [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"),
                                          (3 * 2**20, "3.0 MiB"), (2**40 * 5, "5.0 TiB"),
                                          (2**50, "1024.0 TiB")])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


# --- names, registry and sweep -------------------------------------------------------------------

def test_run_prefix_names_this_process():
    m = re.fullmatch(r"/synk([0-9a-f]+)-(\d+)-(\d+)-", synk_shm.run_prefix())
    assert m, synk_shm.run_prefix()
    assert int(m[1], 16) == os.stat("/proc/self/ns/pid").st_ino
    assert int(m[2]) == os.getpid()
    assert int(m[3]) == proc_start_time(os.getpid())


def test_new_names_are_unique_and_tagged():
    names = {naming.new_name("q") for _ in range(100)}
    assert len(names) == 100
    assert all(n.startswith(f"{synk_shm.run_prefix()}q{os.getpid()}.") for n in names)
    assert naming.new_name("q", prefix="/synkffff-1-2-r0-").startswith("/synkffff-1-2-r0-q")


def test_unlink_name_of_missing_name_is_false():
    assert naming.unlink_name(naming.new_name("x")) is False
    assert naming.unlink_name(naming.new_name("x"), "sem") is False


def test_cleanup_unlinks_what_this_process_still_holds():
    a = SharedArray.create(2, "float32")
    sem_name = naming.new_name("s")
    sem = posix_ipc.Semaphore(sem_name, posix_ipc.O_CREX)
    naming.register(sem_name, "sem")
    try:
        assert naming.cleanup() >= 2
        assert _entry(a.name) not in os.listdir("/dev/shm")
        assert "sem." + _entry(sem_name) not in os.listdir("/dev/shm")
    finally:
        sem.close()
        a.unlink()
        a.close()


def _dead_prefix(ns: int | None = None) -> str:
    """A prefix of this pid namespace whose root 'process' is this pid with another start time:
    a run whose pid has since been reused, i.e. a dead run."""
    ns = os.stat("/proc/self/ns/pid").st_ino if ns is None else ns
    return f"/synk{ns:x}-{os.getpid()}-{proc_start_time(os.getpid()) + 1}-"


def test_sweep_removes_dead_runs_and_spares_live_ones():
    dead = _dead_prefix()
    seg = SharedArray.create(4, "float32", name=naming.new_name("a", prefix=dead))
    sem_name = naming.new_name("s", prefix=dead)
    sem = posix_ipc.Semaphore(sem_name, posix_ipc.O_CREX)
    sem.close()
    live = SharedArray.create(4, "float32")
    try:
        naming.unregister(seg.name)  # as if its creator were gone
        assert len(own_entries(dead)) == 2
        assert synk_shm.sweep() >= 2
        assert own_entries(dead) == []
        assert _entry(live.name) in os.listdir("/dev/shm")
    finally:
        naming.unlink_name(seg.name)
        naming.unlink_name(sem_name, "sem")
        seg.close()
        live.unlink()
        live.close()


def test_sweep_leaves_other_pid_namespaces_alone():
    other = _dead_prefix(ns=os.stat("/proc/self/ns/pid").st_ino + 1)
    seg = SharedArray.create(4, "float32", name=naming.new_name("a", prefix=other))
    try:
        synk_shm.sweep()
        assert _entry(seg.name) in os.listdir("/dev/shm")
    finally:
        seg.unlink()
        seg.close()


def test_unlink_prefix_removes_segments_and_semaphores():
    prefix = f"{synk_shm.run_prefix()}r7-"
    a = SharedArray.create(4, "float32", name=naming.new_name("b", prefix=prefix))
    sem_name = naming.new_name("s", prefix=prefix)
    posix_ipc.Semaphore(sem_name, posix_ipc.O_CREX).close()
    other = SharedArray.create(4, "float32")
    try:
        assert naming.unlink_prefix(prefix) == 2
        assert own_entries(prefix) == []
        assert _entry(other.name) in os.listdir("/dev/shm")
    finally:
        naming.unlink_name(sem_name, "sem")
        for s in (a, other):
            s.unlink()
            s.close()
