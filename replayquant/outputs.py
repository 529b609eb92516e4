"""Results files: how every command writes them, which ones it may replace, one run per output.

Writing (`write_file` and its forms `write_text`, `write_json`, `save_figure`, `save_npy`,
`append_line`): the content goes to a temporary file with a name of its own in the target's
folder (`.NAME.XXXXXXXX.tmp`, so two writers never share one), is flushed and fsynced, and is
renamed over the target; the folder is fsynced after the rename. A crash leaves the earlier file
or the new one, never a part of one. A failed write (a full disk, a file-size limit, a folder
that cannot be written) leaves the earlier file as it was, removes the temporary file, and is one
`WriteError` (a ValueError, which the command line prints as one line) naming the file.

Replacing (`check_owned`): a command replaces a results file only when the file holds the kind
of results that command writes (its JSON "kind") and of the same run (the configuration the file
records); a file of another kind, of another run, a file the command reads, or a file that is not
JSON at all is refused before any work, so no file a command did not write is ever overwritten.
Files written beside a results file (its plot, its policy YAML) are replaced only together with
it: one that is there without its results file is refused too.

One run per output (`output_lock`): a run holds an exclusive lock on NAME.lock beside its results
file NAME.json from its checks to its last write. A second run into the same output is refused at
once (not queued), naming the process that holds the lock. The lock is an flock: the system
releases it when its process ends, however it ends (a killed run's lock file blocks nothing).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

__all__ = ["WriteError", "parse_json", "write_file", "write_text", "write_json", "save_figure",
           "save_npy", "append_line", "check_out_given", "check_writable_folder", "diff_records",
           "check_owned", "other_run_error", "lock_path",
           "output_lock"]


class WriteError(ValueError):
    """A file could not be written; the earlier file, where there was one, is left as it was."""


def parse_json(text: str):
    """`json.loads(text)`, with values nested deeper than Python's JSON parser follows (a
    RecursionError, which is no ValueError) raised as the json.JSONDecodeError of any other
    invalid JSON, which every reader turns into its one error naming the file."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("its values nest deeper than a JSON parser follows", text,
                                   0) from None


def _write_error(path: Path, e: OSError, existed: bool) -> WriteError:
    why = e.strerror or str(e)
    if e.errno == errno.ENOSPC:
        why += " (the disk is full)"
    elif e.errno == errno.EFBIG:
        why += " (over the file-size limit, see ulimit -f)"
    kept = f"the earlier {path.name} is left as it was" if existed else "nothing was written there"
    return WriteError(f"cannot write {path}: {why}; {kept}. Make room (or give an --out "
                      f"elsewhere) and run the same command again")


