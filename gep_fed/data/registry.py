"""Task names: the built-in tasks by name, and a user's own by import path."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import traceback
from pathlib import Path

from gep_fed.data.builtin_tasks import (
    Cifar10Task,
    DigitsTask,
    FashionMnistTask,
    MedMnistTask,
    MnistTask,
)
from gep_fed.data.rehearsal import parse_rehearsal_name, rehearsal_task
from gep_fed.data.task import Task

BUILT_IN_TASKS: dict[str, type[Task]] = {
    "digits": DigitsTask,
    "mnist": MnistTask,
    "fashion-mnist": FashionMnistTask,
    "pneumonia": MedMnistTask,
    "medmnist": MedMnistTask,
    "cifar10": Cifar10Task,
}


def resolve_task(name: str) -> type[Task]:
    """A built-in task's name, or ``"package.module:ClassName"`` of the user's own task.

    An import path is imported here: only ever call this with a name the caller chose (a
    deployed site resolves the task of its own node config, never the server's string)."""
    if name in BUILT_IN_TASKS:
        return BUILT_IN_TASKS[name]
    rehearsal = parse_rehearsal_name(name)
    if rehearsal is not None:  # a task rehearsed on its server's validation data
        fold, folds, task = rehearsal
        return rehearsal_task(resolve_task(task), fold, folds)
    module_name, sep, class_name = name.rpartition(":")
    if not sep or not module_name or not class_name:
        raise ValueError(
            f"task {name!r} is neither a built-in task ({sorted(BUILT_IN_TASKS)}) nor an "
            "import path 'package.module:ClassName' nor a file 'path/to/task.py:ClassName'"
        )
    if module_name.endswith(".py"):
        module = _module_from_file(name, Path(module_name))
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(
                f"task {name!r}: cannot import {module_name!r}: {err} (a module on the Python "
                "path, e.g. 'my_hospital.task:ChestXray' run from the folder holding "
                "my_hospital/, or a file, 'path/to/task.py:ChestXray')"
            ) from err
    if not hasattr(module, class_name):
        raise ValueError(f"task {name!r}: module {module_name!r} has no class {class_name!r}")
    cls = getattr(module, class_name)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ValueError(
            f"task {name!r}: {module_name}.{class_name} is not a subclass of gep_fed's Task"
        )
    return cls


def task_file_name(name: str) -> str:
    """``name`` with a task file's path made absolute (``path/to/task.py:Class``), so that
    the sites and a resumed run find the same file from any folder; other names unchanged."""
    module_name, sep, class_name = name.rpartition(":")
    if sep and module_name.endswith(".py"):
        return f"{Path(module_name).expanduser().resolve()}:{class_name}"
    return name


def _module_from_file(name: str, path: Path):
    """The module of a task file, imported once per process (its folder joins the Python
    path, so that it may import its neighbours)."""
    path = path.expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"task {name!r}: no file {path}")
    key = "gep_fed_task_" + hashlib.sha256(str(path).encode()).hexdigest()[:16]
    if key in sys.modules:
        return sys.modules[key]
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # the user's file: its own error, where it happened
        del sys.modules[key]
        lines = [
            f.lineno for f in traceback.extract_tb(err.__traceback__) if f.filename == str(path)
        ]
        where = f" at line {lines[-1]}" if lines else ""
        raise ValueError(
            f"task {name!r}: importing {path} failed{where}: {type(err).__name__}: {err}"
        ) from err
    except BaseException:
        del sys.modules[key]
        raise
    return module
