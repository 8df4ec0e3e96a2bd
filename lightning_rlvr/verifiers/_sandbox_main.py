"""Sandbox launcher: runs untrusted Python against test cases inside fresh Linux namespaces, under limits.

Started by :func:`lightning_rlvr.verifiers.sandbox.run_tests` as ``python -I <this file>`` with a scrubbed
environment; reads one JSON job on stdin and writes one JSON result on stdout. Standard library only, so that
it starts in tens of milliseconds and imports nothing of the trainer's.

Layout of one run::

    trainer ── launcher (this process, outside) ── harness (PID 1 of new PID/mount/net/IPC/UTS namespaces)
                                                        └── one forked child per test case (runs the program)

Containment, and why each piece is there:

- **Network**: a new network namespace holds only a loopback interface that is down, so nothing, not even the
  host's own 127.0.0.1, can be reached.
- **Processes**: the harness is PID 1 of a new PID namespace, so every process the program starts dies with it
  (the kernel kills a namespace when its init exits; ``PR_SET_PDEATHSIG`` ties the harness to the launcher and
  the launcher to nothing that can leak). ``RLIMIT_NPROC`` caps the process count, and means something only
  because the harness first leaves root: run as root it drops to a fresh unprivileged uid (root ignores
  ``RLIMIT_NPROC``); run as a normal user it enters a new user namespace and drops every capability.
- **Files**: the whole mount tree is made read-only (``mount_setattr(AT_RECURSIVE, MOUNT_ATTR_RDONLY)``); a
  size-capped tmpfs at ``/tmp`` is the only writable place and the working directory. ``/proc`` is mounted
  afresh, so no process outside the namespace (the trainer, and its environment) is visible.
- **Environment**: the launcher is started with an empty environment; the program sees ``PATH``, ``HOME``,
  ``LANG`` and one-thread settings for OpenMP/OpenBLAS/MKL.
- **Resources**: per test, ``RLIMIT_CPU`` (CPU seconds), ``RLIMIT_AS`` (address space), ``RLIMIT_FSIZE`` (the
  largest file, which caps stdout and stderr since both go to files) and a wall-clock kill; ``RLIMIT_NOFILE``.
- **Forged passes**: an assert-style test passes only if the child reaches the end of the test code and writes
  the test's nonce to a pipe; a program that calls ``sys.exit(0)`` or ``os._exit(0)`` before the asserts does not.
  The nonce lives in the child's memory, so a program that searches its own interpreter's frames could still
  find it; stdin/stdout tests are judged by the harness from outside the child and cannot be forged that way.
"""

import ctypes
import json
import os
import resource
import select
import shutil
import signal
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x1000, 0x4000, 1 << 18
MNT_DETACH = 0x2
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (syscalls added after 5.1 share numbers)
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
_LINUX_CAPABILITY_VERSION_3 = 0x20080522

# A fresh uid and gid for the sandboxed processes when run as root: no file on the host belongs to them, and
# RLIMIT_NPROC counts per uid, so the launcher's own PID (unique among live processes) keeps concurrent sandboxes
# from sharing one process budget.
_SANDBOX_ID_BASE = 1_500_000_000

_libc = ctypes.CDLL(None, use_errno=True)


class SandboxSetupError(Exception):
    """The kernel refused a containment step; the run is not started."""


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise SandboxSetupError(f"{what} failed: {os.strerror(errno)} (errno {errno})")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)),
           f"mount {fstype or source} on {target}")


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _make_tree_read_only() -> None:
    attr = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    _check(_libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr)),
           "mount_setattr(/, read-only, recursive)")


def _empty_bounding_set() -> None:
    """No capability can ever be regained (through a file capability, say) once this set is empty."""
    for cap in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != 22:  # EINVAL: past the last
            _check(-1, f"dropping capability {cap} from the bounding set")


def _drop_all_capabilities() -> None:
    _empty_bounding_set()
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: all empty (two 32-bit words each)
    _check(_libc.capset(header, data), "capset (drop all capabilities)")


