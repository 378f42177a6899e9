"""The confined child's side: what a process does to itself before it reads an untrusted snapshot.

    enter(reads, limits) -> the confinement now in force, as the JSON's `environment.confinement`

In order: resource limits (address space, CPU seconds, no core file, no file growth), then an OS
filter where the kernel has one — Landlock (Linux >= 5.13) limits opening files to *reading* the
snapshot, the Python/torch installation and a few system files (nothing can be created, written,
removed or renamed anywhere; with Landlock ABI >= 4 no TCP bind/connect, >= 6 no abstract UNIX
socket and no signal to a process outside the sandbox), and a seccomp filter makes `socket()`
(every address family), `io_uring_setup` and every non-native-ABI syscall fail with EPERM.
Both are inherited by any process the child might start and cannot be lifted. Both are made with
raw syscalls through ctypes: no dependency, nothing to install (docs/trust.md says why).

Linux only; elsewhere (or on a kernel without them) `enter` applies what exists and says what was lost.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import resource
import signal
import struct
import sys

# ---------------------------------------------------------------- resource limits

CPU_GRACE = 5  # seconds between SIGXCPU (soft) and SIGKILL (hard)


def set_rlimits(*, address_space: int | None, cpu_seconds: int | None, fsize: int = 0,
                lost: list[str] | None = None) -> dict:
    """No core file, no file growth (a write to a regular file fails with EFBIG; the result channel is a pipe) —
    or files of at most `fsize` bytes (the compile child's scratch folder) — and where given an address-space and
    a CPU-time limit. Each limit is clamped to the hard limit already in force (`ulimit -v` on a cluster: an
    unprivileged process can only lower it); what could not be applied as wanted is appended to `lost`. Returns
    what was set."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death: a write is an error, not a crash
    lost = [] if lost is None else lost
    done: dict = {"core": _clamp(resource.RLIMIT_CORE, "core", 0, 0, lost),
                  "fsize": _clamp(resource.RLIMIT_FSIZE, "fsize", fsize, fsize, lost)}
    if address_space:
        done["as"] = _clamp(resource.RLIMIT_AS, "as", address_space, address_space, lost)
    if cpu_seconds:
        done["cpu"] = _clamp(resource.RLIMIT_CPU, "cpu", cpu_seconds, cpu_seconds + CPU_GRACE, lost)
    return done


def _clamp(which: int, name: str, soft: int, hard: int, lost: list[str]) -> int:
    """setrlimit(which, (soft, hard)) lowered to the hard limit in force; the soft limit now in force. A limit
    already lower than wanted is kept (and said: the analysis has less room than asked for)."""
    _, cur_hard = resource.getrlimit(which)
    if cur_hard != resource.RLIM_INFINITY:
        if cur_hard < soft:
            lost.append(f"RLIMIT_{name.upper()} {soft} lowered to the hard limit in force ({cur_hard})")
        soft, hard = min(soft, cur_hard), min(hard, cur_hard)
    try:
        resource.setrlimit(which, (soft, hard))
    except (ValueError, OSError) as e:
        lost.append(f"RLIMIT_{name.upper()} not set: {e}")
        return resource.getrlimit(which)[0]
    return soft


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies (a triage worker killed on --timeout takes its child along)."""
    if not sys.platform.startswith("linux"):
        return
    PR_SET_PDEATHSIG = 1
    _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the prctl: nobody is waiting for us
        os._exit(1)


# ---------------------------------------------------------------- Landlock

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # the same on every Linux architecture
_RULE_PATH_BENEATH = 1
_VERSION = 1 << 0  # landlock_create_ruleset flag: return the ABI version

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_TRUNCATE = 1 << 14  # ABI >= 3
_FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}  # all rights each ABI knows
_NET_ALL = 0b11  # ABI >= 4: bind and connect TCP
_SCOPE_ALL = 0b11  # ABI >= 6: abstract UNIX sockets, signals

# Read-only everywhere Python and torch come from; these exist on every Linux (missing ones are skipped).
SYSTEM_READS = ("/usr", "/lib", "/lib64", "/lib32", "/etc/ld.so.cache", "/etc/localtime", "/proc/cpuinfo",
                "/proc/meminfo", "/proc/self", "/sys/devices/system/cpu", "/sys/fs/cgroup", "/dev/null",
                "/dev/urandom")


def landlock_abi() -> int | None:
    """The kernel's Landlock ABI version, or None (not Linux, an old kernel, Landlock disabled)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = _libc()
    v = libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_VERSION))
    return v if v > 0 else None


