"""Task names: the built-in tasks by name, and a user's own by import path."""

from __future__ import annotations

import importlib

from gep_fed.data.builtin_tasks import (
    Cifar10Task,
    DigitsTask,
    FashionMnistTask,
    MedMnistTask,
    MnistTask,
)
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
    module_name, sep, class_name = name.partition(":")
    if not sep or not module_name or not class_name:
        raise ValueError(
            f"task {name!r} is neither a built-in task ({sorted(BUILT_IN_TASKS)}) nor an "
            "import path 'package.module:ClassName'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"task {name!r}: cannot import {module_name!r}: {err}") from err
    if not hasattr(module, class_name):
        raise ValueError(f"task {name!r}: module {module_name!r} has no class {class_name!r}")
    cls = getattr(module, class_name)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ValueError(
            f"task {name!r}: {module_name}.{class_name} is not a subclass of gep_fed's Task"
        )
    return cls
