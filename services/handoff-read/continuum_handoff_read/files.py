"""Opening the package's files: only paths the package registers, only beneath the package root.

Every open resolves the registered relative path beneath the package directory: its directories with
openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS) where the kernel has it, else by a walk that opens one
component at a time with O_NOFOLLOW from the package directory's descriptor; then the file by its one
checked name with O_NOFOLLOW from its directory's descriptor. Files are opened O_NONBLOCK (a planted
FIFO cannot hang the call) and must be regular files (fstat); their size must be the registered one
before a byte is used, and content handed out is checked against the registered sha256 (search hashes
a part only when it hands out an excerpt of it; see search.py). Reads are bounded by the caller.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import re
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from continuum_handoff_read.deadline import Deadline
from continuum_handoff_read.errors import PackageDamaged

# A path as merge names files: 1-4 segments (hex digests, counters, unit ids), no leading dot.
_SEGMENT = r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,199}"
_PATH = re.compile(rf"(?:{_SEGMENT}/){{0,3}}{_SEGMENT}")
HASH_BUFFER_BYTES = 1024 * 1024

_SYS_OPENAT2 = 437  # the same number on x86_64 and aarch64
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | _NOFOLLOW
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | _NOFOLLOW


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


class PackageFiles:
    """Descriptor-relative access to one package directory (`<package root>/<operation id>/`).

    A file's directory is opened once per call beneath the package directory (openat2 with
    RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS, or component by component with O_NOFOLLOW) and kept; the
    file itself is then opened from that descriptor by its single, checked name with O_NOFOLLOW, which
    resolves exactly as openat2 would (no `..`, no separator, no symlink) at the cost of one plain
    openat per file.
    """

    def __init__(self, package_dir: Path, intact: IntactFiles | None = None) -> None:
        self._intact = intact
        try:
            # The last component must not be a symlink; the directories above it are the deployment's.
            self._root = os.open(package_dir, _DIRECTORY_FLAGS)
        except OSError as error:
            raise PackageDamaged(
                f"the package directory cannot be opened ({errno.errorcode.get(error.errno or 0)})"
            ) from error
        self._openat2 = _SYSCALL is not None
        self._directories: dict[str, int] = {"": self._root}
        # Read once: the descriptor names the same directory for as long as it is open.
        self._identity: tuple[int, int] | None = None

    def identity(self) -> tuple[int, int]:
        """The device and inode of the package directory as opened (another process checks that it
        opened the same one)."""
        if self._identity is None:
            status = os.fstat(self._root)
            self._identity = status.st_dev, status.st_ino
        return self._identity

    def close(self) -> None:
        """Release the package directory's descriptors."""
        for descriptor in self._directories.values():
            os.close(descriptor)
        self._directories.clear()

    def __enter__(self) -> PackageFiles:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def directory(self, relative: str) -> int:
        """The descriptor of a directory beneath the package (opened once; closed with the package);
        PackageDamaged when it cannot be opened beneath it (a symlink on the way, missing)."""
        descriptor = self._directories.get(relative)
        if descriptor is None:
            try:
                descriptor = self._open_directory_beneath(relative)
            except OSError as error:
                code = errno.errorcode.get(error.errno or 0, "error")
                raise PackageDamaged(f"{relative} cannot be opened beneath the package ({code})") from error
            self._directories[relative] = descriptor
        return descriptor

    def _open_directory_beneath(self, relative: str) -> int:
        if self._openat2 and _SYSCALL is not None:
            how = _OpenHow(_DIRECTORY_FLAGS & ~_NOFOLLOW, 0, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS)
            descriptor = int(
                _SYSCALL(_SYS_OPENAT2, self._root, relative.encode(), ctypes.byref(how), ctypes.sizeof(how))
            )
            if descriptor >= 0:
                return descriptor
            code = ctypes.get_errno()
            if code not in (errno.ENOSYS, errno.EPERM):
                raise OSError(code, os.strerror(code))
            self._openat2 = False  # an old kernel or a sandbox without openat2: walk instead
        current = self._root
        try:
            for component in relative.split("/"):
                following = os.open(component, _DIRECTORY_FLAGS, dir_fd=current)
                if current != self._root:
                    os.close(current)
                current = following
            return current
        except BaseException:
            if current != self._root:
                os.close(current)
            raise

    def descriptor(self, relative: str, size: int) -> int:
        """An open descriptor (the caller closes it) of the registered regular file `relative` whose size
        is `size` (a negative `size`: any size, for files registered by hash only); PackageDamaged for
        anything else (unsafe path, symlink on the way, not a regular file, another size)."""
        if _PATH.fullmatch(relative) is None:
            raise PackageDamaged(f"the package registers an unsafe path {relative!r}")
        directory, _, name = relative.rpartition("/")
        return self._open_checked(self.directory(directory), name, relative, size)

    def _open_checked(self, directory: int, name: str, relative: str, size: int) -> int:
        try:
            descriptor = os.open(name, _OPEN_FLAGS, dir_fd=directory)
        except OSError as error:
            code = errno.errorcode.get(error.errno or 0, "error")
            raise PackageDamaged(f"{relative} cannot be opened beneath the package ({code})") from error
        try:
            status = os.fstat(descriptor)
            if not stat.S_ISREG(status.st_mode):
                raise PackageDamaged(f"{relative} is not a regular file")
            if size >= 0 and status.st_size != size:
                raise PackageDamaged(f"{relative} is not the size the package registers")
        except BaseException:
            os.close(descriptor)
            raise
        return descriptor

    def read_named(self, directory: int, name: str, size: int, into: memoryview) -> None:
        """`read_whole` for the file `name` in `directory` (a descriptor from `directory()`), for a caller
        that builds the name itself from checked parts (a search scanner: a text part's
        ``<sha256>-<part>.txt``, one per part): no pattern match per file, the same open and checks."""
        if "/" in name or name in ("", ".", ".."):
            raise PackageDamaged(f"the package registers an unsafe name {name!r}")
        descriptor = self._open_checked(directory, name, name, size)
        try:
            if os.preadv(descriptor, [into], 0) != size:  # one read, almost always
                read_into(descriptor, into, 0)
        finally:
            os.close(descriptor)

    @contextmanager
    def open(self, relative: str, size: int) -> Iterator[int]:
        """`descriptor`, closed when the block ends."""
        descriptor = self.descriptor(relative, size)
        try:
            yield descriptor
        finally:
            os.close(descriptor)

    def read_whole(self, relative: str, size: int, into: memoryview) -> None:
        """Fill `into` (`size` bytes long) with the whole registered file `relative`."""
        descriptor = self.descriptor(relative, size)
        try:
            if os.preadv(descriptor, [into], 0) != size:  # one read, almost always
                read_into(descriptor, into, 0)
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

    def tail(self, relative: str, size: int, length: int) -> bytes:
        """The last `length` bytes (at most) of a registered file of `size` bytes."""
        return self.read(relative, size, max(0, size - length), length)

    def read_verified(self, relative: str, size: int, sha256: str, deadline: Deadline) -> bytes:
        """A whole registered file (at most `size` bytes, the caller's bound) after checking its sha256."""
        with self.open(relative, size) as descriptor:
            data = read_range(descriptor, 0, size)
        if hashlib.sha256(data).hexdigest() != sha256:
            raise PackageDamaged(f"{relative} does not match its registered sha256")
        deadline.check("verifying a file")
        return data

    def verify(self, relative: str, size: int, sha256: str, deadline: Deadline) -> None:
        """Check a registered file of any size against its sha256, a buffer at a time, within `deadline`
        (at once when `intact` holds it as hashed and unchanged since)."""
        digest = hashlib.sha256()
        with self.open(relative, size) as descriptor:
            identity = _identity(os.fstat(descriptor), sha256)
            if self._intact is not None and self._intact.holds(identity):
                return
            offset = 0
            while offset < size:
                deadline.check(f"verifying {relative}")
                chunk = read_range(descriptor, offset, min(HASH_BUFFER_BYTES, size - offset))
                digest.update(chunk)
                offset += len(chunk)
        if digest.hexdigest() != sha256:
            raise PackageDamaged(f"{relative} does not match its registered sha256")
        if self._intact is not None:
            self._intact.add(identity)