def landlock(reads: list[str], writes: list[str] = ()) -> int | None:
    """Allow only reading (files, folders, executing libraries) under `reads` — and every file access under
    `writes` (the compile child's own scratch folder); deny every other file access this ABI can name, TCP
    (ABI >= 4), abstract UNIX sockets and signals out of the sandbox (ABI >= 6). The ABI, or None when the kernel
    has no Landlock."""
    abi = landlock_abi()
    if abi is None:
        return None
    libc = _libc()
    fs = _FS_BY_ABI[max(k for k in _FS_BY_ABI if k <= abi)]
    fields = [fs] + ([_NET_ALL] if abi >= 4 else []) + ([_SCOPE_ALL] if abi >= 6 else [])
    attr = struct.pack(f"<{len(fields)}Q", *fields)
    ruleset = libc.syscall(_SYS_CREATE_RULESET, attr, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}")
    try:
        for path, full in [*((p, False) for p in dict.fromkeys(reads)), *((p, True) for p in writes)]:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # not on this machine: nothing to allow
            try:
                is_dir = os.path.isdir(f"/proc/self/fd/{fd}")
                if full:  # a folder: everything beneath it; a file (/dev/null): read and write it, nothing else
                    allowed = fs if is_dir else READ_FILE | WRITE_FILE | (_TRUNCATE if abi >= 3 else 0)
                else:
                    allowed = (EXECUTE | READ_FILE | READ_DIR) if is_dir else (EXECUTE | READ_FILE)
                rule = struct.pack("<Qi", allowed & fs, fd)  # struct landlock_path_beneath_attr (packed)
                if libc.syscall(_SYS_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH), rule,
                                ctypes.c_uint32(0)) < 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}: {os.strerror(ctypes.get_errno())}")
            finally:
                os.close(fd)
        _no_new_privs()
        if libc.syscall(_SYS_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) < 0:
            raise OSError(ctypes.get_errno(), f"landlock_restrict_self: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(ruleset)
    return abi


# ---------------------------------------------------------------- seccomp

# Per machine: AUDIT_ARCH, the x32 bit, the syscalls denied outright, and those denied unless aimed at this process
# (prlimit64's pid, setpriority's who: 0). Denied: sockets and io_uring (which could open them behind the filter);
# a new session (setsid: it would outlive nanreplay's kill of the child's group); namespaces; device nodes; BPF,
# perf events and userfaultfd (kernel attack surface); keyrings (the user's session keys); System V IPC (the
# user's shared memory segments, semaphores, queues); reading or writing another process's memory.
_ARCHES = {
    "x86_64": (0xC000003E, 0x40000000,
               {"socket": 41, "io_uring_setup": 425, "setsid": 112, "unshare": 272, "setns": 308, "mknod": 133,
                "mknodat": 259, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "add_key": 248,
                "request_key": 249, "keyctl": 250, "shmget": 29, "shmat": 30, "shmctl": 31, "semget": 64,
                "semop": 65, "semctl": 66, "semtimedop": 220, "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71,
                "process_vm_readv": 310, "process_vm_writev": 311},
               {"prlimit64": (302, 0), "setpriority": (141, 1)}),
    "aarch64": (0xC00000B7, 0,
                {"socket": 198, "io_uring_setup": 425, "setsid": 157, "unshare": 97, "setns": 268, "mknodat": 33,
                 "bpf": 280, "perf_event_open": 241, "userfaultfd": 282, "add_key": 217, "request_key": 218,
                 "keyctl": 219, "shmget": 194, "shmctl": 195, "shmat": 196, "semget": 190, "semctl": 191,
                 "semtimedop": 192, "semop": 193, "msgget": 186, "msgctl": 187, "msgrcv": 188, "msgsnd": 189,
                 "process_vm_readv": 270, "process_vm_writev": 271},
                {"prlimit64": (261, 0), "setpriority": (140, 1)}),
}
_EPERM = 0x00050000 | errno.EPERM  # SECCOMP_RET_ERRNO | EPERM
_ALLOW = 0x7FFF0000  # SECCOMP_RET_ALLOW


def _bpf(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def denied_syscalls() -> list[str]:
    """The syscalls the filter denies on this machine (those aimed at other processes included)."""
    arch = _ARCHES.get(platform.machine())
    return sorted([*arch[2], *(f"{n} (other processes)" for n in arch[3])]) if arch else []


def seccomp_no_sockets() -> bool:
    """Make socket(), io_uring_setup, setsid, namespaces, device nodes, BPF, perf events, userfaultfd, keyrings,
    System V IPC, another process's memory, prlimit64/setpriority of another process, and any syscall of another
    ABI (32-bit or x32 entry points) fail with EPERM. False where this machine has no filter for it."""
    arch = _ARCHES.get(platform.machine())
    if arch is None or not sys.platform.startswith("linux"):
        return False
    audit, x32, deny, own_only = arch
    LD_W_ABS, JEQ_K, JGE_K, RET_K = 0x20, 0x15, 0x35, 0x06
    prog = [
        _bpf(LD_W_ABS, 4),  # seccomp_data.arch
        _bpf(JEQ_K, audit, 1, 0),
        _bpf(RET_K, _EPERM),  # another ABI: nothing a Python process makes
        _bpf(LD_W_ABS, 0),  # seccomp_data.nr
        _bpf(JGE_K, x32, 0, 1) if x32 else _bpf(JEQ_K, 0xFFFFFFFF, 0, 1),  # x32 syscalls on x86_64
        _bpf(RET_K, _EPERM),
    ]
    for nr in sorted(deny.values()):
        prog += [_bpf(JEQ_K, nr, 0, 1), _bpf(RET_K, _EPERM)]
    for nr, arg in own_only.values():  # allowed only with 0 (this process) in that argument (low 32 bits)
        prog += [_bpf(JEQ_K, nr, 0, 4), _bpf(LD_W_ABS, 16 + 8 * arg), _bpf(JEQ_K, 0, 0, 1), _bpf(RET_K, _ALLOW),
                 _bpf(RET_K, _EPERM)]
    prog.append(_bpf(RET_K, _ALLOW))
    code = b"".join(prog)
    buf = ctypes.create_string_buffer(code, len(code))
    fprog = struct.pack("<HxxxxxxQ", len(prog), ctypes.addressof(buf))  # struct sock_fprog
    PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
    _no_new_privs()
    fbuf = ctypes.create_string_buffer(fprog, len(fprog))
    if _libc().prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fbuf), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"seccomp: {os.strerror(ctypes.get_errno())}")
    return True


