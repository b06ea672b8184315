"""``zerostall``: list, inspect, verify, export and import checkpoints from the shell.

    zerostall list DIR          committed steps / checkpoints under DIR (and memory-only steps held here)
    zerostall inspect PATH      a checkpoint's manifest: items, leaves, dtypes, shapes, sizes, Python values, ranks
    zerostall verify PATH       read every leaf, check every checksum, name every bad key (a run DIR: every
                                step, or --latest)
    zerostall export CKPT OUT   write a .safetensors (flat keys) or torch.save file, or with --hf a Hugging Face
                                save_pretrained directory (see zerostall.interop)
    zerostall import SRC DST    save a torch.save file or a DCP checkpoint directory as a zerostall checkpoint
    zerostall gc DIR            remove partial saves whose writers are provably gone (any host)
    zerostall rm PATH...        delete committed checkpoints (a step directory, or DIR --step N)
    zerostall --version         the installed version (also: python -m zerostall ...)

Each takes ``--json`` (one JSON document on stdout, errors included). Exit status: 0 when all is
well, 1 on any failure (a bad checksum, a missing file, a malformed manifest, an I/O error), 2
on a usage error. Failures print one line, never a traceback (``ZEROSTALL_DEBUG=1`` shows it).

``list``, ``inspect`` and ``verify`` only read: they start no writer and import no torch. They use
the read side of the library (manifest parsing, storage, :func:`~zerostall.restore.verify_checkpoint`)
rather than ``load_pytree``, because they must report on checkpoints they cannot or need not
materialize. ``export`` and ``import`` call :mod:`zerostall.interop`. ``verify``, ``export`` and
``import`` draw a progress line on stderr when it is a terminal and the command lasts over a
second (never under ``--json``; see :mod:`zerostall.progress`).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import errno
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any, NoReturn

from zerostall import envvars
from zerostall._version import __version__
from zerostall.commit import committed_steps, delete_checkpoint, parse_step, step_name
from zerostall.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    InvalidArgumentError,
    StorageError,
    UnsupportedFormatError,
    ZerostallError,
)
from zerostall.format.layout import DATA_DIR, DEL_MARK, MANIFEST_NAME, TMP_MARK
from zerostall.memtier.keeperfail import as_error, local_marker, marker_key, read_markers
from zerostall.memtier.spec import held_steps
from zerostall.persist.gc import collect_garbage
from zerostall.progress import Progress
from zerostall.restore import read_manifest, verify_checkpoint
from zerostall.storage import Storage, local_path, open_storage, split_url

__all__ = ["main"]


# -- commands ----------------------------------------------------------------------------------


def _run_dir(arg: str) -> Storage:
    """The storage of a run directory given on the command line.

    Storage lists a missing prefix as empty (as object stores do); a local path that does not
    exist, or is not a directory, is a typo worth an error.
    """
    url = _url(arg)
    local = local_path(url)
    if local is not None and not os.path.isdir(local):
        there = os.path.exists(local)
        raise StorageError("not a directory" if there else "no such directory",
                           errno=errno.ENOTDIR if there else errno.ENOENT, path=arg)
    return open_storage(url)


def cmd_list(args: argparse.Namespace) -> dict[str, Any]:
    storage = _run_dir(args.dir)
    names = storage.list("")
    unreadable: list[int] = []
    steps = set(committed_steps(storage, unreadable=unreadable))
    rows = []
    unfinished = []
    blocked: list[str] = []
    for n in names:
        if TMP_MARK in n or DEL_MARK in n:
            unfinished.append(n)
            continue
        if parse_step(n) in unreadable:  # its manifest may exist: not PARTIAL, but not readable either
            rows.append({"name": n, "step": parse_step(n), "ok": False,
                         "error": _unreadable_step(storage, n)})
            continue
        if not storage.exists(f"{n}/{MANIFEST_NAME}"):
            if parse_step(n) is not None:
                blocked.append(n)  # a step folder without a manifest: in flight, crashed, or in the way
            continue
        step = parse_step(n)
        row: dict[str, Any] = {"name": n, "step": step if step in steps else None}
        try:
            m = read_manifest(storage, n, path=f"{storage.url}/{n}")
            row.update(nbytes=sum(f.size for f in m.files), leaves=len(m.leaves),
                       created=_iso(m.created_unix), ok=True)
        except ZerostallError as exc:
            row.update(ok=False, error=str(exc))
        rows.append(row)
    # The memory tier: steps a keeper on this host holds that storage does not (yet) have.
    # A held step that reached storage once and is gone from it now was removed by retention.
    memory_only = [{"name": step_name(img.step), "step": img.step, "rank": rank, "persisted": img.persisted}
                   for rank, img in held_steps(storage.url)
                   if img.step is not None and img.step not in steps]
    # Failed persists of keepers that no trainer adopted (reported, and removed, by the next
    # Checkpointer of that directory and rank: docs/guarantees.md, "When the keeper's persist fails").
    keeper_failed = [{"step": f.step, "rank": f.rank, "path": f.path, "error": str(as_error(f).cause),
                      "marker": _marker_file(storage, f.rank)}
                     for f in read_markers(storage, storage.url)]
    is_checkpoint = storage.exists(MANIFEST_NAME)
    return {"dir": storage.url, "checkpoints": rows, "latest_step": max(steps) if steps else None,
            "unfinished": unfinished, "partial": blocked, "ok": all(r["ok"] for r in rows),
            "memory_only": memory_only, "is_checkpoint": is_checkpoint,
            "keeper_failed": keeper_failed,
            "runs_below": _runs_below(storage, names) if not rows and not blocked and not is_checkpoint else []}


def _runs_below(storage: Storage, names: list[str]) -> list[dict[str, Any]]:
    """Subdirectories that hold committed steps themselves (a Lightning ModelCheckpoint dirpath holds
    ``epoch=3-step=40.ckpt/step_00000001``): "no committed checkpoints" alone would not say where to look."""
    out: list[dict[str, Any]] = []
    for n in names[:_RUNS_BELOW_LOOKED_AT]:
        if parse_step(n) is not None or TMP_MARK in n or DEL_MARK in n or n.startswith("."):
            continue
        try:
            steps = committed_steps(open_storage(f"{storage.url.rstrip('/')}/{n}"))
        except (OSError, ZerostallError):
            continue
        if steps:
            out.append({"name": n, "steps": len(steps), "latest_step": steps[-1]})
    return out


#: how many entries of a directory without checkpoints `zerostall list` looks into for runs below it
_RUNS_BELOW_LOOKED_AT = 64


def _unreadable_step(storage: Storage, name: str) -> str:
    """Why a step folder's manifest could not even be checked (permission denied, say)."""
    try:
        storage.exists(f"{name}/{MANIFEST_NAME}")
    except OSError as exc:
        return (f"[{errno.errorcode.get(exc.errno or 0, exc.errno)}] cannot check its {MANIFEST_NAME}: "
                f"{exc.strerror or exc} (fix the permissions, or run as the user who saved it)")
    return "unreadable"


