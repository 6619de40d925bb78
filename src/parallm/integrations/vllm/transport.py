"""What parallm's two transports into engines in other processes need on both sides: the shared-memory file of
``parallm_shm`` (where it lives, how it is created, which files an engine accepts) and the rendezvous of
``parallm_gloo`` (the address the sender binds, the gloo device of each side, the per-connection secret).

Trust model (docs/rl.md, "Trust"): the engines run as the trainer's user; the shared-memory file is created
``O_CREAT | O_EXCL`` with mode 0600 (no other user reads the weights) and its space is allocated at once
(``posix_fallocate``: a directory too small fails with an error instead of a SIGBUS at the first write into a
sparse file); an engine maps only a regular file of its own user with mode 0600 whose name starts with
``parallm_wt_`` in :func:`shm_dir` (or /dev/shm, or the temporary directory). For gloo the sender's store
listens on one address (the one the engines reach it at, 127.0.0.1 when every engine is local), its group keys
lie under a per-connection secret (an unknown party cannot take an engine's rank), and an engine joins only a
store that holds the secret its init request named.
"""

from __future__ import annotations

import datetime
import errno
import os
import secrets
import socket
import stat
import tempfile

__all__ = ["SHM_PREFIX", "allowed_shm_file", "create_shm_file", "gloo_options", "new_secret", "route_address",
           "sender_address", "sender_store", "shm_dir"]

SHM_PREFIX = "parallm_wt_"
SHM_DIR_ENV = "PARALLM_SHM_DIR"


def shm_dir() -> str:
    """Where the sender's shared-memory file goes: ``$PARALLM_SHM_DIR`` when set (read by the trainer and by the
    engines' workers alike), else /dev/shm when it is a writable directory, else the temporary directory."""
    configured = os.environ.get(SHM_DIR_ENV)
    if configured:
        return configured
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def _free_bytes(directory: str) -> int | None:
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def create_shm_file(nbytes: int, *, tag: str) -> str:
    """A new file of ``nbytes`` in :func:`shm_dir`, mode 0600, created exclusively and allocated for real (every
    page backed now: a tmpfs without room raises here, ``ENOSPC``, instead of killing the first writer with
    SIGBUS). Returns its path; raises ``OSError`` naming the directory, the size and the free space (the file
    removed)."""
    directory = shm_dir()
    path = os.path.join(directory, f"{SHM_PREFIX}{tag}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            free = _free_bytes(directory)
            raise OSError(e.errno, f"push_weights: cannot allocate the {nbytes} bytes of the shared-memory file "
                                   f"in {directory} ({os.strerror(e.errno or errno.EIO)}; "
                                   f"{'unknown' if free is None else free} bytes free there): give it more room "
                                   f"(docker: --shm-size), point ${SHM_DIR_ENV} at a larger directory (the "
                                   "engines' workers must see the same setting), or push smaller buckets "
                                   "(bucket_bytes; the file holds two)") from None
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return path


def allowed_shm_file(path, size: int) -> str:
    """Engine side: ``path`` if it is a shared-memory file a parallm sender made for this engine's user (a regular
    file, not a link, named ``parallm_wt_*`` in :func:`shm_dir`, /dev/shm or the temporary directory, owned by
    this process's user, mode 0600, at least ``size`` bytes); otherwise ``ValueError`` saying why."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"the shared-memory path {path!r} is not a path")
    name = os.path.basename(path)
    directory = os.path.realpath(os.path.dirname(path) or ".")
    allowed = {os.path.realpath(d) for d in (shm_dir(), "/dev/shm", tempfile.gettempdir())}
    if not name.startswith(SHM_PREFIX) or directory not in allowed:
        raise ValueError(f"refusing {path!r}: parallm_shm maps only {SHM_PREFIX}* files in {sorted(allowed)} "
                         f"(${SHM_DIR_ENV} adds a directory; the engine's workers must see the trainer's setting)")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise ValueError(f"the shared-memory file {path!r} does not exist on this host: parallm_shm needs the "
                         "engine on the trainer's host (parallm_gloo reaches any host)") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"refusing {path!r}: not a regular file (a link or a device)")
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise ValueError(f"refusing {path!r}: owned by uid {st.st_uid} with mode {oct(st.st_mode & 0o777)}; a "
                         f"parallm sender of this user (uid {os.geteuid()}) creates it with mode 0o600")
    if st.st_size < size:
        raise ValueError(f"{path} holds {st.st_size} bytes, the trainer announced {size}")
    return path


def new_secret() -> str:
    return secrets.token_hex(16)


def route_address(host: str, port: int = 9) -> str:
    """This host's address on the interface that routes to ``host`` (a UDP socket connected there; nothing is
    sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port or 9))
        return s.getsockname()[0]


def sender_address(remote) -> str:
    """The address the engines reach the sender at (``remote``: ``(host, port)`` of each engine not on this
    host): 127.0.0.1 when every engine is on this host, else this host's address on the interface that routes
    to them (one for all; engines behind different interfaces, or a route that ends on a loopback address,
    need ``master_address``)."""
    if not remote:
        return "127.0.0.1"
    found = {}
    for host, port in remote:
        try:
            found[host] = route_address(host, port)
        except OSError as e:
            raise ValueError(f"connect: no route from this host to the engine at {host} ({e}); pass "
                             "master_address=<this host's address as the engines reach it>") from None
    addresses = set(found.values())
    if len(addresses) != 1 or next(iter(addresses)).startswith("127.") or next(iter(addresses)) == "::1":
        raise ValueError(f"connect: the engines are reached through {found}: pass master_address=<this host's "
                         "address as every engine reaches it>")
    return addresses.pop()


def sender_store(address: str, timeout: float):
    """The sender's ``TCPStore``, listening on ``address`` only (a socket bound there handed to the store, which
    owns it from then on), on a free port."""
    import torch.distributed as dist
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((address, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    fd = sock.detach()
    return dist.TCPStore(address, port, is_master=True, timeout=datetime.timedelta(seconds=timeout),
                         wait_for_workers=False, master_listen_fd=fd)


def gloo_options(address: str, timeout: float):
    """Options of a ``ProcessGroupGloo`` whose connections use ``address`` (this side's address as the peers
    reach it; gloo's default resolves the host name, 127.0.1.1 on stock Debian)."""
    import torch.distributed as dist
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    opts._timeout = datetime.timedelta(seconds=timeout)
    return opts
