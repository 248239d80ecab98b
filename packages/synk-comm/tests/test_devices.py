"""``synk_comm.devices``: pinning a process to one GPU remembers what it could see before."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """\
import os
from synk_comm import devices

assert not devices.pinned() and devices.visible_before_pin() == "2,3"
devices.pin("3")
assert os.environ["CUDA_VISIBLE_DEVICES"] == "3" and devices.pinned()
assert devices.visible_before_pin() == "2,3"
devices.pin("2")  # a second group in the same process: the first pin's view stays
assert os.environ["CUDA_VISIBLE_DEVICES"] == "2" and devices.visible_before_pin() == "2,3"
devices.unpin()  # the group closed: processes started from now on see both GPUs again
assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3" and devices.visible_before_pin() == "2,3"
assert devices.pinned() and devices.pinned_device() == "2"  # this process's CUDA stays where it was
print("ok")
"""

GROUP_SCRIPT = """\
import os
import synk_comm

group = synk_comm.start(2, devices=["1", "0"])
assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"  # the master is pinned to its GPU while the group runs
group.close()
print(os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
"""


def test_pin_remembers_the_devices_visible_before() -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="2,3")
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_unset_means_every_gpu() -> None:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    code = "from synk_comm import devices; devices.pin('0'); print(devices.visible_before_pin())"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "None", result.stderr


def test_a_closed_group_gives_later_processes_every_gpu_again() -> None:
    for before, after in (("0,1", "0,1"), (None, "unset")):
        env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "SYNK_RUN_PREFIX")}
        if before is not None:
            env["CUDA_VISIBLE_DEVICES"] = before
        result = subprocess.run([sys.executable, "-c", GROUP_SCRIPT], env=env, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0 and result.stdout.strip() == after, result.stderr