# ---------------------------------------------------------------- capabilities (run as root)

_CAPSET = {"x86_64": 126, "aarch64": 91}


def drop_capabilities() -> str | None:
    """Every capability gone (bounding set, ambient, effective, permitted, inheritable) and no_new_privs, where the
    process has any (run as root): None, or what could not be dropped. A process without capabilities: None."""
    if not sys.platform.startswith("linux") or _cap_eff() == 0:
        return None
    libc = _libc()
    PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the last capability this kernel knows
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    nr = _CAPSET.get(platform.machine())
    if nr is not None:
        header = ctypes.create_string_buffer(struct.pack("<Ii", 0x20080522, 0), 8)  # _LINUX_CAPABILITY_VERSION_3
        data = ctypes.create_string_buffer(bytes(24), 24)  # two {effective, permitted, inheritable}: all zero
        libc.syscall(ctypes.c_long(nr), header, data)
    _no_new_privs()
    left = _cap_eff()
    return None if left == 0 else f"capabilities not dropped (CapEff {left:#x})"


def _cap_eff() -> int:
    try:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1], 16) for ln in f if ln.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return 0


# ---------------------------------------------------------------- all together


def enter(reads: list[str] | None, *, address_space: int | None, cpu_seconds: int | None,
          writes: list[str] = (), fsize: int = 0) -> dict:
    """Confine this process: the limits, then Landlock (reads only under `reads` + SYSTEM_READS + this Python,
    writes only under `writes`; None: no file filter), then seccomp. Returns what is in force
    (`environment.confinement` of the JSON)."""
    lost: list[str] = []
    state: dict = {"process": True, "landlock": None,
                   "rlimits": set_rlimits(address_space=address_space, cpu_seconds=cpu_seconds, fsize=fsize,
                                          lost=lost)}
    if writes:
        state["writes"] = ["the compile child's own scratch folder" if os.path.isdir(w) else w for w in writes]
    had = _cap_eff() != 0
    caps = drop_capabilities()  # before any filter and before the snapshot is opened
    if caps:
        lost.append(caps)
    elif had:
        state["capabilities"] = "dropped"
    try:
        if reads is not None:
            abi = landlock([*reads, *python_reads(), *SYSTEM_READS], list(writes))
            state["landlock"] = f"abi {abi}" if abi else None
    except OSError as e:
        lost.append(f"landlock failed: {e}")
    if state["landlock"] is None and not any(x.startswith("landlock") for x in lost) and reads is not None:
        lost.append("no Landlock on this kernel: files are not filtered (only the limits and the empty, private "
                    "working folder hold)")
    try:
        state["seccomp"] = seccomp_no_sockets()
    except OSError as e:
        state["seccomp"] = False
        lost.append(f"seccomp failed: {e}")
    if not state["seccomp"] and not any(x.startswith("seccomp") for x in lost):
        lost.append(f"no seccomp filter for {platform.machine()}: sockets are not denied")
    state["lost"] = "; ".join(lost) or None
    return state