def _write(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def _write_id_maps(pid: int | str, job: dict) -> None:
    # Root inside the namespace is the sandbox's host uid (the caller's own uid when not root). Started as root,
    # host root is mapped too (as uid 1), so that the harness can still set up the file system as itself before
    # it becomes namespace root and drops every capability.
    extra = "\n1 0 1" if job["started_as_root"] else ""
    _write(f"/proc/{pid}/setgroups", "deny")
    _write(f"/proc/{pid}/uid_map", f"0 {job['sandbox_id']} 1{extra}")
    _write(f"/proc/{pid}/gid_map", f"0 {job['sandbox_gid']} 1{extra}")


def _enter_namespaces(job: dict) -> None:
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    if not job["user_namespace"]:
        _check(_libc.unshare(flags), "unshare (mount, PID, network, IPC, UTS namespaces)")
        return
    helper = None
    if job["started_as_root"]:
        # Mapping another uid than one's own takes CAP_SETUID in the parent namespace, which a process gives up
        # by entering the new one: a helper that stays outside writes the maps.
        go_read, go_write = os.pipe()
        parent = os.getpid()
        helper = os.fork()
        if helper == 0:
            os.close(go_write)
            code = 1
            try:
                if os.read(go_read, 1):
                    _write_id_maps(parent, job)
                    code = 0
            finally:
                os._exit(code)
        os.close(go_read)
    try:
        _check(_libc.unshare(CLONE_NEWUSER | flags), "unshare (user namespace; are unprivileged user namespaces "
               "enabled? sysctl kernel.unprivileged_userns_clone / user.max_user_namespaces)")
        if helper is not None:
            os.write(go_write, b"x")
    finally:
        if helper is not None:
            os.close(go_write)  # without the go-ahead byte, the helper exits without writing
    if helper is None:
        _write_id_maps("self", job)
    elif os.waitstatus_to_exitcode(os.waitpid(helper, 0)[1]) != 0:
        raise SandboxSetupError("writing the user namespace's uid/gid maps failed")


def _set_limit(which: int, value: int) -> None:
    resource.setrlimit(which, (value, value))


def _first_closed_directory(path: str, uid: int) -> str | None:
    """The first directory on the way to ``path`` (``path`` included) that ``uid`` may not enter, if any."""
    current = "/"
    for part in [p for p in os.path.normpath(path).split("/") if p]:
        current = os.path.join(current, part)
        try:
            info = os.stat(current)
        except OSError:
            return None
        if os.path.isdir(current) and info.st_uid != uid and not info.st_mode & 0o001:
            return current
    return None


def _expose_interpreter(uid: int) -> None:
    """Lets ``uid`` read the Python installation when it lies under a closed directory (``/root/.pyenv``).

    The closed directory is covered, in this mount namespace only, by an empty world-readable tmpfs into which
    just the needed child is bind-mounted back, so its other contents (``/root/.ssh``) stay hidden.
    """
    # Entries of /tmp are held and bound back whole (_hold_interpreter_entries_of_tmp).
    needed = {p for p in _needed_paths() if not os.path.normpath(p).startswith("/tmp/")}
    staging = "/tmp/.expose"
    os.mkdir(staging, 0o700)
    for _ in range(32):  # each round opens one closed directory; nested closed directories take more rounds
        blocked = {}
        for path in needed:
            closed = _first_closed_directory(path, uid)
            if closed is not None:
                child = os.path.normpath(path)[len(closed):].lstrip("/").split("/")[0]
                blocked.setdefault(closed, set()).add(child)
        if not blocked:
            break
        closed, children = next(iter(blocked.items()))
        children.discard("")  # the needed path itself is closed: nothing inside it can be exposed alone
        held = []
        for index, child in enumerate(sorted(children)):
            hold = os.path.join(staging, str(index))
            os.mkdir(hold)
            _mount(os.path.join(closed, child), hold, None, MS_BIND | MS_REC)
            held.append((child, hold))
        _mount("tmpfs", closed, "tmpfs", MS_NOSUID | MS_NODEV, "size=65536,mode=0755")
        for child, hold in held:
            os.mkdir(os.path.join(closed, child))
            _mount(hold, os.path.join(closed, child), None, MS_BIND | MS_REC)
            _check(_libc.umount2(hold.encode(), MNT_DETACH), f"umount {hold}")
            os.rmdir(hold)
        if not held:
            break
    os.rmdir(staging)


SYS_OPEN_TREE, SYS_MOVE_MOUNT = 428, 429
OPEN_TREE_CLONE, MOVE_MOUNT_F_EMPTY_PATH = 1, 0x4
_KEPT_IN_TMP: set[str] = set()  # entries of /tmp that hold the interpreter: bound back read-only, never emptied


def _needed_paths() -> set[str]:
    return {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable)),
            *[p for p in sys.path if p]}