def _marker_file(storage: Storage, rank: int) -> str:
    """Where a keeper failure of ``rank`` is recorded: beside the checkpoints, else this host's fallback."""
    try:
        if storage.exists(marker_key(rank)):
            return f"{storage.url.rstrip('/')}/{marker_key(rank)}"
    except OSError:
        pass
    return local_marker(storage.url, rank)


def _hint_run_directory(url: str, exc: CheckpointNotFoundError) -> CheckpointNotFoundError:
    """Given a Checkpointer's directory instead of one step, say which steps it holds."""
    try:
        steps = committed_steps(open_storage(url))
    except Exception:  # noqa: BLE001 - only a hint: the original error is what the user gets
        return exc
    if not steps:
        return _hint_missing_path(url, exc)
    return CheckpointNotFoundError(
        f"{exc.message}; this is a directory of {len(steps)} committed step(s): pass one, e.g. "
        f"{url.rstrip('/')}/{step_name(steps[-1])} (zerostall list shows them all)", path=exc.path)


def cmd_inspect(args: argparse.Namespace) -> dict[str, Any]:
    root, name = split_url(_url(args.path))
    storage = open_storage(root)
    path = f"{root.rstrip('/')}/{name}"
    try:
        m = read_manifest(storage, name, path=path)
    except CheckpointNotFoundError as exc:
        raise _hint_run_directory(_url(args.path), exc) from exc
    leaves: list[dict[str, Any]] = [
        {"key": lf.key, "kind": lf.kind, "dtype": lf.dtype, "shape": list(lf.shape), "nbytes": lf.nbytes,
         "file": m.files[lf.file].path, "offset": lf.offset, "crc32c": lf.crc32c} for lf in m.leaves]
    ranks = _leaf_ranks(m.ranks, len(m.leaves))
    for row, rk in zip(leaves, ranks, strict=True):
        row["ranks"] = rk
    shards = _leaf_shards(m.items, m.ranks)
    for i, row in enumerate(leaves):
        row["shard"] = shards.get(i)
        if i in shards and m.ranks:
            # Every rank's sharded node lists every saved box (for resharding), so the trees say
            # nothing of who holds one: name the rank that saved it (its data file is that rank's).
            row["ranks"] = [m.leaves[i].file]
    by_dtype: Counter[str] = Counter()
    for lf in m.leaves:
        by_dtype[lf.dtype] += lf.nbytes
    return {
        "path": path,
        "format_version": m.format_version,
        "library_version": m.library_version,
        "created": _iso(m.created_unix),
        "metadata": m.metadata,
        "items": {k: _summarize(v) for k, v in m.items.items()},
        "files": [{"path": f.path, "size": f.size} for f in m.files],
        "leaves": leaves,
        "values": _values_by_rank(m.items, m.ranks),
        "saving_ranks": len(m.ranks) or None,
        "totals": {"leaves": len(m.leaves), "nbytes": sum(lf.nbytes for lf in m.leaves),
                   "file_bytes": sum(f.size for f in m.files), "by_dtype": dict(sorted(by_dtype.items()))},
    }


