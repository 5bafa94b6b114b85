"""A run's temporary folders (restart points in /dev/shm, swapped states, shard checkpoints)
are swept by the next run once their driver is gone, and never while it lives."""

import os
import signal

from flexmarl.runtime.local.runtime import RunTempFolder


def _killed_driver_folder(where: str) -> str:
    """A folder made by a process that then dies by SIGKILL, as a driver does under the OOM
    killer: its `stop` never runs."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: make the folder, say where, die without cleaning up
        os.close(read)
        folder = RunTempFolder("flexmarl-restart-", where)
        os.write(write, folder.name.encode())
        os.close(write)
        os.kill(os.getpid(), signal.SIGKILL)
    os.close(write)
    name = os.read(read, 4096).decode()
    os.close(read)
    os.waitpid(pid, 0)
    return name


def test_a_killed_drivers_folder_is_swept_and_a_live_ones_kept(tmp_path):
    where = str(tmp_path)
    stale = _killed_driver_folder(where)
    assert os.path.isdir(stale)
    live = RunTempFolder("flexmarl-restart-", where)
    other = tmp_path / "flexmarl-swap-keep"  # another prefix, and no lock file: not ours
    other.mkdir()

    mine = RunTempFolder("flexmarl-restart-", where)

    assert not os.path.exists(stale)
    assert os.path.isdir(live.name) and os.path.isdir(mine.name) and other.is_dir()
    live.cleanup()
    mine.cleanup()
    assert not os.path.exists(live.name) and not os.path.exists(mine.name)