def _hold_interpreter_entries_of_tmp() -> list[tuple[str, int]]:
    """Detached copies of the /tmp entries the interpreter lives in (a checkout under /tmp), before /tmp is covered."""
    held = []
    for name in sorted({os.path.normpath(p)[5:].split("/")[0] for p in _needed_paths()
                        if os.path.normpath(p).startswith("/tmp/")}):
        fd = _libc.syscall(SYS_OPEN_TREE, AT_FDCWD, f"/tmp/{name}".encode(), OPEN_TREE_CLONE | AT_RECURSIVE)
        if fd < 0:
            _check(-1, f"open_tree(/tmp/{name})")
        held.append((name, fd))
    return held


def _restore_held_entries(held: list[tuple[str, int]]) -> None:
    for name, fd in held:
        target = f"/tmp/{name}"
        os.mkdir(target)
        _check(_libc.syscall(SYS_MOVE_MOUNT, fd, b"", AT_FDCWD, target.encode(), MOVE_MOUNT_F_EMPTY_PATH),
               f"move_mount to {target}")
        os.close(fd)
        attr = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
        _check(_libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, target.encode(), AT_RECURSIVE, ctypes.byref(attr),
                             ctypes.sizeof(attr)), f"mount_setattr({target}, read-only)")
        _KEPT_IN_TMP.add(name)


