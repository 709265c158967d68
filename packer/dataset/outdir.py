"""The one place that writes a dataset dir: its lock, its staging, its generation dirs, and the
publish that turns a finished build into the dataset.

- One writer at a time: every command that writes OUT holds an flock on `OUT/.mmpack.lock`
  (build parts a shared one, so they run side by side; everything else an exclusive one). A
  second writer is refused at once with the holder's pid and command. The kernel drops the lock
  of a dead process; while a dead holder's worker processes still hold it, a new writer waits
  for them (a few seconds at most, see `packer.builder.pool`), then takes over.
- A build writes whole shards into a generation dir of its own, `OUT/g-<hex>/shard-k/`, named
  in its plan (so a killed build run again goes on in the same one). Nothing in a generation
  dir is read before a manifest names it.
- Publish: the generation's copy of the manifest, then OUT's own by atomic rename. Readers see
  the old dataset or the new one, never a mix. Then the staging, stray temp files and every
  generation no manifest uses go, each only once no reader holds it ("safe": no process has a
  shared lock on its `.readers.lock`, which every DatasetReader of it holds while open).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from packer.dataset import format as fmt
from packer.errors import ConfigError
from packer.system import flock, process_alive

DEAD_HOLDER_WAIT_S = 30.0  # how long a dead writer's last worker processes may keep OUT locked


def staging_dir(out: Path) -> Path:
    return out / fmt.STAGING_DIR


def new_generation() -> str:
    return f"g-{secrets.token_hex(8)}"


@contextlib.contextmanager
def locked(out: Path, *, shared: bool = False) -> Iterator[None]:
    """Hold OUT's writer lock (made, with OUT, if need be) for the block. An OUT this made and
    the block left empty (a command that failed before writing) is removed again."""
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    path = out / fmt.LOCK_NAME
    waited_since = None
    while True:
        f = open(path, "a+")
        try:
            got = flock(f, shared=shared, block=False)
        except BaseException:
            f.close()
            raise
        if got and _same_file(f, path):
            break
        f.close()
        if got:  # the file was replaced between open and lock: lock the new one
            continue
        holder = _holder(path)
        pid = holder.get("pid")
        if not isinstance(pid, int) or pid <= 0 or process_alive(pid):  # an unknown holder counts as alive
            raise ConfigError(f"{out}: another mmpack process is writing it (pid {holder.get('pid')}: "
                              f"{holder.get('command', '?')}); wait for it to end, or stop it, then run this again")
        waited_since = waited_since or time.monotonic()  # its holder is dead: its workers are going
        if time.monotonic() - waited_since > DEAD_HOLDER_WAIT_S:
            raise ConfigError(f"{out}: still locked {DEAD_HOLDER_WAIT_S:.0f} s after its writer (pid "
                              f"{holder.get('pid')}) died; stop its remaining worker processes, then run this again")
        time.sleep(0.05)
    try:
        _note_holder(f)
        yield
    finally:
        if made and out.is_dir() and {p.name for p in out.iterdir()} == {fmt.LOCK_NAME}:
            shutil.rmtree(out, ignore_errors=True)  # before the unlock: whoever comes next makes it anew
        f.close()


def _same_file(f, path: Path) -> bool:
    try:
        a, b = os.fstat(f.fileno()), path.stat()
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _note_holder(f) -> None:
    """Who holds the lock, for the message another writer gets."""
    with contextlib.suppress(OSError):
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "command": " ".join(sys.argv) or "python", "since": time.time()}))
        f.flush()


def _holder(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text(encoding="utf-8") or "{}")
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def write_atomic(path: Path, text: str) -> None:
    """A small text file (manifest, plan, sidecar) that is either whole or absent: written to a
    temp name (per process: several parts may write the same file), fsynced, renamed."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if exc.filename is None:
            raise OSError(exc.errno, exc.strerror, str(tmp)) from None
        raise
    os.rename(tmp, path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare_generation(out: Path, generation: str) -> Path:
    """The generation dir, with the lock file its readers share."""
    path = out / generation
    path.mkdir(parents=True, exist_ok=True)
    (path / fmt.READERS_LOCK).touch()
    return path


def publish(out: Path, manifest: fmt.Manifest) -> list[str]:
    """Make `manifest` OUT's dataset; returns the old generations kept because a reader still
    has them open (the next publish into OUT tries again)."""
    generation = prepare_generation(out, manifest.generation)
    text = manifest.to_json()
    for shard in manifest.shards:  # the renames of whole shard dirs into the generation, on disk
        if shard.dir.startswith(manifest.generation + "/"):
            fsync_dir(generation)
            break
    write_atomic(generation / fmt.MANIFEST_NAME, text)
    write_atomic(out / fmt.MANIFEST_NAME, text)
    fsync_dir(out)
    shutil.rmtree(staging_dir(out), ignore_errors=True)
    _remove_temps(generation)
    return remove_unused(out, manifest)


def _remove_temps(folder: Path) -> None:
    """Temp files of write_atomic calls killed before their rename."""
    for path in folder.glob(f"{fmt.MANIFEST_NAME}.*.tmp"):
        with contextlib.suppress(OSError):
            path.unlink()


def remove_unused(out: Path, manifest: fmt.Manifest | None) -> list[str]:
    """Every generation dir the manifest does not use and no reader holds, shard dirs of the
    pre-4.0 layout it does not use, and stray temp files."""
    used = manifest.generations | {s.dir.split("/", 1)[0] for s in manifest.shards} if manifest else set()
    kept = []
    for child in out.iterdir():
        if child.name in used:
            continue
        if fmt.is_generation(child.name) and child.is_dir():
            if not _remove_if_unread(child):
                kept.append(child.name)
        elif child.name.startswith("shard-") and child.is_dir():  # the 3.x layout, superseded
            shutil.rmtree(child, ignore_errors=True)
    _remove_temps(out)
    return kept


def _remove_if_unread(generation: Path) -> bool:
    try:
        f = open(generation / fmt.READERS_LOCK, "rb")
    except FileNotFoundError:  # never published (a build abandoned for another): no reader
        shutil.rmtree(generation, ignore_errors=True)
        return True
    with f:
        if not flock(f, block=False):
            return False
        shutil.rmtree(generation, ignore_errors=True)
        return True


def check_out(out: Path, *, append: bool, overwrite: bool, deferred: bool = False) -> None:
    """OUT may be written by this command: missing, empty, holding an unfinished build (its
    staging), or, with --overwrite / --append, a dataset. `deferred`: a dataset in OUT may be
    this very build (a build run again), which the caller tells once it has its fingerprint."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out}: exists and is not a directory")
    if not out.is_dir():
        return
    names = {p.name for p in out.iterdir()} - {fmt.STAGING_DIR, fmt.LOCK_NAME}
    ours = {n for n in names if n == fmt.MANIFEST_NAME or fmt.is_generation(n) or n.startswith("shard-")
            or (n.startswith(fmt.MANIFEST_NAME + ".") and n.endswith(".tmp"))}
    if append:
        if fmt.MANIFEST_NAME not in names:
            raise ConfigError(f"{out}: --append needs an existing dataset dir (no {fmt.MANIFEST_NAME})")
    elif overwrite:
        if names - ours and fmt.MANIFEST_NAME not in names:
            raise ConfigError(f"{out}: not an mmpack dataset dir (holds {sorted(names - ours)[0]!r}); "
                              "refusing to overwrite it")
    elif (fmt.MANIFEST_NAME in names and not deferred) or names - ours:
        raise ConfigError(f"{out}: already exists and is not empty; pass --overwrite to rebuild it "
                          "or --append to add new records")
