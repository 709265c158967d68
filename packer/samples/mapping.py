"""`packer.map(fn, inputs, out, workers=N)`: a user's function over a user's items, its samples
written as a dataset (LitData's `optimize`, ours). `fn(item)` returns a sample dict, a list of
them, or None (a skip); an exception is a skip with its reason. Output order is input order
whatever `workers` is, and the bytes are the same at 1 and 8 workers.

Items are cut into tasks of `chunk` items (not of a worker's share: the cut, and so the shards,
must not depend on the worker count). Task k writes its samples into shards k * PARTS, k *
PARTS + 1, ... (a new one at `shard_size`; gaps between tasks' shard indexes are allowed,
FORMAT.md 5) in the generation the map's fingerprint names, and leaves a sidecar in staging:
a map killed and run again with the same function and items reuses every finished task, as a
build does. The columns are declared, or taken from the first sample in input order (made
here, before any worker starts, so that every worker writes the same columns). Memory: a
sample at a time a worker; a worker's items are pickled to it a task at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from packer.dataset import format as fmt
from packer.dataset import outdir, writer
from packer.dataset.outdir import write_atomic
from packer.errors import ConfigError, MmpackError
from packer.samples import schema
from packer.samples.writer import Writer, declared, writer_key

PARTS = 1000  # shard indexes a task may use
CHUNK = 64  # items a task by default


def run(fn: Callable, inputs: Sequence, out: str | Path, *, workers: int | None = None,
        columns: dict[str, str] | None = None, shard_size: str | int = "256MB", chunk: int = CHUNK,
        overwrite: bool = False, on_progress: Callable[[int, int], None] | None = None) -> fmt.Manifest:
    """See the module. Returns the published manifest."""
    out = Path(out).expanduser()
    items = list(inputs)
    if not items:
        raise ConfigError("packer.map: no inputs")
    if chunk < 1:
        raise ConfigError(f"packer.map: chunk={chunk} must be at least 1")
    fingerprint = _fingerprint(fn, items, columns, shard_size, chunk)
    generation = fmt.generation_name(fingerprint)
    done = _published(out, fingerprint)
    if done is not None:  # this very map, finished: nothing to do
        return done
    specs = declared(columns) if columns is not None else _first_specs(fn, items)
    tasks = [(k, k * chunk, items[k * chunk:(k + 1) * chunk]) for k in range(-(-len(items) // chunk))]
    with Writer(out, overwrite=overwrite, generation=generation,
                build={"map": _name(fn), "inputs": len(items), "chunk": chunk, "fingerprint": fingerprint}) as w:
        w.specs = specs
        ctx = _Context(fn, specs, out, generation, fingerprint, shard_size)
        results = _run_tasks(ctx, tasks, workers, on_progress, len(items))
        for result in results:  # in task order: the dataset's order
            w.shards.extend(result["shards"])
            w.skipped.extend(fmt.Skip(**s) for s in result["skipped"])
        return w.close()


def _published(out: Path, fingerprint: str) -> fmt.Manifest | None:
    from packer.dataset.reader import load_manifest

    if not (out / fmt.MANIFEST_NAME).is_file():
        return None
    try:
        manifest = load_manifest(out)
    except MmpackError:
        return None
    return manifest if manifest.build.get("fingerprint") == fingerprint else None


def _name(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def _fingerprint(fn, items: list, columns, shard_size, chunk: int) -> str:
    """What the bytes depend on: the function (its name and code), every item, the columns, the
    shard size and the chunk. A function changed in place (its code) is another map."""
    digest = hashlib.sha256()
    code = getattr(fn, "__code__", None)
    digest.update(json.dumps([_name(fn), columns, str(shard_size), chunk]).encode())
    if code is not None:
        digest.update(code.co_code + repr(code.co_consts).encode())
    for i, item in enumerate(items):
        try:
            digest.update(pickle.dumps(item, protocol=4))
        except Exception as exc:  # noqa: BLE001 - any object pickle refuses
            raise ConfigError(f"packer.map: input {i} cannot be pickled ({type(exc).__name__}: {exc}); inputs go to "
                              "worker processes: give paths, rows or ids") from None
    return digest.hexdigest()


def _first_specs(fn, items: list) -> dict[str, schema.Spec]:
    """The columns of the first sample fn makes, in input order."""
    for i, item in enumerate(items):
        try:
            samples = _as_samples(fn(item), i)
        except MmpackError:
            raise
        except Exception:  # noqa: BLE001 - a skip: the next item shows the columns
            continue
        for key, sample in samples:
            values = {k: v for k, v in sample.items() if k != "key"}
            if values:
                return {name: schema.infer(name, value) for name, value in values.items()}
    raise ConfigError("packer.map: fn returned no sample for any input (each None or an exception)")


def _as_samples(result, i: int) -> list[tuple[str, dict]]:
    """(key, sample) of what fn returned for input i: a dict, a list of them, or None."""
    if result is None:
        return []
    many = result if isinstance(result, list) else [result]
    out = []
    for j, sample in enumerate(many):
        if not isinstance(sample, dict):
            raise TypeError(f"fn returned a {type(sample).__name__}, not a sample dict (or a list of them, or None)")
        key = sample.get("key", f"{i}" if not isinstance(result, list) else f"{i}:{j}")
        out.append((key, sample))
    return out


class _Context:
    """What every task of one map shares (pickled to workers once per task)."""

    def __init__(self, fn, specs, out: Path, generation: str, fingerprint: str, shard_size):
        self.fn, self.specs, self.out, self.generation = fn, specs, out, generation
        self.fingerprint, self.shard_size = fingerprint, shard_size

    @property
    def staging(self) -> Path:
        return outdir.staging_dir(self.out)


def _run_tasks(ctx: _Context, tasks: list, workers: int | None, on_progress, total: int) -> list[dict]:
    results, todo, done = {}, [], 0
    for task in tasks:
        kept = _reusable(ctx, task[0])
        if kept is not None:
            results[task[0]] = kept
            done += len(task[2])
        else:
            todo.append(task)
    if on_progress:
        on_progress(done, total)
    workers = workers or os.cpu_count() or 1
    for result in _executed(ctx, todo, workers):
        results[result["task"]] = result
        done += result["items"]
        if on_progress:
            on_progress(done, total)
    return [results[k] for k, _, _ in tasks]


def _executed(ctx: _Context, todo: list, workers: int) -> Iterator[dict]:
    """The tasks' results as they finish: here with one worker, else in worker processes."""
    if workers <= 1 or len(todo) <= 1:
        for task in todo:
            yield run_task(ctx, *task)
        return
    from concurrent.futures import ProcessPoolExecutor, as_completed

    import multiprocessing

    from packer.builder.pool import start_method
    from packer.builder.workers import wait_for_old_workers

    from concurrent.futures.process import BrokenProcessPool

    method = start_method(tokenizer=False)
    context = multiprocessing.get_context(method)
    module = getattr(ctx.fn, "__module__", None)
    if method == "forkserver" and module and module != "__main__":
        # the server imports fn's module (and what it imports: torch, a model's code) once and
        # forks each worker from it: a worker starts with them, not importing them again
        context.set_forkserver_preload(["packer._one_blas_thread", "packer.samples.mapping", module])
    running = {}
    wait_for_old_workers(ctx.staging)  # a killed map's workers are gone before this one writes
    try:
        with ProcessPoolExecutor(min(workers, len(todo)), mp_context=context, initializer=_init_worker,
                                 initargs=(os.getpid(), ctx.staging)) as pool:
            running = {pool.submit(run_task, ctx, *task): task for task in todo}
            for future in as_completed(running):
                yield future.result()
    except BrokenProcessPool:
        lost = sorted(t[0] for f, t in running.items() if not f.done() or f.exception() is not None)
        first = next(t for t in todo if t[0] == lost[0]) if lost else todo[0]
        raise MmpackError(f"packer.map: a worker process died (a crash in fn, or the machine out of memory) with "
                          f"task {first[0]} (items {first[1]}..{first[1] + len(first[2]) - 1}) or another unfinished; "
                          "the tasks that finished are kept: run it again to go on, or with workers=1 to see "
                          "which item it is") from None
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        if "pickle" not in str(exc).lower():
            raise
        raise ConfigError(f"packer.map: fn or an item cannot be sent to a worker process ({exc}); with workers > 1 "
                          "give a module-level function (not a lambda or a closure), or run with workers=1") from None