def _identity(status: os.stat_result, sha256: str) -> tuple[int | str, ...]:
    # Any write to a file moves its ctime, which no unprivileged call can set back.
    return (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns, sha256)


class IntactFiles:
    """Large manifests already hashed whole and found intact, by their identity on disk (device, inode,
    size, mtime, ctime) and the hash they matched: the service keeps one and passes it to every call, so
    the pages of one package do not hash the same multi-MiB manifest again and again. A file written
    since has another ctime and is hashed again. Bounded; safe to share between threads."""

    def __init__(self, capacity: int = 1024) -> None:
        self._capacity = capacity
        self._known: OrderedDict[tuple[int | str, ...], None] = OrderedDict()
        self._lock = threading.Lock()

    def holds(self, identity: tuple[int | str, ...]) -> bool:
        """Whether a file with this identity was found intact."""
        with self._lock:
            if identity in self._known:
                self._known.move_to_end(identity)
                return True
            return False

    def add(self, identity: tuple[int | str, ...]) -> None:
        """Remember a file found intact (the least recently used is forgotten beyond the capacity)."""
        with self._lock:
            self._known[identity] = None
            self._known.move_to_end(identity)
            while len(self._known) > self._capacity:
                self._known.popitem(last=False)


def read_into(descriptor: int, buffer: memoryview, start: int) -> None:
    """Fill `buffer` with the bytes at `start` (PackageDamaged when the file ends early: it shrank)."""
    filled = os.preadv(descriptor, [buffer], start)
    while filled < len(buffer):
        count = os.preadv(descriptor, [buffer[filled:]], start + filled)
        if count == 0:
            raise PackageDamaged("a package file ended before its registered size")
        filled += count


def read_range(descriptor: int, start: int, length: int) -> bytes:
    """Exactly `length` bytes at `start` (PackageDamaged when the file ends early: it shrank)."""
    data = os.pread(descriptor, length, start)
    while len(data) < length:
        more = os.pread(descriptor, length - len(data), start + len(data))
        if not more:
            raise PackageDamaged("a package file ended before its registered size")
        data += more
    return data