def _fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (where the platform can open a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _file_mode() -> int:
    """The mode a newly created file gets (0o666 less the umask); a temporary file is 0o600."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _read_only(path: Path) -> bool:
    """Whether a file is marked read-only (no write bit at all; for root too, who could write it:
    a results file made read-only is one its owner wants kept)."""
    try:
        return os.stat(path).st_mode & 0o222 == 0
    except OSError:
        return False


def _write_all(fh, data: bytes) -> None:
    """Write every byte of `data` to the unbuffered file `fh`: a write past a file-size limit
    (`ulimit -f`) writes part of it and returns the count, the next one raises EFBIG."""
    view = memoryview(data)
    while view:
        view = view[fh.write(view):]


def _as_bytes(content: bytes | str | Callable) -> bytes:
    if callable(content):
        buf = io.BytesIO()
        content(buf)
        return buf.getvalue()
    return content.encode("utf-8") if isinstance(content, str) else content


def write_file(path, content: bytes | str | Callable) -> Path:
    """Write `path` atomically through a temporary file of its own in the same folder (see the
    module docstring). `content`: bytes, text (UTF-8), or a function that writes to a binary file
    object (called on an in-memory file first: numpy writes arrays through the file descriptor,
    where a write cut short by a file-size limit went unseen and a cut .npy was published).
    Raises WriteError naming `path` when the write fails."""
    path = Path(path)
    existed = path.exists()
    if existed and _read_only(path):     # a rename would replace it all the same
        raise _write_error(path, PermissionError(errno.EACCES, "it is read-only"), existed)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise _write_error(path, e, existed) from None
    try:
        with os.fdopen(fd, "wb", buffering=0) as fh:
            _write_all(fh, _as_bytes(content))
            os.fchmod(fh.fileno(), _file_mode())
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise _write_error(path, e, existed) from None
        raise
    _fsync_dir(path.parent)
    return path


def write_text(path, text: str) -> Path:
    return write_file(path, text)


def write_json(path, obj, indent: int | None = 1, **dumps_kw) -> Path:
    """`obj` as JSON (NaN and infinities as JSON's extension writes them), newline-terminated."""
    return write_file(path, json.dumps(obj, indent=indent, allow_nan=True, **dumps_kw) + "\n")


def save_figure(fig, path, **savefig_kw) -> Path:
    """A matplotlib figure, rendered in memory (format from the suffix), then written atomically."""
    path = Path(path)
    buf = io.BytesIO()
    fig.savefig(buf, format=path.suffix.lstrip(".").lower() or "png", **savefig_kw)
    return write_file(path, buf.getvalue())


def save_npy(path, arr) -> Path:
    return write_file(path, lambda fh: np.save(fh, arr, allow_pickle=False))


def append_line(path, line: str) -> None:
    """Append one line to a log file and fsync it. A line torn by an earlier crash (no newline at
    the end) is closed first; a failed append (a full disk, a file-size limit) is cut off again,
    leaving the file as it was, and is one WriteError naming the file. Unbuffered: a buffer
    would flush the failed bytes again at the cut and at the close."""
    path = Path(path)
    data = line.rstrip("\n") + "\n"
    try:
        fh = open(path, "a+b", buffering=0)
    except OSError as e:
        raise _write_error(path, e, path.exists()) from None
    with fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        if size > 0:
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":
                data = "\n" + data
        try:
            _write_all(fh, data.encode("utf-8"))
            os.fsync(fh.fileno())
        except OSError as e:
            with contextlib.suppress(OSError):
                fh.truncate(size)
            raise _write_error(path, e, size > 0) from None


def check_out_given(out) -> None:
    """One ValueError for an --out given as an empty or blank string (it would mean the current
    folder, or fall back to the default without a word); None (not given) passes."""
    if out is not None and not str(out).strip():
        raise ValueError("--out is empty: give a path, or leave --out out for the default")


def check_out_folder(out, writes: str) -> Path:
    """The --out folder `out` of a command that writes several files into one (`writes` names
    them, for the message), checked before any work: not a file, and writable
    (`check_writable_folder`; created later if missing)."""
    check_out_given(out)
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--out {out} is a file; {writes} into a folder: give a folder (created "
                         f"if missing)")
    check_writable_folder(folder, out)
    return folder


def check_writable_folder(folder, out) -> None:
    """Raise ValueError (naming the --out value `out`) unless a file can be created in `folder`
    or in the nearest folder above it that exists (a trial file, removed at once: permissions
    alone do not tell, e.g. for root on a read-only file system)."""
    probe = Path(folder)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"--out {out}: {probe} is a file, not a folder; give a path in a folder")
    try:
        fd, name = tempfile.mkstemp(dir=probe, prefix=".replayquant-write-test-")
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write in {probe} ({e.strerror or e}); give an --out "
                         f"in a writable folder") from None
    os.close(fd)
    os.unlink(name)


# ---------------------------------------------------------------------------------- replacing

def _canon(x) -> str:
    return json.dumps(x, sort_keys=True, separators=(",", ":"))


def diff_records(old: dict, new: dict, prefix: str = "") -> list[str]:
    """'key: old (file) vs new (now)' for every (nested) key where two records differ."""
    diffs = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += diff_records(a, b, f"{prefix}{k}.")
        elif _canon(a) != _canon(b):
            diffs.append(f"{prefix}{k}: {a!r} (file) vs {b!r} (now)")
    return diffs