def python_reads() -> list[str]:
    """Where this Python and its packages (torch, nanreplay) are installed — never the current folder."""
    import sysconfig

    import nanreplay

    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable)),
             os.path.dirname(os.path.abspath(nanreplay.__file__))]
    paths += [p for k, p in sysconfig.get_paths().items() if k in ("stdlib", "platstdlib", "purelib", "platlib")]
    for name in ("torch", "numpy", "typing_extensions", "sympy", "jinja2", "markupsafe", "filelock", "fsspec",
                 "networkx", "mpmath"):
        mod = sys.modules.get(name)
        f = getattr(mod, "__file__", None)
        if f:
            paths.append(os.path.dirname(os.path.dirname(os.path.abspath(f))))  # its site-packages
    return [p for p in paths if p and os.path.isabs(p) and p != "/"]


def wipe_initial_environment() -> bool:
    """Zero the environment block this process started with (a fork inherits it from a fork server or a worker that
    started with the analyst's environment: /proc/self/environ reads that memory, whatever os.environ now holds).
    Call after os.environ is replaced (nothing then points into the old block). False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end: fields 50 and 51 of proc(5)
    except (OSError, IndexError, ValueError):
        return False
    if not 0 < start < end or end - start > 64 << 20:
        return False
    ctypes.memset(start, 0, end - start)
    return True


def _no_new_privs() -> None:
    PR_SET_NO_NEW_PRIVS = 38
    if _libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")


def _libc():
    lib = ctypes.CDLL(None, use_errno=True)
    lib.syscall.restype = ctypes.c_long
    lib.prctl.restype = ctypes.c_int
    lib.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return lib
