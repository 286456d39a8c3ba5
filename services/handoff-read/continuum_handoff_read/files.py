"""Opening the package's files: only paths the package registers, only beneath the package root.

Every open resolves the registered relative path beneath the package directory with
openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS) where the kernel has it, else by a walk that opens one
component at a time with O_NOFOLLOW from the package directory's descriptor. Files are opened
O_NONBLOCK (a planted FIFO cannot hang the call) and must be regular files (fstat); their size must be
the registered one before a byte is used, and content handed out is checked against the registered
sha256. Reads are bounded by the caller.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import re
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from continuum_handoff_read.deadline import Deadline
from continuum_handoff_read.errors import PackageDamaged

# One path segment as merge names files (hex digests, counters, unit ids): no separators, no leading dot.
_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,199}")
MAX_DEPTH = 4
HASH_BUFFER_BYTES = 1024 * 1024

_SYS_OPENAT2 = 437  # the same number on x86_64 and aarch64
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)


class _OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64))


def _load_syscall() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    syscall: Callable[..., int] | None = getattr(libc, "syscall", None)
    return syscall


_SYSCALL = _load_syscall()


def safe_relative(relative: str) -> bool:
    """Whether `relative` is a path merge could have generated: 1-4 plain segments, no `..`, no dot files."""
    parts = relative.split("/")
    return 0 < len(parts) <= MAX_DEPTH and all(_SEGMENT.fullmatch(part) for part in parts)


class PackageFiles:
    """Descriptor-relative access to one package directory (`<package root>/<operation id>/`)."""

    def __init__(self, package_dir: Path) -> None:
        try:
            # The last component must not be a symlink; the directories above it are the deployment's.
            self._root = os.open(package_dir, _DIRECTORY_FLAGS)
        except OSError as error:
            raise PackageDamaged(
                f"the package directory cannot be opened ({errno.errorcode.get(error.errno or 0)})"
            ) from error
        self._openat2 = _SYSCALL is not None
        self.opened = 0

    def close(self) -> None:
        """Release the package directory's descriptor."""
        os.close(self._root)

    def __enter__(self) -> PackageFiles:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _open_beneath(self, relative: str) -> int:
        if self._openat2 and _SYSCALL is not None:
            how = _OpenHow(_OPEN_FLAGS & ~getattr(os, "O_NOFOLLOW", 0), 0, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS)
            descriptor = int(
                _SYSCALL(_SYS_OPENAT2, self._root, relative.encode(), ctypes.byref(how), ctypes.sizeof(how))
            )
            if descriptor >= 0:
                return descriptor
            code = ctypes.get_errno()
            if code not in (errno.ENOSYS, errno.EPERM):
                raise OSError(code, os.strerror(code))
            self._openat2 = False  # an old kernel or a sandbox without openat2: walk instead
        return self._walk(relative)

    def _walk(self, relative: str) -> int:
        *directories, name = relative.split("/")
        current = self._root
        try:
            for directory in directories:
                following = os.open(directory, _DIRECTORY_FLAGS, dir_fd=current)
                if current != self._root:
                    os.close(current)
                current = following
            return os.open(name, _OPEN_FLAGS, dir_fd=current)
        finally:
            if current != self._root:
                os.close(current)

    @contextmanager
    def open(self, relative: str, size: int) -> Iterator[int]:
        """A descriptor of the registered regular file `relative` whose size is `size` (a negative `size`:
        any size, for files registered by hash only); PackageDamaged for anything else (unsafe path,
        symlink on the way, not a regular file, another size)."""
        if not safe_relative(relative):
            raise PackageDamaged(f"the package registers an unsafe path {relative!r}")
        try:
            descriptor = self._open_beneath(relative)
        except OSError as error:
            name = errno.errorcode.get(error.errno or 0, "error")
            raise PackageDamaged(f"{relative} cannot be opened beneath the package ({name})") from error
        self.opened += 1
        try:
            status = os.fstat(descriptor)
            if not stat.S_ISREG(status.st_mode):
                raise PackageDamaged(f"{relative} is not a regular file")
            if size >= 0 and status.st_size != size:
                raise PackageDamaged(f"{relative} is not the size the package registers")
            yield descriptor
        finally:
            os.close(descriptor)

    def size(self, relative: str) -> int:
        """The size of a regular file registered by hash only (a manifest of the handoff)."""
        with self.open(relative, -1) as descriptor:
            return os.fstat(descriptor).st_size

    def read(self, relative: str, size: int, start: int = 0, length: int | None = None) -> bytes:
        """Bytes [start, start + length) of a registered file (to its end when `length` is None; the
        caller bounds it)."""
        with self.open(relative, size) as descriptor:
            return read_range(descriptor, start, size - start if length is None else min(length, size - start))

    def read_verified(self, relative: str, size: int, sha256: str, deadline: Deadline) -> bytes:
        """A whole registered file (at most `size` bytes, the caller's bound) after checking its sha256."""
        with self.open(relative, size) as descriptor:
            data = read_range(descriptor, 0, size)
        if hashlib.sha256(data).hexdigest() != sha256:
            raise PackageDamaged(f"{relative} does not match its registered sha256")
        deadline.check("verifying a file")
        return data

    def verify(self, relative: str, size: int, sha256: str, deadline: Deadline) -> None:
        """Check a registered file of any size against its sha256, a buffer at a time, within `deadline`."""
        digest = hashlib.sha256()
        with self.open(relative, size) as descriptor:
            offset = 0
            while offset < size:
                deadline.check(f"verifying {relative}")
                chunk = read_range(descriptor, offset, min(HASH_BUFFER_BYTES, size - offset))
                digest.update(chunk)
                offset += len(chunk)
        if digest.hexdigest() != sha256:
            raise PackageDamaged(f"{relative} does not match its registered sha256")


def read_range(descriptor: int, start: int, length: int) -> bytes:
    """Exactly `length` bytes at `start` (PackageDamaged when the file ends early: it shrank)."""
    data = os.pread(descriptor, length, start)
    while len(data) < length:
        more = os.pread(descriptor, length - len(data), start + len(data))
        if not more:
            raise PackageDamaged("a package file ended before its registered size")
        data += more
    return data
