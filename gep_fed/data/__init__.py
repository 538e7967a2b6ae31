"""Data and tasks: the task interface, the built-in tasks by name, data sets and their
readers (arrays, image folders, DICOM, CIFAR-10), site partitions, models, metrics."""

from gep_fed.data.formats import DataError
from gep_fed.data.models import MLP, MnistCNN, resnet20_gn
from gep_fed.data.registry import BUILT_IN_TASKS, resolve_task
from gep_fed.data.task import (
    SMALL_DATA_RECIPE,
    SMALL_IMAGE_RECIPE,
    CheckedExamples,
    Task,
    TaskSettings,
)

__all__ = [
    "BUILT_IN_TASKS",
    "MLP",
    "SMALL_DATA_RECIPE",
    "SMALL_IMAGE_RECIPE",
    "CheckedExamples",
    "DataError",
    "MnistCNN",
    "Task",
    "TaskSettings",
    "resnet20_gn",
    "resolve_task",
]