def _init_worker(map_pid: int, staging: Path) -> None:
    """A map's worker dies with the map (a `kill -9` of it leaves no worker writing, nor holding
    its output's pipes), and holds the staging's workers lock while it lives, as a build's do."""
    from packer.builder import workers

    workers.init_worker(None, None, map_pid, staging)


def run_task(ctx: _Context, task: int, first: int, items: list) -> dict:
    """One task: fn over its items, samples into its shards, skips noted; its sidecar last."""
    limit_rows, limit_bytes = _limits(ctx.shard_size)
    shards, skipped, part, shard, rows, nbytes = [], [], 0, None, 0, 0
    try:
        for i, item in enumerate(items, start=first):
            try:
                samples = _as_samples(ctx.fn(item), i)
            except Exception as exc:  # noqa: BLE001 - the item's skip, with its reason
                skipped.append({"key": f"{i}", "stage": "map", "reason": _reason(exc)})
                continue
            if not samples:
                skipped.append({"key": f"{i}", "stage": "map", "reason": "fn returned None"})
            for key, sample in samples:
                converted = _converted(ctx, key, sample, skipped)
                if converted is None:
                    continue
                size = sum(getattr(v, "nbytes", 0) or getattr(getattr(v, "data", None), "nbytes", 0)
                           for v in converted.values())
                if shard is not None and ((limit_rows and rows >= limit_rows) or (limit_bytes and nbytes + size > limit_bytes)):
                    shards.append(shard.close())
                    shard, part = None, part + 1
                if shard is None:
                    shard, rows, nbytes = _shard(ctx, task, part), 0, 0
                shard.add(converted)
                rows, nbytes = rows + 1, nbytes + size
        if shard is not None:
            shards.append(shard.close())
    except BaseException:
        if shard is not None:
            shard.abort()
        raise
    result = {"task": task, "items": len(items), "shards": shards, "skipped": skipped}
    _write_sidecar(ctx, result)
    return result