def _same_file(a: Path, b) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def check_owned(out, kind: str, writer: str, *, identity: dict | None = None,
                recorded: Callable[[dict], dict] | None = None, inputs=(), beside=(),
                rebuilt_from=None, fresh=(), unkinded: Callable[[dict], bool] | None = None) -> None:
    """Refuse (one ValueError naming `out` and what to do) unless a run of `writer` may replace
    `out`: it does not exist, or it holds a JSON results file of `kind` whose recorded run
    (`recorded(old)`) equals `identity` (when given). Also refused: `out` being one of the files
    the run reads (`inputs`), and a file of `beside` (written with `out`: a plot, a policy YAML)
    that is there while `out` is not. `rebuilt_from`: what a damaged `out` is rebuilt from (said
    in the message); `fresh`: the run's other files, named where the message says what to delete
    to start fresh. `unkinded`: recognizes the command's files that carry no "kind" (written
    before its files did, or in another tool's format, e.g. lm-eval's results dict), which are
    then taken as files of `kind`."""
    out = Path(out)
    if out.is_symlink():
        raise ValueError(f"--out {out} is a symbolic link (to {os.readlink(out)}): a run replaces "
                         f"its results file, which would replace the link, not the file it points "
                         f"to; give that file's own path ({out.resolve()}) or another --out")
    for src in inputs:
        if src is not None and out.exists() and _same_file(out, src):
            raise ValueError(f"--out {out} is the file this command reads ({src}); writing there "
                             f"would destroy it: give another --out")
    if not out.exists():
        for b in beside:
            if Path(b).exists():
                raise ValueError(f"--out {out}: {b} is there but {out.name} is not, so it is not a "
                                 f"file `{writer}` wrote beside its results; refusing to overwrite "
                                 f"it: move it away or give another --out")
        return
    if not out.is_file():
        raise ValueError(f"--out {out} exists and is not a regular file; give another --out")
    if _read_only(out):
        raise ValueError(f"--out {out} is read-only; refusing to replace it: make it writable "
                         f"(chmod u+w) or give another --out")
    try:
        old = parse_json(out.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        if rebuilt_from is not None:
            raise ValueError(f"{out} exists but is not a results file (invalid JSON); pass another "
                             f"--out, or delete it: a results file is rebuilt from {rebuilt_from}, "
                             f"so nothing computed is lost") from None
        raise ValueError(f"--out {out} exists and is not a results file of `{writer}` (not JSON); "
                         f"refusing to overwrite it: give another --out, or move it away") from None
    got = old.get("kind") if isinstance(old, dict) else None
    if got is None and isinstance(old, dict) and unkinded is not None and unkinded(old):
        got = kind
    if got != kind:
        what = f"a {got} file" if isinstance(got, str) else "JSON that is not a replayquant results file"
        raise ValueError(f"--out {out} holds {what}, not the {kind} results `{writer}` writes; "
                         f"refusing to overwrite it: give another --out, or move it away")
    if identity is None:
        return
    try:
        then = (recorded or (lambda o: o))(old) or {}
    except (AttributeError, KeyError, TypeError, IndexError):
        then = None
    if not isinstance(then, dict):
        raise ValueError(f"--out {out} is a damaged {kind} file (it does not say which run wrote "
                         f"it); refusing to overwrite it: give another --out, or move it away")
    diffs = diff_records(then, identity)
    if diffs:
        raise other_run_error(out, diffs, fresh)


def other_run_error(out, diffs: list[str], fresh=()) -> ValueError:
    """The refusal of results of another configuration (`diff_records` lines) at `out`."""
    shown = "; ".join(diffs[:4]) + (" ..." if len(diffs) > 4 else "")
    others = [str(f) for f in fresh]
    delete = ", ".join([str(out), *others[:-1]]) + (f" and {others[-1]}" if others else "")
    return ValueError(f"{out} holds results of a different configuration ({shown}); refusing to "
                      f"replace or mix them. Give another --out, or delete {delete} to start fresh")


# ---------------------------------------------------------------------------------- locking

_held: dict[str, list] = {}     # lock file (absolute) -> [fd, depth]: one process may nest them


def lock_path(out) -> Path:
    """The lock file of a results file NAME.json: NAME.lock beside it."""
    out = Path(out)
    return out.with_name(out.stem + ".lock")


def _lock_record(fd: int):
    """What a lock file holds: None when empty, its record when it is one of ours, else False."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        raw = os.read(fd, 4096)
    except OSError:
        return None
    if not raw:
        return None
    try:
        info = parse_json(raw.decode("utf-8"))
    except ValueError:
        return False
    return info if isinstance(info, dict) and "pid" in info else False


def _holder(fd: int) -> str:
    try:
        info = _lock_record(fd)
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(info["started"]))
        return (f"process {info['pid']} on {info['host']}, running since {since}: "
                f"{info.get('command', '?')}")
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not yet said which it is"


@contextlib.contextmanager
def output_lock(out):
    """Hold the lock of results file `out` (see the module docstring) for the `with` block; one
    ValueError, naming the lock file and the process holding it, when another process holds it.
    Nested locks of one output in one process are one lock."""
    lock = lock_path(out)
    key = os.path.abspath(lock)
    if key in _held:
        _held[key][1] += 1
        try:
            yield lock
        finally:
            _held[key][1] -= 1
        return
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {out}: cannot create {lock.parent} ({e.strerror or e}); give an "
                         f"--out in a writable folder") from None
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            raise ValueError(f"--out {out}: cannot create the lock file {lock} "
                             f"({e.strerror or e}); give an --out in a writable folder") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            who = _holder(fd)
            os.close(fd)
            raise ValueError(f"{out} is in use by another run ({who}; lock {lock}): one run at a "
                             f"time writes an output. Wait for that run to end, or give another "
                             f"--out") from None
        try:   # the run that held it may have removed the file just before this one locked it
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    if _lock_record(fd) is False:
        os.close(fd)
        raise ValueError(f"--out {out}: {lock} is there and is not a replayquant lock file (the "
                         f"lock of {Path(out).name} goes there); refusing to overwrite it: move it "
                         f"away or give another --out")
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:300]}
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(info).encode("utf-8"))
    _held[key] = [fd, 0]
    try:
        yield lock
    finally:
        del _held[key]
        with contextlib.suppress(OSError):
            os.unlink(lock)
        os.close(fd)