def _prepare_harness(job: dict) -> None:
    """In PID 1 of the new namespaces: file system view, limits, then leave privilege for good."""
    user_namespace, sandbox_id = job["user_namespace"], job["sandbox_id"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done below propagates back to the host
    # tmpfs owner ids are read in the caller's user namespace: there the sandbox's uid is 0.
    owner = ",uid=0,gid=0" if user_namespace else f",uid={sandbox_id},gid={job['sandbox_gid']}"
    tmpfs_options = f"size={job['disk_bytes']},mode=0700{owner}"
    held = _hold_interpreter_entries_of_tmp()
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, tmpfs_options)  # staging room for _expose_interpreter
    if job["started_as_root"]:
        _expose_interpreter(sandbox_id)
    _make_tree_read_only()
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, tmpfs_options)
    _restore_held_entries(held)
    try:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except SandboxSetupError:
        # A container that masks parts of /proc forbids a fresh proc mount in a user namespace: hide /proc
        # instead, so that the trainer's /proc/<pid>/environ stays out of reach.
        _mount("tmpfs", "/proc", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4096,mode=0555")
    os.chdir("/tmp")
    _set_limit(resource.RLIMIT_CORE, 0)
    _set_limit(resource.RLIMIT_NOFILE, 64)
    if user_namespace:
        os.setresgid(0, 0, 0)  # namespace root = the sandbox's host uid (a no-op when started as that user)
        os.setresuid(0, 0, 0)
        _drop_all_capabilities()
    else:
        _empty_bounding_set()
        os.setgroups([])
        os.setresgid(job["sandbox_gid"], job["sandbox_gid"], job["sandbox_gid"])
        os.setresuid(sandbox_id, sandbox_id, sandbox_id)  # leaving uid 0 clears the effective and permitted sets
    # The harness counts as one of its uid's processes; after leaving root the limit holds.
    _set_limit(resource.RLIMIT_NPROC, job["max_processes"] + 1)
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    # Not dumpable: processes of the same uid (the program) cannot open /proc/1/fd or ptrace the harness.
    _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    os.environ.clear()
    # One thread per numerical library: a pool sized to the host's cores would break the process limit on import.
    os.environ.update(PATH="/usr/bin:/bin", HOME="/tmp", LANG="C.UTF-8", OMP_NUM_THREADS="1",
                      OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")


def _run_test_child(program: str, test: dict, index: int, nonce_fd: int, nonce: bytes, job: dict) -> None:
    """In the forked child: limits, redirections, then the program (and the assert test). Never returns."""
    code = 1
    try:
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; the output cap should kill
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        stdin = os.open(f"/tmp/.stdin{index}", os.O_RDONLY)
        stdout = os.open(f"/tmp/.stdout{index}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        stderr = os.open(f"/tmp/.stderr{index}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
            os.dup2(fd, target)
            os.close(fd)
        os.closerange(3, nonce_fd)
        os.closerange(nonce_fd + 1, 1 << 16)
        cpu_s = max(1, int(job["cpu_s"] + 0.999))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        _set_limit(resource.RLIMIT_AS, job["memory_bytes"])
        _set_limit(resource.RLIMIT_FSIZE, job["max_output_bytes"])
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False)
        namespace = {"__name__": "__main__", "__builtins__": __builtins__}
        try:
            exec(compile(program, "solution.py", "exec"), namespace)
            if test["kind"] == "assert":
                exec(compile(test["code"], "test.py", "exec"), namespace)
        except SystemExit as stop:
            # Ending the program early is normal for stdin/stdout programs; for assert tests the test never ran.
            if test["kind"] == "assert" or stop.code not in (None, 0):
                raise
        sys.stdout.flush()
        os.write(nonce_fd, nonce)
        code = 0
    except BaseException:  # noqa: BLE001 - anything the program does ends here
        try:
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
        except BaseException:  # noqa: BLE001
            pass
    os._exit(code)


def _read_capped(path: str, limit: int, tail: bool = False) -> str:
    """At most ``limit`` bytes of a file: its beginning, or its end when ``tail``."""
    try:
        with open(path, "rb") as handle:
            if tail:
                handle.seek(max(0, os.fstat(handle.fileno()).st_size - limit))
            return handle.read(limit).decode("utf-8", "replace")
    except OSError:
        return ""


def _outputs_match(actual: str, expected: str) -> bool:
    # Judges compare tokens line by line: trailing spaces and trailing blank lines do not count.
    normalise = lambda s: [line.rstrip() for line in s.rstrip().splitlines()]  # noqa: E731
    return normalise(actual) == normalise(expected)


def _reap_everything_else() -> None:
    """As PID 1 of the namespace: kill every other process in it (kill(-1) spares the caller) and reap them."""
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass
    while True:
        try:
            pid, _ = os.waitpid(-1, 0)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _run_one(program: str, test: dict, index: int, job: dict) -> dict:
    with open(f"/tmp/.stdin{index}", "w") as handle:
        handle.write(test.get("input", ""))
    nonce = os.urandom(16).hex().encode()
    read_end, write_end = os.pipe()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        _run_test_child(program, test, index, write_end, nonce, job)
    os.close(write_end)
    pidfd = os.pidfd_open(pid)
    ready, _, _ = select.select([pidfd], [], [], job["wall_s"])
    timed_out = not ready
    if timed_out:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    os.close(pidfd)
    elapsed = time.monotonic() - started
    os.set_blocking(read_end, False)
    try:
        reported = os.read(read_end, 64)
    except BlockingIOError:
        reported = b""
    os.close(read_end)
    _reap_everything_else()  # whatever the program left behind (a daemon, half a fork bomb) ends with its test
    result = {"passed": False, "seconds": round(elapsed, 4)}
    if timed_out:
        result["status"] = "wall_time_limit"
    elif os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        result["status"] = {signal.SIGXCPU: "cpu_time_limit", signal.SIGKILL: "killed",
                            signal.SIGXFSZ: "output_limit"}.get(signum, f"signal {signal.Signals(signum).name}")
    elif os.WEXITSTATUS(status) != 0:
        result["status"] = "error"
    elif test["kind"] == "assert" and reported != nonce:
        result["status"] = "exited_early"
    elif test["kind"] == "stdio" and not _outputs_match(
            _read_capped(f"/tmp/.stdout{index}", job["max_output_bytes"]), test["output"]):
        result["status"] = "wrong_answer"
    else:
        result.update(passed=True, status="passed")
    if not result["passed"]:  # heads and tails for whoever debugs a failing program
        result["stdout"] = _read_capped(f"/tmp/.stdout{index}", 300)
        result["stderr"] = _read_capped(f"/tmp/.stderr{index}", 500, tail=True)
    _empty_tmp()
    return result


def _empty_tmp() -> None:
    """Removes everything in ``/tmp``, so that each test starts from an empty working directory."""

    def unlock_and_retry(function, path, _):
        try:
            os.chmod(os.path.dirname(path), 0o700)  # a program may have locked its own directories
            function(path)
        except OSError:
            pass

    for entry in os.scandir("/tmp"):
        if entry.name in _KEPT_IN_TMP:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, onerror=unlock_and_retry)
        else:
            os.unlink(entry.path)


def _harness(job: dict) -> int:
    try:
        _prepare_harness(job)
    except (SandboxSetupError, OSError) as err:
        print(json.dumps({"setup_error": str(err)}), flush=True)
        return 3
    results = [_run_one(job["program"], test, index, job) for index, test in enumerate(job["tests"])]
    print(json.dumps({"results": results}), flush=True)
    return 0


def main() -> int:
    job = json.load(sys.stdin)
    started_as_root = os.geteuid() == 0
    if started_as_root:
        os.setgroups([])  # root's supplementary groups (root's own group) must not follow the program in
    # Root drops to a fresh uid; anyone else (or root when asked, to test that path) uses a user namespace whose
    # root is the caller's own uid (for root: the fresh uid, so that RLIMIT_NPROC still holds).
    job.update(started_as_root=started_as_root,
               user_namespace=bool(job.get("user_namespace")) or not started_as_root,
               sandbox_id=_SANDBOX_ID_BASE + os.getpid() if started_as_root else os.getuid(),
               sandbox_gid=_SANDBOX_ID_BASE + os.getpid() if started_as_root else os.getgid())
    try:
        _enter_namespaces(job)
    except (SandboxSetupError, OSError) as err:
        print(json.dumps({"setup_error": str(err)}), flush=True)
        return 3
    alive_read, alive_write = os.pipe()  # EOF on it = the launcher is gone
    pid = os.fork()  # the first process forked after unshare(CLONE_NEWPID) is PID 1 of the new namespace
    if pid == 0:
        os.close(alive_write)
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if select.select([alive_read], [], [], 0)[0]:  # the launcher died before the death signal was armed
            os._exit(4)
        os.close(alive_read)
        os._exit(_harness(job))
    os.close(alive_read)
    deadline = job["wall_s"] * max(1, len(job["tests"])) + 5.0
    pidfd = os.pidfd_open(pid)
    ready, _, _ = select.select([pidfd], [], [], deadline)
    if not ready:
        os.kill(pid, signal.SIGKILL)  # PID 1 of the namespace: every process in it goes with it
    _, status = os.waitpid(pid, 0)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 5


if __name__ == "__main__":
    sys.exit(main())