def cmd_verify(args: argparse.Namespace) -> dict[str, Any]:
    url = _url(args.path)
    steps = _run_steps(url)
    if steps or args.latest:
        return _verify_run(args, url, steps)
    try:
        with _progress(args, f"verify {args.path}") as progress:
            report = verify_checkpoint(url, progress=progress)
    except CheckpointNotFoundError as exc:
        raise _hint_missing_path(url, exc) from exc
    return _report_doc(report)


def _report_doc(report: Any) -> dict[str, Any]:
    return {
        "path": report.path,
        "ok": report.ok,
        "leaves": report.leaves,
        "nbytes_checked": report.nbytes,
        "bad_keys": report.bad_keys,
        "problems": [{"kind": p.kind, "key": p.key, "file": p.file, "message": p.message} for p in report.problems],
    }


def cmd_export(args: argparse.Namespace) -> dict[str, Any]:
    if args.hf:
        if args.format not in (None, "hf"):
            raise InvalidArgumentError(f"--hf writes a save_pretrained directory; it cannot be combined with "
                                       f"--format {args.format}", argument="--hf")
        args.format = "hf"
    _check_export_suffix(args)
    from zerostall.interop import export_checkpoint  # the save and load API: only export and import load it

    try:
        with _progress(args, f"export {args.out}") as progress:
            report = export_checkpoint(_url(args.checkpoint), args.out, format=args.format, item=args.item,
                                       overwrite=args.force, progress=progress,
                                       max_shard_bytes=_shard_size(args.max_shard_size))
    except CheckpointNotFoundError as exc:
        raise _hint_run_directory(_url(args.checkpoint), exc) from exc
    except UnsupportedFormatError as exc:
        if not exc.message.startswith("no handler named"):
            raise
        # "register it ... before loading" cannot be done from the command line: say what can
        raise UnsupportedFormatError(
            f"{exc.message}; the command line registers no handlers: export to a .safetensors file (custom "
            "leaves stay encoded there), or call zerostall.interop.export_checkpoint from Python after "
            "registering the handler", path=exc.path, key=exc.key) from exc
    return dataclasses.asdict(report)


def cmd_import(args: argparse.Namespace) -> dict[str, Any]:
    from zerostall.interop import import_checkpoint  # the save and load API: only export and import load it

    try:
        with _progress(args, f"import {args.src}") as progress:
            report = import_checkpoint(args.src, _url(args.dst), format=args.format, progress=progress)
    except CheckpointExistsError as exc:
        raise CheckpointExistsError(f"{exc.message}: pick another DST, or delete it first (zerostall rm DST)",
                                    path=exc.path) from exc
    return dataclasses.asdict(report)


def cmd_gc(args: argparse.Namespace) -> dict[str, Any]:
    report = collect_garbage(_run_dir(args.dir), dry_run=args.dry_run)
    return dict(dataclasses.asdict(report), ok=not report.errors)


def _print_gc(r: dict[str, Any]) -> None:
    verb = "would remove" if r["dry_run"] else "removed"
    for n in r["removed"]:
        _out(f"{verb} {n}")
    for n in r["uploads_aborted"]:
        _out(f"{'would abort' if r['dry_run'] else 'aborted'} multipart upload {n}")
    for n in r["kept_live"]:
        _out(f"kept {n} (a live writer holds it)")
    for e in r["errors"]:
        _out(f"FAILED {e}")
    _out(f"{r['url']}: {len(r['removed'])} partial(s) {verb}, {len(r['uploads_aborted'])} upload(s), "
         f"{len(r['leases_removed'])} dead lease(s); {len(r['live_leases'])} live writer lease(s) untouched")


def _progress(args: argparse.Namespace, label: str) -> Progress:
    """A progress line on stderr: only on a terminal (Progress checks), never under --json."""
    return Progress(label, enabled=False if args.json else None)


# -- text output -----------------------------------------------------------------------------


