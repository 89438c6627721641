"""Generated tasks from reasoning-gym families: training items, the final test
(no question shared with training, checked), the chat form of a task, and the
family's own verifier.

reasoning-gym seeds item i of a dataset with `seed + i`, so each family gets
its own seed range, FAMILY_STRIDE apart, and training and test ranges are
checked not to overlap.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from coopstudy.config import INT_CEILING
from coopstudy.errors import UserError

if TYPE_CHECKING:
    from coopstudy.config import DataConfig

FAMILY_STRIDE = 1_000_000
"""Seed distance between consecutive families of one split."""
INSTRUCTION = "Answer with only the final answer."


def final_budget(per_family: int) -> int:
    """Items tried per family for the final test: enough spare for questions
    that training already holds (a family with a small question space repeats)."""
    return 2 * per_family + 100


@dataclass(frozen=True)
class Task:
    family: str
    index: int
    """reasoning-gym item index within the family's seed range."""
    entry: dict[str, Any]
    """question, answer, metadata: what the family's verifier reads."""

    @property
    def question(self) -> str:
        return self.entry["question"]

    @property
    def task_id(self) -> str:
        """`family/index`: a training document's id, a test case's case_id."""
        return f"{self.family}/{self.index}"


@dataclass
class FinalDraw:
    tasks: list[Task]
    seen_in_training: dict[str, int] = field(default_factory=dict)
    repeated_in_test: dict[str, int] = field(default_factory=dict)

    @property
    def dropped(self) -> int:
        return sum(self.seen_in_training.values()) + sum(self.repeated_in_test.values())


def family_seed(base: int, position: int) -> int:
    return base + position * FAMILY_STRIDE


def _ranges(families: Sequence[str], seed: int, n: int, what: str) -> list[tuple[int, int, str]]:
    return [(family_seed(seed, pos), n, f"{what} {fam}") for pos, fam in enumerate(families)]


def _overlap(ranges: list[tuple[int, int, str]]) -> str | None:
    """The first two ranges that overlap, said; None when none do."""
    ranges = sorted(ranges)
    for (a, n, what_a), (b, _, what_b) in zip(ranges, ranges[1:]):
        if a + n > b:
            return f"the seed ranges of {what_a} ({a}..{a + n - 1}) and {what_b} (from {b}) overlap"
    return None


def _refuse_overlap(ranges: list[tuple[int, int, str]], key: str, hint: str) -> None:
    said = _overlap(ranges)
    if said:
        raise UserError(f"{key}: {said}; {hint}")


def check_seed_ranges(families: Sequence[str], train_seed: int, train_n: int, test_seed: int, test_n: int) -> None:
    """Refuse seeds whose ranges overlap: an overlap repeats items between
    families or between training and test."""
    # Each family's range holds FAMILY_STRIDE seeds: with two families or more,
    # more items than that overlap the next family's whatever the seeds.
    for key, n, drawn in (("data.tasks_per_family", train_n, train_n), ("data.test_per_family", test_n, final_budget(test_n))):
        if len(families) > 1 and drawn > FAMILY_STRIDE:
            more = f" ({drawn:,} drawn, to replace those dropped)" if drawn != n else ""
            raise UserError(f"{key}: {n:,}{more} is more than the {FAMILY_STRIDE:,} seeds each family's range holds")
    _refuse_overlap(
        _ranges(families, train_seed, train_n, "training") + _ranges(families, test_seed, final_budget(test_n), "test"),
        "data.test_seed",
        f"keep data.generation_seed and data.test_seed at least {len(families) * FAMILY_STRIDE} apart",
    )


DEV_SEED = 5_000_000
"""The development split's test seed (dev-split, bench generate): far from the
presets' training (1,000+) and final-test (9,000,000+) seed ranges."""


