"""A site's check of itself before it joins a federation (``gep-fed site check``).

During a run a site never turns a problem with one of its examples into an error: the
example is dropped (clip factor 0) and counted nowhere, since a failed reply would tell the
server something about the data. So the problems have to be found before the site joins,
here, with the node config the SuperNode will use: the node config itself, the site's own
task and model, every example of its data (read and checked exactly as a round reads it),
and its ledger (HMAC and high-water mark). Nothing here leaves the site.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gep_fed.accounting.ledger import (
    LedgerError,
    PrivacyLedger,
    default_mark_path,
    read_ledger_key,
)
from gep_fed.data.formats import DataError, class_disagreement, folder_dataset
from gep_fed.data.task import CheckedExamples
from gep_fed.federation.policy import SiteConfig
from gep_fed.mechanisms.per_example import IncompatibleModelError, validate_model
from gep_fed.validation import ConfigError


@dataclass(frozen=True)
class SiteCheck:
    """What the check found. ``errors`` stop the site from joining; ``problems`` are
    examples a run would drop (index, what is wrong). ``classes``: the class names of data
    from class folders in label order, declared by the task or (``classes_declared`` False)
    inferred from the site's folders, which every site must then have alike."""

    site_id: str = ""
    task: str = ""
    examples: int = 0
    classes: tuple[str, ...] = ()
    classes_declared: bool = True
    missing_classes: tuple[str, ...] = ()
    problems: tuple[tuple[int, str], ...] = ()
    ledger: str = ""
    errors: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not self.errors and not self.problems

    def lines(self, shown: int = 20) -> list[str]:
        out = [f"site {self.site_id or '?'}: task {self.task or '?'}"]
        if self.examples:
            out.append(f"  {self.examples} example(s) read, {len(self.problems)} with problems")
        if self.classes and not self.classes_declared:
            listed = ", ".join(f'"{c}"' for c in self.classes)
            out.append(
                f"  classes from this site's folders (none declared): {', '.join(self.classes)}"
                "; every site must have exactly these, or their labels differ (compare them, "
                "or pass --classes): declare them in the task, e.g. "
                f"ImageFolderDataset(data_path, transform, classes=[{listed}])"
            )
        if self.missing_classes:
            out.append(
                f"  no example of class(es) {', '.join(self.missing_classes)}: fine, the site "
                "trains on the others (the labels keep the declared numbering)"
            )
        for index, problem in self.problems[:shown]:
            out.append(f"  example {index}: {problem}")
        if len(self.problems) > shown:
            out.append(f"  ... and {len(self.problems) - shown} more")
        if self.problems:
            out.append("  a run would drop these examples from every sample: fix or remove them")
        if self.ledger:
            out.append(f"  ledger: {self.ledger}")
        out += [f"  error: {e}" for e in self.errors]
        out.append("  ready to join" if self.ok else "  NOT ready to join")
        return out


def check_site(
    node_config: Mapping[str, object],
    progress: Callable[[int, int], None] | None = None,
    expected_classes: Sequence[str] | None = None,
) -> SiteCheck:
    """Check a deployed site's node config, task, data and ledger (see the module).
    ``expected_classes``: the federation's class names in label order; data from class
    folders naming others (or another order) is an error."""
    try:
        cfg = SiteConfig.from_node_config(node_config)
    except ConfigError as err:
        return SiteCheck(errors=(f"node config: {err}",))
    found = {"site_id": cfg.site_id, "task": cfg.task}
    try:
        task = cfg.make_task()
        model = task.build_model()
        validate_model(model)
        data = task.site_dataset(cfg.data_path)
        checked = CheckedExamples.of(data, task.kind, model)
    except (ConfigError, DataError, IncompatibleModelError, OSError, ValueError) as err:
        return SiteCheck(**found, errors=(f"{type(err).__name__}: {err}",))
    problems = []
    for i in range(len(checked)):
        problem = checked.problem(i)
        if problem is not None:
            problems.append((i, problem))
        if progress is not None:
            progress(i + 1, len(checked))
    errors, ledger = [], ""
    folders = folder_dataset(data)
    if folders is not None and expected_classes is not None:
        differ = class_disagreement({cfg.site_id or "this site": folders}, expected_classes)
        if differ:
            errors.append(differ)
    try:
        opened = PrivacyLedger.load(
            cfg.ledger_path,
            read_ledger_key(cfg.ledger_key_path),
            default_mark_path(cfg.ledger_key_path),
        )
        budget = cfg.policy.epsilon_budget
        ledger = (
            f"{cfg.ledger_path} verified: {opened.steps} step(s), epsilon "
            f"{opened.epsilon():.4f} of the node config's budget {budget:g}"
        )
        if budget is not None and opened.epsilon() >= budget:
            errors.append(f"the ledger has spent its budget ({opened.epsilon():.4f} >= {budget:g})")
        if opened.delta != cfg.policy.delta:
            errors.append(
                f"the ledger accounts at delta {opened.delta:g}, the node config says "
                f"{cfg.policy.delta:g}"
            )
    except LedgerError as err:
        if cfg.new_ledger and not Path(cfg.ledger_key_path).exists():
            ledger = "none yet: new-ledger will create it, its key and its mark on first start"
        else:
            errors.append(str(err))
    if cfg.policy.accepts_secure_sum:  # its secure-sum key and pinned peers
        try:
            cfg.site_key()
            cfg.pinned_peers()
        except ConfigError as err:
            errors.append(f"distributed mode: {err}")
    return SiteCheck(
        **found,
        examples=len(checked),
        classes=tuple(folders.classes) if folders is not None else (),
        classes_declared=folders.classes_declared if folders is not None else True,
        missing_classes=tuple(folders.missing_classes) if folders is not None else (),
        problems=tuple(problems),
        ledger=ledger,
        errors=tuple(errors),
    )