def _print_list(r: dict[str, Any]) -> None:
    if not r["checkpoints"]:
        _out(f"no committed checkpoints in {r['dir']}")
    if r.get("is_checkpoint"):
        _out(f"({r['dir']} is itself a checkpoint: zerostall inspect or zerostall verify shows it; "
             "zerostall list takes the directory that holds checkpoints)")
    if r.get("runs_below"):
        below = ", ".join(f"{b['name']} ({b['steps']} step(s))" for b in r["runs_below"])
        _out(f"(these subdirectories hold committed checkpoints: {below}; "
             f"zerostall list {r['dir'].rstrip('/')}/NAME lists one)")
    for row in r["checkpoints"]:
        if row["ok"]:
            _out(f"{row['name']:<24} {_size(row['nbytes']):>10} {row['leaves']:>7} leaves  {row['created'] or ''}")
        else:
            _out(f"{row['name']:<24} UNREADABLE: {row['error']}")
    for row in r.get("memory_only", ()):
        if row.get("persisted"):
            _out(f"{row['name']:<24} held in memory by the memory tier's keeper of rank {row['rank']} on this host; "
                 "it was persisted, and storage no longer has it (retention removed it)")
        else:
            _out(f"{row['name']:<24} in memory only (the memory tier's keeper of rank {row['rank']} on this host)")
    for row in r.get("keeper_failed", ()):
        _out(f"KEEPER PERSIST FAILED: step {row['step']} (rank {row['rank']}) never reached storage: {row['error']}")
    for marker in sorted({row["marker"] for row in r.get("keeper_failed", ()) if row.get("marker")}):
        # Whoever has read the failure wants it gone: say what clears it.
        _out(f"(recorded in {marker}: the next Checkpointer with a memory tier for this directory and rank "
             "reports it and removes the file; or delete it once read. Storage itself is consistent)")
    if r["unfinished"]:
        _out(f"({len(r['unfinished'])} unfinished or deleted attempt(s), never loaded: "
              f"{', '.join(r['unfinished'])})")
    for n in r.get("partial", []):
        _out(f"{n:<24} PARTIAL: no manifest (in flight, crashed, or not a checkpoint): never loaded; "
             "it blocks a save of this step")


def _print_inspect(r: dict[str, Any]) -> None:
    t = r["totals"]
    _out(f"checkpoint     {r['path']}")
    _out(f"format         zerostall v{r['format_version']} (written by zerostall {r['library_version'] or '?'})")
    _out(f"created        {r['created'] or '?'}")
    _out(f"size           {_size(t['file_bytes'])} in {len(r['files'])} file(s); "
          f"{t['leaves']} leaves, {_size(t['nbytes'])} of array data")
    _out("by dtype       " + ", ".join(f"{d} {_size(n)}" for d, n in t["by_dtype"].items()))
    if r["metadata"]:
        _out(f"metadata       {json.dumps(r['metadata'])[:200]}")
    for name, summary in r["items"].items():
        _out(f"item {name!r}: {summary}")
    per_rank = r.get("saving_ranks") is not None
    if r["leaves"]:
        width = min(60, max(len(lf["key"]) for lf in r["leaves"]))
        rank_head = f" {'ranks':<8}" if per_rank else ""
        _out(f"  {'key':<{width}} {'dtype':<8} {'shape':<18} {'size':>10}{rank_head}")
        for lf in r["leaves"]:
            shape = "x".join(map(str, lf["shape"])) or "()"
            if lf.get("shard"):  # one box of a sharded (DTensor / jax) array: where it lies, in what
                sh = lf["shard"]
                shape += f" @{','.join(map(str, sh['offset']))} of {'x'.join(map(str, sh['global'])) or '()'}"
            rank_col = f" {_rank_label(lf.get('ranks'), r['saving_ranks']):<8}" if per_rank else ""
            _out(f"  {lf['key']:<{width}} {lf['dtype']:<8} {shape:<18} {_size(lf['nbytes']):>10}{rank_col}")
    _print_values(r.get("values", []), r.get("saving_ranks"))


def _print_verify(r: dict[str, Any]) -> None:
    if "steps" in r:
        _print_verify_run(r)
        return
    if r["ok"]:
        _out(f"OK {r['path']}: {r['leaves']} leaves, {_size(r['nbytes_checked'])} checked")
        return
    for p in r["problems"]:
        where = p["key"] or p["file"] or ""
        _out(f"BAD {where}: {p['message']}")
    _out(f"FAILED {r['path']}: {len(r['problems'])} problem(s), {len(r['bad_keys'])} bad key(s)"
          + (f": {', '.join(r['bad_keys'])}" if r["bad_keys"] else ""))


def _print_export(r: dict[str, Any]) -> None:
    _out(f"exported {r['source']} to {r['path']} ({r['format']}): {r['tensors']} tensors, "
         f"{_size(r['nbytes'])}, {r['values']} other values")


def _print_import(r: dict[str, Any]) -> None:
    _out(f"imported {r['source']} ({r['format']}) to {r['path']}: {r['tensors']} tensors, {_size(r['nbytes'])}")


# -- helpers ---------------------------------------------------------------------------------


