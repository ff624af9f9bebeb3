"""Removes a run's names if the processes that would remove them are all killed (and the
server's --ready-file if the server is).

The run directory (socket, wake pipes, secret) and the shared-memory segment have names until
every worker is ready (worker_pool removes them then); a kill -9 of the coordinator, or of the
whole process group, during start-up would leave them behind. So before creating them the pool
forks this reaper: a tiny process in a session of its own (outside the run's process group,
re-parented to init), holding nothing of the run but the read end of a pipe whose write end
only the coordinator holds. When the coordinator is gone, however it went, the read sees EOF
and the reaper removes whatever of the names is left, then exits.
"""
from __future__ import annotations

import os
import signal


def start_reaper(run_dir: str | None, shm_name: str | None, files: tuple[str, ...] = ()) -> int:
    """Fork the reaper for these names (a run directory, a shared-memory segment, files such as
    the server's --ready-file); returns the pipe's write end, which the caller keeps open for as
    long as the names may exist (closing it lets the reaper go)."""
    r, w = os.pipe()  # not inherited by the workers (close-on-exec)
    pid = os.fork()
    if pid == 0:  # only os calls from here on: we are a fork of a threaded process
        try:
            os.setsid()  # out of the run's process group and session
            if os.fork():
                os._exit(0)
            for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGQUIT):
                signal.signal(s, signal.SIG_IGN)  # a Ctrl-C or group-wide signal is for the run, not us
            os.closerange(0, r)  # hold no socket, pipe or mapping of the run: only our pipe end
            os.closerange(r + 1, 1 << 16)
            while True:
                try:
                    if not os.read(r, 64):
                        break
                except InterruptedError:
                    continue
                except OSError:
                    break
            _remove(run_dir, shm_name, files)
        finally:
            os._exit(0)
    os.close(r)
    os.waitpid(pid, 0)  # the first child exits at once; the grandchild is init's
    return w


def _remove(run_dir: str | None, shm_name: str | None, files: tuple[str, ...] = ()) -> None:
    for path in files:
        try:
            os.unlink(path)
        except OSError:
            pass
    if shm_name is not None:
        try:
            os.unlink(f"/dev/shm/{shm_name}")
        except OSError:
            pass
    if run_dir is None:
        return
    try:
        for entry in os.listdir(run_dir):
            try:
                os.unlink(os.path.join(run_dir, entry))
            except OSError:
                pass
        os.rmdir(run_dir)
    except OSError:
        pass
