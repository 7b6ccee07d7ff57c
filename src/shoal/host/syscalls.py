"""mount(2)/umount2(2) through libc: a syscall costs microseconds, spawning `mount` costs milliseconds."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MNT_DETACH = 2
MNT_FORCE = 1
UMOUNT_NOFOLLOW = 8


def mount(source: str, target: str, fstype: str, flags: int = 0, data: str | None = None) -> None:
    """Mount `source` on `target`; raises OSError with the errno and the arguments on failure."""
    rc = _libc.mount(source.encode(), target.encode(), fstype.encode(), flags,
                     data.encode() if data is not None else None)
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount -t {fstype} {source} {target} ({data or ''}): {os.strerror(err)}")


def umount(target: str, detach: bool = False) -> None:
    """Unmount `target`; a lazy (detached) unmount when `detach`. Raises OSError on failure."""
    flags = UMOUNT_NOFOLLOW | (MNT_DETACH if detach else 0)
    if _libc.umount2(target.encode(), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"umount {target}: {os.strerror(err)}")


def umount_or_detach(target: str) -> bool:
    """Unmount `target`; when it is busy (EBUSY: an fd or a dying process still holds it), detach it instead
    and let the kernel free it once released. True when it had to detach. Other errors raise OSError."""
    try:
        umount(target)
        return False
    except OSError as e:
        if e.errno != errno.EBUSY:
            raise
    umount(target, detach=True)
    return True


# statx(2) says whether a path is the root of a mount (STATX_ATTR_MOUNT_ROOT, Linux >= 5.8): one
# syscall, exact for bind mounts and btrfs subvolumes alike, where scanning /proc/self/mountinfo costs
# time proportional to every mount on the host (thousands with thousands of sandboxes).
_STATX_ATTR_MOUNT_ROOT = 0x2000
_AT_SYMLINK_NOFOLLOW = 0x100
_statx = getattr(_libc, "statx", None)
if _statx is not None:
    _statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]


def mount_root(path: str) -> bool | None:
    """True/False when statx can tell whether `path` is the root of a mount; None when it cannot."""
    if _statx is None:
        return None
    buf = ctypes.create_string_buffer(256)
    if _statx(-100, path.encode(), _AT_SYMLINK_NOFOLLOW, 0, buf) != 0:  # -100 = AT_FDCWD
        err = ctypes.get_errno()
        return False if err in (2, 20) else None  # ENOENT, ENOTDIR: nothing is mounted there
    attributes, mask = int.from_bytes(buf.raw[8:16], "little"), int.from_bytes(buf.raw[56:64], "little")
    if not mask & _STATX_ATTR_MOUNT_ROOT:
        return None
    return bool(attributes & _STATX_ATTR_MOUNT_ROOT)


def is_mountpoint(path: str) -> bool:
    """True when `path` is a mountpoint (statx; else per /proc/self/mountinfo, which also sees bind mounts)."""
    p = os.path.realpath(path)
    fast = mount_root(p)
    if fast is not None:
        return fast
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            mp = line.split(b" ", 5)[4].decode("utf-8", "surrogateescape")
            if _unescape(mp) == p:
                return True
    return False


def mounts_under(prefix: str) -> list[str]:
    """Every mountpoint at or below `prefix`, deepest first (the order to unmount them)."""
    p = os.path.realpath(prefix)
    found = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            mp = _unescape(line.split(b" ", 5)[4].decode("utf-8", "surrogateescape"))
            if mp == p or mp.startswith(p.rstrip("/") + "/"):
                found.append(mp)
    return sorted(found, key=len, reverse=True)


#: filesystems whose mounts outlive what serves them (a FUSE server, an NFS/SMB/9p server)
_SERVED_FS = ("fuse", "nfs", "cifs", "smb3", "9p", "ceph", "glusterfs")


def dead_mounts() -> list[str]:
    """Mountpoints of served filesystems (FUSE, NFS, …) that cannot be reached any more: stat fails with
    ENOTCONN (a FUSE mount whose server died), ESTALE, EIO … — deepest first. Local filesystems are not
    stat'ed (nothing to learn), so a slow disk elsewhere does not make this slow."""
    found = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            head, _, tail = line.partition(b" - ")
            fstype = tail.split(b" ", 1)[0].decode("utf-8", "surrogateescape")
            if not fstype.split(".", 1)[0].startswith(_SERVED_FS):
                continue
            mp = _unescape(head.split(b" ", 5)[4].decode("utf-8", "surrogateescape"))
            try:
                os.stat(mp)
            except OSError as e:
                if e.errno not in (errno.ENOENT, errno.EACCES, errno.ENOTDIR):
                    found.append(mp)
    return sorted(set(found), key=len, reverse=True)


def _unescape(s: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal
    if "\\" not in s:
        return s
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and i + 3 < len(s) + 0 and s[i + 1 : i + 4].isdigit():
            out.append(chr(int(s[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(s[i])
            i += 1
    return "".join(out)