def check_development_seed(cfg_data: DataConfig, families: Sequence[str], dev_seed: int, per_family: int | None = None) -> None:
    """Refuse a development split (`dev-split`: the final test of `dev_seed`
    over `families`, `per_family` cases each, by default the preset's
    test_per_family) whose seed ranges meet the preset's training or final
    test: it would score, or choose by, the study's own questions. The
    refusal names the first seed, in steps of half a family's range, that
    meets neither."""

    # The split trains on its own families too (data.build checks that against
    # its test); a family at the same place trains on the same range.
    study = _ranges(cfg_data.families, cfg_data.generation_seed, cfg_data.tasks_per_family, "training")
    own = _ranges(families, cfg_data.generation_seed, cfg_data.tasks_per_family, "the development split's training")
    starts = {start for start, _, _ in study}
    final = _ranges(cfg_data.families, cfg_data.test_seed, final_budget(cfg_data.test_per_family), "the final test's")
    fixed = study + [r for r in own if r[0] not in starts] + final

    def ranges(seed: int) -> list[tuple[int, int, str]]:
        return fixed + _ranges(families, seed, final_budget(per_family or cfg_data.test_per_family), "the development split's")

    said = _overlap(ranges(dev_seed))
    if said:
        hint = f"choose a seed whose ranges ({FAMILY_STRIDE:,} apart, one per family) meet neither"
        steps = range(FAMILY_STRIDE // 2, INT_CEILING - len(families) * FAMILY_STRIDE, FAMILY_STRIDE // 2)
        free = next((seed for seed in steps if _overlap(ranges(seed)) is None), None)
        raise UserError(f"--dev-seed: {said}; {hint}" + (f", e.g. --dev-seed {free}" if free is not None else ""))


def check_families(families: Sequence[str], key: str, options: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """Refuse a family reasoning-gym does not know, or one named twice, and
    options it does not take, before any work starts: otherwise they surface
    only when the tasks are generated (after the seed is made)."""
    import difflib

    from reasoning_gym.factory import DATASETS

    for pos, family in enumerate(families):
        if family in families[:pos]:
            raise UserError(f"{key}: {family} listed twice")
        if family not in DATASETS:
            near = difflib.get_close_matches(family, DATASETS, n=3)
            hint = f"did you mean {' or '.join(near)}?" if near else f"it knows {len(DATASETS)}, e.g. {', '.join(sorted(DATASETS)[:3])}"
            raise UserError(f"{key}: reasoning-gym has no family {family!r}; {hint}")
    for family, given in (options or {}).items():
        dataset(family, 0, 1, given, key="data.family_options")  # one item: instant, and made as generation makes them


def dataset(family: str, seed: int, size: int, options: Mapping[str, Any] | None = None, *, key: str = "data.families"):
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(family, seed=seed, size=size, **dict(options or {}))
    except (ValueError, KeyError, TypeError, AssertionError) as err:
        # reasoning-gym checks its options with `assert`, and the message names what is wrong.
        raise UserError(f"{key}: reasoning-gym cannot make {family!r}: {str(err) or type(err).__name__}") from None


def _entry(raw: Mapping[str, Any]) -> dict[str, Any]:
    # A JSON round trip now, so the entry a verifier sees at evaluation (read
    # back from test.jsonl) is the one it sees here.
    return json.loads(json.dumps({k: raw[k] for k in ("question", "answer", "metadata")}, default=str))


def generate_training(families: Sequence[str], per_family: int, seed: int, options: Mapping[str, Mapping[str, Any]] | None = None) -> list[Task]:
    out: list[Task] = []
    for pos, fam in enumerate(families):
        ds = dataset(fam, family_seed(seed, pos), per_family, (options or {}).get(fam))
        out.extend(Task(fam, i, _entry(ds[i])) for i in range(per_family))
    return out


def generate_final(
    families: Sequence[str],
    per_family: int,
    seed: int,
    training_questions: set[str],
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> FinalDraw:
    """`per_family` new cases per family: items whose question appears in
    training, or earlier in the test, are dropped and counted."""
    draw = FinalDraw(tasks=[])
    for pos, fam in enumerate(families):
        budget = final_budget(per_family)
        ds = dataset(fam, family_seed(seed, pos), budget, (options or {}).get(fam))
        seen: set[str] = set()
        kept = 0
        draw.seen_in_training[fam] = draw.repeated_in_test[fam] = 0
        for i in range(budget):
            if kept == per_family:
                break
            entry = _entry(ds[i])
            question = entry["question"]
            if question in training_questions:
                draw.seen_in_training[fam] += 1
            elif question in seen:
                draw.repeated_in_test[fam] += 1
            else:
                seen.add(question)
                draw.tasks.append(Task(fam, i, entry))
                kept += 1
        if kept < per_family:
            raise UserError(
                f"data.test_per_family: family {fam} has only {kept} new questions in {budget} tries "
                f"({draw.seen_in_training[fam]} already in training); lower data.test_per_family or data.tasks_per_family"
            )
    return draw


def task_messages(question: str) -> list[dict[str, str]]:
    """The prompt of a task, as the model sees it in training and at test."""
    return [{"role": "user", "content": f"{question}\n{INSTRUCTION}"}]


def test_case(task: Task) -> dict[str, Any]:
    """A task as a case of a test set (the final test, the development split):
    what scoring reads of it."""
    return {"case_id": task.task_id, "family": task.family, "messages": task_messages(task.question), "entry": task.entry}


def training_messages(task: Task) -> list[dict[str, str]]:
    return task_messages(task.question) + [{"role": "assistant", "content": str(task.entry["answer"])}]


@functools.cache
def _verifier(family: str):
    # score_answer reads the entry, not the dataset's items; any instance of the family will do.
    return dataset(family, seed=0, size=1)


def score_answer(family: str, answer: str | None, entry: Mapping[str, Any]) -> float:
    """The family's own verifier: 1.0 is correct, some families give partial credit."""
    return float(_verifier(family).score_answer(answer, dict(entry)))