def _out(line: str, file: Any = None) -> None:
    """Print one line of text output with control characters escaped: keys, names and messages
    come from the checkpoint, and a hostile one could otherwise drive the terminal (ANSI escapes)."""
    print(_printable(line), file=file)


def _printable(text: str) -> str:
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)



def _url(p: str) -> str:
    return local_path(p) or p


def _iso(t: float | None) -> str | None:
    if t is None:
        return None
    try:
        return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")
    except (OverflowError, OSError, ValueError):
        return None


def _size(n: int) -> str:
    f = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if f < 1024 or unit == "TiB":
            return f"{int(f)} {unit}" if unit == "B" else f"{f:.1f} {unit}"
        f /= 1024
    return str(n)  # pragma: no cover


def _summarize(node: dict[str, Any]) -> str:
    """A one-line description of an item's tree (containers and scalar counts)."""
    counts: Counter[str] = Counter()
    stack = [node]
    while stack:
        n = stack.pop()
        t = n.get("type")
        counts[str(t)] += 1
        if t in ("dict", "list", "tuple", "namedtuple"):
            stack.extend(v for v in n.get("values", []) if isinstance(v, dict))
    top = node.get("type")
    parts = [f"{c} {t}" for t, c in sorted(counts.items())]
    return f"{top}; nodes: {', '.join(parts)}"


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="zerostall", description="List, inspect, verify, export and import zerostall checkpoints.")
    p.add_argument("--version", action="version", version=f"zerostall {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for name, helptext, arg in (
        ("list", "list the committed checkpoints in a directory", "dir"),
        ("inspect", "summarize a checkpoint's manifest", "path"),
        ("verify", "read every leaf and check every checksum", "path"),
    ):
        sp = sub.add_parser(name, help=helptext)
        sp.add_argument(arg)
        sp.add_argument("--json", action="store_true", help="print one JSON document")
    _add_interop_parsers(sub)
    _add_ops_parsers(sub)
    gc = sub.add_parser("gc", help="remove partial saves whose writers are provably gone (expired lease, or dead "
                                   "on this host)")
    gc.add_argument("dir")
    gc.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    gc.add_argument("--json", action="store_true", help="print one JSON document")
    return p


def _add_interop_parsers(sub: Any) -> None:
    ex = sub.add_parser("export", help="write a checkpoint as a .safetensors or torch.save file, or a Hugging Face "
                                       "save_pretrained directory (--hf)")
    ex.add_argument("checkpoint")
    ex.add_argument("out", help="the file to write (.safetensors, .pt), or the directory (--hf)")
    ex.add_argument("--format", choices=("safetensors", "torch", "hf"), help="default: from OUT's suffix")
    ex.add_argument("--hf", action="store_true",
                    help="write OUT as a save_pretrained directory (config.json, model.safetensors or shards with "
                         "an index) from the items 'model' and 'hf_config' (same as --format hf)")
    ex.add_argument("--max-shard-size", default="5GB",
                    help="--hf: split the weights into shards of at most this size (bytes, or 500MB, 5GB, 2GiB)")
    ex.add_argument("--item", help="export this item only (default: all; --hf: the model's item, default 'model')")
    ex.add_argument("--force", action="store_true", help="replace OUT if it exists")
    im = sub.add_parser("import", help="save a torch.save or safetensors file, or a DCP checkpoint, as a zerostall checkpoint")
    im.add_argument("src", help="a torch.save file (read weights_only), a .safetensors file, or a DCP directory (trusted only)")
    im.add_argument("dst", help="the checkpoint to create")
    im.add_argument("--format", choices=("torch", "safetensors", "dcp"),
                    help="default: dcp for a directory, safetensors for *.safetensors, else torch")
    for sp in (ex, im):
        sp.add_argument("--json", action="store_true", help="print one JSON document")


