"""The few operating-system calls that differ between Linux, macOS and Windows, each with a fallback, so
the daemons degrade rather than crash where a POSIX call is missing.

Linux is where the project is tested; on macOS and Windows everything is pure Python, and this module is
where the POSIX-only calls are guarded. ``scripts/test`` type-checks the packages as if on Windows and on
macOS (``mypy --platform win32`` / ``darwin``), so a new unguarded call fails CI.

=========================  =======================================  ========================================
call                       POSIX                                    fallback (what degrades)
=========================  =======================================  ========================================
:func:`pread`/`pwrite`     ``os.pread``/``os.pwrite``               seek, then read/write (not atomic with
                                                                    other users of the same descriptor: the
                                                                    callers own theirs)
:func:`fdatasync`          ``os.fdatasync`` (not on macOS)          ``os.fsync`` (also syncs metadata)
:func:`free_bytes`         ``shutil.disk_usage`` everywhere         —
:func:`try_lock`           ``fcntl.flock`` (exclusive, no wait)     Windows: ``msvcrt.locking`` of byte 0
=========================  =======================================  ========================================

Also guarded where they are used: the terminal's echo (``termios``, :mod:`shared.panel`: not switched off
on Windows), ``SO_REUSEPORT`` (:mod:`shared.net.punch`: without it no simultaneous open, so links stay
relayed), ``select.poll`` (:mod:`shared.net.tls_socket`: ``select`` instead).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

__all__ = ["fdatasync", "free_bytes", "pread", "pwrite", "try_lock"]


def pread(fd: int, size: int, offset: int) -> bytes:
    """Up to ``size`` bytes of ``fd`` at ``offset``."""
    if sys.platform == "win32":
        os.lseek(fd, offset, os.SEEK_SET)
        return os.read(fd, size)
    else:
        return os.pread(fd, size, offset)


def pwrite(fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
    """Write ``data`` to ``fd`` at ``offset``; the number of bytes written."""
    if sys.platform == "win32":
        os.lseek(fd, offset, os.SEEK_SET)
        return os.write(fd, data)
    else:
        return os.pwrite(fd, data, offset)


def fdatasync(fd: int) -> None:
    """Flush ``fd``'s data to the disk (``fsync`` where ``fdatasync`` is missing: macOS, Windows)."""
    if sys.platform == "linux":
        os.fdatasync(fd)
    else:
        os.fsync(fd)


def free_bytes(path: Path | str) -> int:
    """Bytes free for this user on the file system holding ``path``."""
    return shutil.disk_usage(path).free


def try_lock(fd: int) -> bool:
    """Take an exclusive lock on the open file ``fd`` without waiting; False if another process holds it.
    The lock lasts until ``fd`` is closed (or the process ends)."""
    if sys.platform == "win32":
        import msvcrt

        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True
    else:
        import fcntl

        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True