def _converted(ctx: _Context, key, sample: dict, skipped: list) -> dict | None:
    if not isinstance(key, str):
        skipped.append({"key": str(key), "stage": "map", "reason": f"its key is {type(key).__name__}, not text"})
        return None
    values = {k: v for k, v in sample.items() if k != "key"}
    missing, extra = sorted(set(ctx.specs) - set(values)), sorted(set(values) - set(ctx.specs))
    if missing or extra:  # fn's own shape, not an item's damage: every later sample would be lost to it
        raise ConfigError(f"packer.map: sample {key!r} " + (f"lacks {', '.join(missing)}" if missing else
                          f"has {', '.join(extra)} too") + f"; the columns are {', '.join(ctx.specs)} (the first "
                          "sample's, or columns=): return the same columns from every item, or declare them all")
    try:
        out = {name: schema.convert(spec, values[name], f"sample {key!r}") for name, spec in ctx.specs.items()}
    except ConfigError as exc:
        skipped.append({"key": key, "stage": "map", "reason": str(exc)})
        return None
    return {**out, "key": writer_key(key)}


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _limits(shard_size) -> tuple[int | None, int | None]:
    from packer.builder.config import parse_shard_size

    return parse_shard_size(str(shard_size))


def _shard(ctx: _Context, task: int, part: int) -> writer.ShardWriter:
    if part >= PARTS:
        raise ConfigError(f"packer.map: task {task} wrote {PARTS} shards; pass a smaller chunk or a larger shard_size")
    index = task * PARTS + part
    if index >= 10**9:
        raise ConfigError("packer.map: over a million tasks; pass a larger chunk")
    rel = fmt.shard_path(ctx.generation, index)
    return writer.ShardWriter(ctx.staging, index, _columns(ctx.specs), final_dir=ctx.out / rel, rel_dir=rel)


def _columns(specs: dict) -> tuple[fmt.Column, ...]:
    return (*(s.column() for s in specs.values()), fmt.Column("key", "|u1", (None,), encoding="utf-8"))


def _sidecar(ctx: _Context, task: int) -> Path:
    return ctx.staging / f"task-{task:06d}.json"


def _write_sidecar(ctx: _Context, result: dict) -> None:
    doc = {"fingerprint": ctx.fingerprint, "task": result["task"], "items": result["items"],
           "skipped": result["skipped"],
           "shards": [{"index": s.index, "num_samples": s.num_samples, "files": [f.to_json() for f in s.files]}
                      for s in result["shards"]]}
    write_atomic(_sidecar(ctx, result["task"]), json.dumps(doc))


def _reusable(ctx: _Context, task: int) -> dict | None:
    """A finished task of this very map, whole on disk (sizes and checksums), or None."""
    try:
        doc = json.loads(_sidecar(ctx, task).read_text())
        if doc["fingerprint"] != ctx.fingerprint:
            return None
        shards = [fmt.Shard(s["index"], s["num_samples"], tuple(
            fmt.FileEntry(f["path"], f["size_bytes"], f["checksum"]["hex"], f["checksum"]["algo"]) for f in s["files"]))
            for s in doc["shards"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for shard in shards:
        for entry in shard.files:
            path = ctx.out / entry.path
            try:
                if path.stat().st_size != entry.size_bytes or writer.checksum_file(path, entry.algo) != entry.checksum:
                    return None
            except OSError:
                return None
    return {"task": task, "items": doc["items"], "shards": shards, "skipped": doc["skipped"]}