_COMMANDS = {"list": (cmd_list, _print_list), "inspect": (cmd_inspect, _print_inspect),
             "verify": (cmd_verify, _print_verify), "export": (cmd_export, _print_export),
             "import": (cmd_import, _print_import), "gc": (cmd_gc, _print_gc)}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    run, show = _COMMANDS[args.command]
    try:
        result = run(args)
    except Exception as exc:  # every failure is one line (or one JSON document), never a traceback
        if envvars.get(envvars.DEBUG):
            raise
        exc = _as_zerostall_error(exc, args)
        exc = _hint_file_given(exc, args)
        if args.json:
            print(json.dumps({"ok": False, "error": _error_doc(exc)}))
        else:
            _out(f"zerostall {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    try:
        if args.json:
            print(json.dumps(result, indent=1, default=str))
        else:
            show(result)
        sys.stdout.flush()
    except BrokenPipeError:  # `zerostall inspect ... | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0 if result.get("ok", True) else 1


def _error_doc(exc: BaseException) -> dict[str, Any]:
    doc: dict[str, Any] = {"class": type(exc).__name__, "message": _one_line(exc)}
    if isinstance(exc, ZerostallError):
        doc.update(path=exc.path, key=exc.key)
        if isinstance(exc, StorageError):
            doc["errno"] = exc.errno
    return doc


def _one_line(exc: BaseException) -> str:
    text = str(exc) if isinstance(exc, ZerostallError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:1000]



# -- operations: verify a run, rm, inspect's values and ranks ----------------------------------


def _add_ops_parsers(sub: Any) -> None:
    verify = sub.choices["verify"]
    verify.add_argument("--latest", action="store_true",
                        help="PATH is a run directory: verify only its newest committed step (default: every step)")
    rm = sub.add_parser("rm", help="delete committed checkpoints (made invisible first, then removed)")
    rm.add_argument("paths", nargs="+", metavar="PATH", help="a checkpoint (a step directory), or a run directory "
                                                                 "with --step")
    rm.add_argument("--step", type=_step_arg, action="append", help="with a run DIR: delete this step (repeatable)")
    rm.add_argument("--json", action="store_true", help="print one JSON document")


def _step_arg(text: str) -> int:
    try:
        step = int(text)
    except ValueError:
        step = -1
    if step < 0:
        raise argparse.ArgumentTypeError(f"a step is a non-negative integer, got {text!r}")
    return step


def _run_steps(url: str) -> list[int]:
    """The committed steps under ``url`` if it is a run directory; [] if it is anything else."""
    try:
        storage = open_storage(url)
        if storage.exists(MANIFEST_NAME):
            return []  # a checkpoint itself
        unreadable: list[int] = []
        # a step folder we may not read is verified too: it fails there, naming why
        return sorted(committed_steps(storage, unreadable=unreadable) + unreadable)
    except (OSError, ZerostallError):
        return []  # not a run directory: the single-checkpoint path reports the real error


def _verify_run(args: argparse.Namespace, url: str, steps: list[int]) -> dict[str, Any]:
    if not steps:
        raise CheckpointNotFoundError("no committed step under this directory (--latest takes a run directory)",
                                      path=args.path)
    chosen = steps[-1:] if args.latest else steps
    docs: list[dict[str, Any]] = []
    for s in chosen:
        path = f"{url.rstrip('/')}/{step_name(s)}"
        try:
            with _progress(args, f"verify {step_name(s)} ({len(docs) + 1}/{len(chosen)})") as progress:
                doc = _report_doc(verify_checkpoint(path, progress=progress))
        except ZerostallError as exc:  # an unreadable manifest fails that step, not the whole run
            doc = {"path": path, "ok": False, "leaves": 0, "nbytes_checked": 0, "bad_keys": [],
                   "problems": [{"kind": "manifest", "key": None, "file": MANIFEST_NAME, "message": _one_line(exc)}]}
        docs.append(dict(doc, step=s))
    return {"path": url, "ok": all(d["ok"] for d in docs), "steps": docs}


def _print_verify_run(r: dict[str, Any]) -> None:
    for d in r["steps"]:
        _print_verify(d)
    bad = [d["step"] for d in r["steps"] if not d["ok"]]
    _out(f"{'OK' if not bad else 'FAILED'} {r['path']}: {len(r['steps'])} step(s) verified"
         + (f", {len(bad)} bad: {', '.join(map(str, bad))}" if bad else ""))


def cmd_rm(args: argparse.Namespace) -> dict[str, Any]:
    targets: list[str] = []
    if args.step:
        if len(args.paths) != 1:
            raise _usage("--step takes exactly one run directory")
        base = _url(args.paths[0]).rstrip("/")
        targets = [f"{base}/{step_name(s)}" for s in args.step]
    else:
        targets = [_url(p) for p in args.paths]
    removed = []
    for path in targets:  # every target checked first: `rm A B` with B mistyped removed A, said nothing of it
        root, name = split_url(path)
        if not open_storage(root).exists(f"{name}/{MANIFEST_NAME}"):
            hinted = _hint_run_directory(path, CheckpointNotFoundError(
                "no committed checkpoint to delete (no manifest)", path=path))
            raise CheckpointNotFoundError(f"{hinted.message}; nothing was deleted", path=path)
    for path in targets:
        root, name = split_url(path)
        storage = open_storage(root)
        if not storage.exists(f"{name}/{MANIFEST_NAME}"):
            exc = CheckpointNotFoundError("no committed checkpoint to delete (no manifest)", path=path)
            raise _hint_run_directory(path, exc)
        try:
            delete_checkpoint(storage, name)
        except OSError as exc:
            raise StorageError(f"cannot delete: {exc.strerror or exc}", errno=exc.errno, path=path) from exc
        removed.append(path)
    return {"removed": removed, "ok": True}


def _print_rm(r: dict[str, Any]) -> None:
    for p in r["removed"]:
        _out(f"removed {p}")


_COMMANDS["rm"] = (cmd_rm, _print_rm)


def _usage(message: str) -> InvalidArgumentError:
    return InvalidArgumentError(message, argument="rm")


def _leaf_shards(items: dict[str, Any], rank_trees: tuple[dict[str, Any], ...]) -> dict[int, dict[str, Any]]:
    """For each leaf that is one box of a ``sharded`` node: its offset and the global shape.

    Without it, ``inspect`` of an FSDP2 checkpoint listed ``0.weight 19x13`` and ``0.weight 18x13``
    with nothing saying they are the two halves of one 37x13 tensor.
    """
    out: dict[int, dict[str, Any]] = {}
    stack: list[Any] = list(items.values())
    for tree in rank_trees:
        stack.extend(tree.values())
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if node.get("type") == "sharded":
            for sh in node.get("shards") or []:
                if isinstance(sh, dict) and type(sh.get("leaf")) is int:
                    out[sh["leaf"]] = {"offset": list(sh.get("offset") or []), "global": list(node.get("shape") or [])}
        stack.extend(node.get("values") or [])
    return out


def _leaf_ranks(rank_trees: tuple[dict[str, Any], ...], n_leaves: int) -> list[list[int] | None]:
    """For a collective save, which saving ranks' trees use each leaf (None for a one-process save)."""
    if not rank_trees:
        return [None] * n_leaves
    out: list[list[int] | None] = [[] for _ in range(n_leaves)]
    for r, items in enumerate(rank_trees):
        stack: list[Any] = list(items.values())
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                li = node.get("leaf")
                if type(li) is int and 0 <= li < n_leaves:
                    users = out[li]
                    assert users is not None
                    if not users or users[-1] != r:
                        users.append(r)
                stack.extend(node.get("values") or [])
                stack.extend(node.get("shards") or [])
    return out


def _rank_label(ranks: list[int] | None, saving: int | None) -> str:
    if ranks is None:
        return ""
    if saving is not None and len(ranks) == saving and saving > 1:
        return "all"
    return ",".join(map(str, ranks)) or "-"


def _values(items: dict[str, Any]) -> list[dict[str, Any]]:
    """The Python values (not arrays) of each item's tree, by key, in tree order."""
    out: list[dict[str, Any]] = []
    stack: list[tuple[str, Any]] = [(name, node) for name, node in reversed(list(items.items()))]
    while stack:
        key, node = stack.pop()
        if not isinstance(node, dict):
            continue
        t = node.get("type")
        if t in ("dict", "list", "tuple", "namedtuple"):
            vals = node.get("values") or []
            labels = node.get("keys") if t == "dict" else node.get("fields") if t == "namedtuple" else None
            labels = labels if isinstance(labels, list) and len(labels) == len(vals) else list(range(len(vals)))
            stack.extend((f"{key}/{k}", v) for k, v in reversed(list(zip(labels, vals, strict=True))))
        elif t in ("none", "bool", "int", "str"):
            out.append({"key": key, "type": t, "value": node.get("value")})
        elif t == "float":
            try:
                value: Any = float.fromhex(str(node.get("value")))
            except (ValueError, OverflowError):
                value = node.get("value")
            out.append({"key": key, "type": t, "value": value})
        elif t == "custom" and "json" in node:
            out.append({"key": key, "type": f"custom:{node.get('handler')}", "value": node.get("json")})
    return out


def _values_by_rank(items: dict[str, Any], rank_trees: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """:func:`_values`; for a collective save, per key: one row if every rank saved the same value
    (``ranks`` all of them), else one row per rank (per-rank state: seeds, data positions)."""
    if not rank_trees:
        return _values(items)
    by_key: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for r, tree in enumerate(rank_trees):
        for row in _values(tree):
            by_key.setdefault(row["key"], []).append((r, row))
    out: list[dict[str, Any]] = []
    for rows in by_key.values():
        first = rows[0][1]
        if len(rows) == len(rank_trees) and all(row["type"] == first["type"] and row["value"] == first["value"]
                                                 for _, row in rows):
            out.append(dict(first, ranks=[r for r, _ in rows]))
        else:
            out.extend(dict(row, ranks=[r]) for r, row in rows)
    return out


_MAX_VALUES_SHOWN = 200


def _print_values(values: list[dict[str, Any]], saving: int | None = None) -> None:
    if not values:
        return
    _out(f"values ({len(values)}, not arrays):")
    width = min(60, max(len(v["key"]) for v in values))
    for v in values[:_MAX_VALUES_SHOWN]:
        text = repr(v["value"]) if v["type"] != "none" else "None"
        where = f"  (rank {_rank_label(v['ranks'], saving)})" if "ranks" in v else ""
        _out(f"  {v['key']:<{width}} = {text[:200]}{where}")
    if len(values) > _MAX_VALUES_SHOWN:
        _out(f"  ... {len(values) - _MAX_VALUES_SHOWN} more (--json lists them all)")


# -- common mistakes, answered with what to do ---------------------------------------------------


def _hint_missing_path(url: str, exc: CheckpointNotFoundError) -> CheckpointNotFoundError:
    """A local path that does not exist says so (not only "no manifest"), and a step name that is
    not committed (a typo, a deleted step) is answered with the steps its run directory holds."""
    local = local_path(url)
    if local is None or os.path.exists(local):
        return exc
    parent = os.path.dirname(local)
    try:
        steps = committed_steps(open_storage(parent)) if os.path.isdir(parent) else []
    except Exception:  # noqa: BLE001 - only a hint: the original error is what the user gets
        steps = []
    if steps:
        shown = ", ".join(step_name(s) for s in steps[-5:])
        return CheckpointNotFoundError(f"{exc.message}: no such file or directory; {parent} holds {len(steps)} "
                                       f"committed step(s): {shown} (zerostall list {parent} shows them all)",
                                       path=exc.path)
    return CheckpointNotFoundError(f"{exc.message}: no such file or directory (pass a checkpoint: the directory "
                                   "holding manifest.json; zerostall list DIR shows those in DIR)", path=exc.path)


def _hint_file_given(exc: Exception, args: argparse.Namespace) -> Exception:
    """A file given where a checkpoint directory goes (``zerostall inspect
    model.pt``, ``zerostall verify CKPT/data/rank-00000.safetensors``) says what it is and what to
    pass, instead of only "[ENOTDIR] cannot stat the manifest manifest.json: Not a directory"."""
    given = getattr(args, "path", None) or getattr(args, "checkpoint", None)
    if not isinstance(exc, StorageError) or exc.errno != errno.ENOTDIR or not isinstance(given, str):
        return exc
    local = local_path(_url(given))
    if local is None or not os.path.isfile(local):
        return exc
    folder = os.path.dirname(os.path.abspath(local))
    ckpt = os.path.dirname(folder)
    if os.path.basename(folder) == DATA_DIR and os.path.isfile(os.path.join(ckpt, MANIFEST_NAME)):
        what = f"it is a data file of the checkpoint {ckpt}: pass that directory"
    else:
        what = (f"a checkpoint is a directory holding {MANIFEST_NAME} (a torch.save file: zerostall import FILE DST "
                "makes a checkpoint of it)")
    return StorageError(f"{local} is a file, not a checkpoint: {what}", errno=exc.errno, path=exc.path)


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
               "GIB": 2**30, "TIB": 2**40}


def _shard_size(text: str) -> int:
    """``--max-shard-size``: bytes, or a number with a unit (decimal KB/MB/GB/TB, binary KiB/MiB/GiB/TiB)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _SIZE_UNITS or float(m.group(1)) * _SIZE_UNITS[unit] < 1:
        raise InvalidArgumentError(f"--max-shard-size: expected a size such as 5GB, 500MB, 2GiB or a number of "
                                   f"bytes, got {text!r}", argument="--max-shard-size")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def _check_export_suffix(args: argparse.Namespace) -> None:
    """OUT without a known suffix: say which suffixes and which --format (the library's message
    names the Python argument ``format=``)."""
    if args.format is not None:
        return
    from zerostall.interop import _export_format

    try:
        _export_format(args.out, None)
    except UnsupportedFormatError as exc:
        raise UnsupportedFormatError(f"cannot tell the format from the suffix of {args.out!r}: name it .safetensors "
                                     "or .pt, or pass --format safetensors or --format torch", path=exc.path) from exc


def _as_zerostall_error(exc: Exception, args: argparse.Namespace) -> Exception:
    """A backend's raw ``OSError`` (an S3 listing refused for want of credentials, say) reported
    as the :class:`StorageError` the library raises elsewhere: errno kept, the path named."""
    if not isinstance(exc, OSError) or isinstance(exc, ZerostallError):
        return exc
    where = next((getattr(args, a) for a in ("dir", "path", "checkpoint", "src") if getattr(args, a, None)), None)
    path = exc.filename if isinstance(exc.filename, str) else where
    return StorageError(exc.strerror or str(exc), errno=exc.errno, path=path)


class _Parser(argparse.ArgumentParser):
    """argparse, plus "did you mean" for a mistyped option (``--jsn``); Python < 3.14 has none."""

    def error(self, message: str) -> NoReturn:
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            known = _option_strings(self)
            hints = [f"{a} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(a, known, n=1)) else a
                     for a in message[len(prefix):].split()]
            message = prefix + " ".join(hints)
        super().error(message)


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string of ``parser`` and of its sub-commands."""
    out: list[str] = []
    for action in parser._actions:
        out.extend(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out.extend(_option_strings(sub))
    return sorted(set(out))


if __name__ == "__main__":
    sys.exit(main())
