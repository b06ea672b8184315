"""What each entry point imports: the writer, the keeper and the CLI start without the save and
load API (``zerostall/__init__`` loads its public names on first use); the public face's three
namespaces (``zerostall``, ``zerostall.errors``, ``zerostall.advice``), each pinned; and every name
the top level held before it was split still resolving from ``zerostall``, with a warning."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import warnings

import pytest

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
#: modules of the trainer's side: the save and load API and what only it needs
API = ("zerostall.api", "zerostall.checkpointer", "zerostall.engine", "zerostall.distributed", "zerostall.interop",
       "zerostall.persist.client")


def _loaded_after(statement: str) -> set[str]:
    """The zerostall modules a fresh interpreter holds after ``statement``."""
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(m for m in sys.modules if m.startswith('zerostall'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=SRC))
    assert out.returncode == 0, out.stderr[-2000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("entry", ["zerostall.persist.server", "zerostall.memtier.keeper", "zerostall.cli"])
def test_the_writer_keeper_and_cli_start_without_the_save_and_load_api(entry: str) -> None:
    loaded = _loaded_after(f"import {entry}")
    assert entry in loaded
    assert not loaded & set(API), sorted(loaded & set(API))


@pytest.mark.parametrize("entry,forbidden", [
    ("zerostall.persist.server", ("zerostall.memtier", "zerostall.stage", "zerostall.tree", "zerostall.engine")),
    ("zerostall.memtier.keeper", ("zerostall.stage", "zerostall.tree", "zerostall.engine")),
])
def test_the_writer_and_the_keeper_load_nothing_of_the_trainers_side(entry: str, forbidden: tuple[str, ...]) -> None:
    """The process boundary, in the process: what the writer runs knows nothing of staging, the
    tree or the engine (nor of the memory tier), the keeper nothing of staging, the tree or the
    engine (the import linter's contracts say the same of the source)."""
    loaded = _loaded_after(f"import {entry}")
    assert not {m for m in loaded if m.startswith(forbidden)}, sorted(m for m in loaded if m.startswith(forbidden))


@pytest.mark.parametrize("save", [
    "zerostall.save_pytree(d + '/a', {'w': np.ones(3)})",
    "ck = zerostall.Checkpointer(d + '/b')\nck.save_pytree(1, {'w': np.ones(3)})\nck.load_pytree(1)\nck.close()",
])
def test_a_plain_save_loads_no_memory_tier_module_in_the_trainer(tmp_path, save: str) -> None:
    """The memory tier plugs in (persist.client.WriterSide, restore.sources): a save and load
    without one import none of it."""
    loaded = _loaded_after(f"import tempfile\nimport numpy as np\nimport zerostall\nd = {str(tmp_path)!r}\n{save}")
    assert "zerostall.engine" in loaded
    assert not {m for m in loaded if m.startswith("zerostall.memtier")}, sorted(m for m in loaded if "memtier" in m)


def test_import_zerostall_loads_the_errors_and_each_public_name_on_first_use() -> None:
    assert _loaded_after("import zerostall") == {"zerostall", "zerostall._version", "zerostall.errors"}
    loaded = _loaded_after("import zerostall\nassert zerostall.Checkpointer.__name__ == 'Checkpointer'\n"
                           "assert all(getattr(zerostall, n) is not None for n in zerostall.__all__)")
    assert "zerostall.checkpointer" in loaded and "zerostall.api" in loaded


def test_an_unknown_name_is_an_attribute_error() -> None:
    import zerostall

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        zerostall.nope  # noqa: B018
    assert not hasattr(zerostall, "_private")


# -- the public face: three namespaces, each pinned ---------------------------------------------

#: zerostall: what a save-and-load loop needs, the two namespaces, and the errors such a loop catches
TOP = [
    "__version__", "errors", "advice",
    "save_pytree", "save_pytree_async", "save_checkpointables", "save_checkpointables_async",
    "load_pytree", "load_checkpointables", "load_metadata", "prepare", "release_buffers",
    "Checkpointer", "Response", "SaveStats",
    "SaveOptions", "LoadOptions", "WriterKind", "Staging", "DistributedOptions", "Replicated", "MemoryTier",
    "Stateful", "LeafHandler", "register_handler", "unregister_handler",
    "ZerostallError", "CorruptCheckpointError", "BackgroundSaveError",
]
#: zerostall.errors: every error class it defines, and the warning
ERRORS = [
    "ZerostallError", "CheckpointNotFoundError", "DirectoryReplacedError", "CheckpointExistsError",
    "CorruptCheckpointError", "ChecksumMismatchError", "NoValidCheckpointError", "UnsupportedFormatError",
    "MismatchError", "MissingKeyError", "UnsupportedLeafError",
    "InvalidArgumentError", "ArgumentTypeError", "HostMemoryLimitError", "MetadataError", "MetadataTypeError",
    "AdviceError", "MissingDependencyError", "StorageError", "ReadOnlyError",
    "WriterError", "BackgroundSaveError", "UnknownLayoutError", "KeeperPersistError", "KeeperLostError",
    "TornSnapshotError", "DonatedArrayError", "ReplicaError", "PeerUnreachableError", "PreemptionError",
    "ZerostallWarning",
]
#: zerostall.advice: the checkpoint-interval advisor (docs/advice.md's table)
ADVICE = [
    "SaveCost", "MeasuredCosts", "ReplicaCost", "FailureMix", "Model", "Advice", "TierAdvice", "advise",
    "young_interval", "daly_interval", "one_level_overhead", "two_level_overhead", "three_tier_overhead",
    "steps_for", "mtbf_from_restarts", "CadenceEstimator", "SaveKind", "AutoInterval",
    "DEFAULT_MEMORY_FRACTION", "DEFAULT_FAILURE_MIX",
]
#: what the top level's __all__ held before it was split: code written against it keeps working
FORMER_TOP = [
    "__version__", "save_pytree", "save_pytree_async", "save_checkpointables", "save_checkpointables_async",
    "load_pytree", "load_checkpointables", "load_metadata", "prepare", "release_buffers",
    "Checkpointer", "Response", "SaveStats",
    "SaveOptions", "LoadOptions", "WriterKind", "Staging", "DistributedOptions", "Replicated", "MemoryTier",
    "Stateful", "LeafHandler", "register_handler", "unregister_handler",
    "Advice", "MeasuredCosts", "FailureMix", "ReplicaCost", "TierAdvice",
    "ZerostallError", "InvalidArgumentError", "ArgumentTypeError", "AdviceError", "MissingDependencyError",
    "CheckpointNotFoundError", "CheckpointExistsError", "ReadOnlyError",
    "CorruptCheckpointError", "ChecksumMismatchError", "NoValidCheckpointError", "UnsupportedFormatError",
    "MismatchError", "MissingKeyError", "UnsupportedLeafError", "MetadataError", "MetadataTypeError",
    "StorageError", "WriterError", "BackgroundSaveError", "TornSnapshotError", "DonatedArrayError",
    "KeeperPersistError", "KeeperLostError", "DirectoryReplacedError", "ZerostallWarning",
    "UnadoptableKeeper", "PreemptionError",
]
#: a name of FORMER_TOP no longer at the top -> its public home
MOVED = {
    **{name: "zerostall.errors" for name in FORMER_TOP if name in ERRORS and name not in TOP},
    **{name: "zerostall.advice" for name in ("Advice", "MeasuredCosts", "FailureMix", "ReplicaCost", "TierAdvice")},
    "UnadoptableKeeper": "zerostall.memtier.keeperfail",
}


@pytest.mark.parametrize(("module", "expected"), [("zerostall", TOP), ("zerostall.errors", ERRORS),
                                                  ("zerostall.advice", ADVICE)])
def test_each_namespace_is_pinned_and_every_name_in_it_resolves(module: str, expected: list[str]) -> None:
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == sorted(expected)
    assert len(set(mod.__all__)) == len(mod.__all__), "a name is listed twice"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no public name of a namespace is a deprecated one
        assert all(getattr(mod, name) is not None for name in mod.__all__)


def test_the_errors_namespace_lists_every_class_the_errors_module_defines() -> None:
    import zerostall.errors as errors

    defined = {name for name, value in vars(errors).items()
               if isinstance(value, type) and value.__module__ == errors.__name__ and not name.startswith("_")}
    assert defined == set(errors.__all__)
    assert all(issubclass(getattr(errors, n), (errors.ZerostallError, errors.ZerostallWarning)) for n in defined)


def test_the_top_level_errors_are_the_errors_namespace_s_classes() -> None:
    import zerostall

    assert zerostall.errors is importlib.import_module("zerostall.errors")
    assert zerostall.advice is importlib.import_module("zerostall.advice")
    for name in ("ZerostallError", "CorruptCheckpointError", "BackgroundSaveError"):
        assert getattr(zerostall, name) is getattr(zerostall.errors, name)


def test_every_name_the_top_level_held_still_resolves_there() -> None:
    import zerostall

    assert set(FORMER_TOP) - set(TOP) == set(MOVED)
    for name in FORMER_TOP:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            assert getattr(zerostall, name) is not None


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_moved_name_warns_once_naming_its_home_and_is_the_same_object(name: str) -> None:
    import zerostall

    home = MOVED[name]
    new = getattr(importlib.import_module(home), name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = getattr(zerostall, name)
    assert old is new
    assert [(w.category, str(w.message)) for w in caught] == [
        (DeprecationWarning, f"zerostall.{name} is {home}.{name}: import it from there")]
    # `from zerostall import X` warns once too (the import system's own hasattr does not), at the
    # line that imports it
    namespace: dict[str, object] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(f"from zerostall import {name}", "user_code.py", "exec"), namespace)
    assert namespace[name] is new
    assert [(w.category, w.filename, w.lineno) for w in caught] == [(DeprecationWarning, "user_code.py", 1)]
    assert name not in zerostall.__all__ and name not in dir(zerostall)


def test_dir_lists_the_public_names_and_the_moved_names_stay_out_of_it() -> None:
    import zerostall

    listed = dir(zerostall)
    assert set(TOP) <= set(listed)
    assert not set(MOVED) & set(listed)


def test_a_fresh_interpreter_resolves_the_top_level_without_a_deprecation_warning() -> None:
    loaded = _loaded_after("import warnings\nwarnings.simplefilter('error', DeprecationWarning)\nimport zerostall\n"
                           "[getattr(zerostall, n) for n in zerostall.__all__]\n"
                           "from zerostall.errors import *\nfrom zerostall.advice import *")
    assert "zerostall.advice" in loaded and "zerostall.api" in loaded
