"""What a step needs, checked: each function re-hashes one commitment against
the ledger and returns it, or refuses in one line that says what changed and
what to run. Every step and the training processes check through here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coopstudy import workspace
from coopstudy.commit import candidates, ledger, receipts, sources
from coopstudy.commit import plan as planning
from coopstudy.config import ARMS, Config
from coopstudy.errors import RefusedError
from coopstudy.inputs import data
from coopstudy.inputs.seed import Seed, remake_hint, resolve_seed
from coopstudy.record import schema


def inputs(cfg: Config, book: ledger.Ledger | None = None) -> data.Prepared:
    """The committed inputs of `cfg`, re-hashed; refused when missing or changed."""
    entry = (book or ledger.Ledger()).require(
        ledger.INPUTS,
        data.inputs_key(cfg),
        hint=f"run `python -m coopstudy prepare {cfg.arguments}` first",
    )
    return data.load_folder(workspace.home() / entry.details["folder"], entry.digest)


def seeded_inputs(cfg: Config) -> tuple[data.Prepared, Seed]:
    """The committed inputs of `cfg` and the seed model they were made from,
    both re-hashed, or a refusal that says what to run."""
    prepared = inputs(cfg)
    seed = resolve_seed(cfg)
    made_from = prepared.manifest["seed_model"]["sha256"]
    if seed.sha256 != made_from:
        raise RefusedError(
            f"seed weights {seed.path} hash to {seed.sha256[:12]}, the prepared inputs were made from {made_from[:12]}",
            hint=remake_hint(seed.path) or f"run `python -m coopstudy prepare {cfg.arguments}` again",
        )
    return prepared, seed


def gate_receipt(
    cfg: Config | None = None, book: ledger.Ledger | None = None, *, directory: Path | None = None, bound: str | None = None
) -> ledger.Entry:
    """The ledger entry of a passed gate on the current numerical sources and
    libraries, or a refusal that names what changed and what to run (verify
    of `cfg`, whose optimizer settings the gate's cases use). `bound`: the
    digest of the receipt a plan or a verify run already holds, kept while it
    still applies, so that a gate passed since for another config (verify with
    other optimizer settings) does not undo that plan; otherwise the newest."""
    book = book or ledger.Ledger()
    hint = f"run `python -m coopstudy verify{f' {cfg.arguments}' if cfg is not None else ''}`"
    sha, files = sources.numerical_sources_sha256(directory)
    libs = sources.library_versions()
    passed = [e for e in book.entries() if e.kind == ledger.GATE and e.subject == sources.GATE_SUBJECT]
    holding = [e for e in passed if e.details.get("sources_sha256") == sha and e.details.get("libraries") == libs]
    if holding:
        return next((e for e in holding if e.digest == bound), holding[-1])
    if not passed:
        raise RefusedError(f"no gate receipt for the numerical sources in {book.path}", hint=hint)
    latest = passed[-1].details
    changed = [name for name in files if latest.get("sources", {}).get(name) != files[name]]
    changed += [name for name in latest.get("sources", {}) if name not in files]
    if changed:
        raise RefusedError(f"numerical sources changed since the gate receipt: {', '.join(changed)}", hint=hint)
    moved = [f"{k} {latest.get('libraries', {}).get(k)} -> {v}" for k, v in libs.items() if latest.get("libraries", {}).get(k) != v]
    raise RefusedError(f"library versions changed since the gate receipt: {', '.join(moved)}", hint=hint)


def probe_receipts_complete(cfg: Config) -> None:
    """Every candidate of probe.candidates has a committed receipt, or a refusal."""
    kept = receipts.probe_receipts(cfg)
    names = [receipts.setting_name(c.arm, c.microbatch, c.allocator) for c in cfg.probe.candidates]
    missing = [name for name in names if receipts.receipt_file(name) not in kept]
    if missing:
        raise RefusedError(f"no probe receipt for {', '.join(missing)}", hint=f"run `python -m coopstudy probe {cfg.arguments}`")


@dataclass(frozen=True)
class _Read:
    """The plan committed for a config, read once from the ledger and its file
    (training checks the gate it binds, then the plan)."""

    book: ledger.Ledger
    entries: list[ledger.Entry]
    entry: ledger.Entry | None
    """The plan's newest entry; None when none is committed."""
    document: Any
    """Its file's document: None where the file is missing or holds no JSON, the OSError where it cannot be read."""


def _read(cfg: Config) -> _Read:
    book = ledger.Ledger()
    entries = book.entries()
    entry = book.latest(ledger.PLAN, planning.subject(cfg), entries)
    document: Any = None
    if entry is not None:
        # Kept, not raised: training checks the gate first, which needs no plan file.
        try:
            if planning.file(entry).is_file():
                document = planning.stored(entry)
        except OSError as err:
            document = err
    return _Read(book, entries, entry, document)


def committed_plan(cfg: Config, read: _Read | None = None) -> str:
    """The committed plan's sha256, after checking that nothing it hashes has
    changed; a refusal names what did. Later stages tag their runs with it
    (schema.TAG_PLAN). `read`: the plan as read already."""
    read = read or _read(cfg)
    entry = read.book.require(ledger.PLAN, planning.subject(cfg), hint=planning.hint(cfg), entries=read.entries)
    short = entry.digest[:12]
    old = planning.intact(cfg, entry, read.document)
    rerun = f"rerun the steps after it and commit the plan again (`python -m coopstudy study {cfg.arguments}`)"
    # The cheap checks first, each naming the files that changed: every
    # source that decides a number (sources.deciding_sources) is bound.
    changed = sources.changed_sources(old["sources"]["files"])
    if changed:
        raise RefusedError(f"changed since the plan {short} was committed: source {', '.join(changed)}", hint=rerun)
    hashes = receipts.receipt_hashes(cfg)
    if hashes != old["probe_receipts"]:
        changed = sources.changed(old["probe_receipts"], hashes)
        raise RefusedError(f"changed since the plan {short} was committed: probe receipt {', '.join(changed)}", hint=rerun)
    try:
        new = planning.build(cfg, inputs(cfg), gate_receipt(cfg, bound=old.get("gate_receipt")))
    except RefusedError as err:
        # Inputs that no longer verify, a gate receipt that no longer matches:
        # the message names the file.
        raise RefusedError(f"changed since the plan {short} was committed: {err.reason}", hint=err.hint) from None
    if planning.digest(new) != entry.digest:
        raise RefusedError(f"changed since the plan {short} was committed: {'; '.join(planning.differences(old, new))}", hint=rerun)
    return entry.digest


def planned_gate(cfg: Config, read: _Read | None = None) -> str | None:
    """The gate receipt bound by the plan committed for `cfg`; None when there
    is none, or its file cannot be read (the plan step then commits anew)."""
    document = (read or _read(cfg)).document
    return document.get("gate_receipt") if isinstance(document, dict) else None


def planned_probe_receipts(cfg: Config) -> tuple[str, dict[str, str]] | None:
    """(the sha256 of the plan committed for `cfg`, the probe receipts it
    binds); None where none is committed or its file cannot be read (train
    then says why, with the plan's other checks)."""
    read = _read(cfg)
    if read.entry is None or not isinstance(read.document, dict):
        return None
    return read.entry.digest, read.document.get("probe_receipts")


def training_inputs(cfg: Config, gate: str | None = None) -> dict[str, str]:
    """Tags naming the gate receipt and the inputs any training process (a
    probe too) depends on, or a refusal that says which is missing. `gate`:
    the receipt bound already (gate_receipt's `bound`)."""
    receipt = gate_receipt(cfg, bound=gate)
    prepared, seed = seeded_inputs(cfg)
    return {
        schema.TAG_REQUIRES_PREFIX + ledger.GATE: receipt.digest,
        schema.TAG_REQUIRES_PREFIX + ledger.INPUTS: prepared.digest,
        schema.TAG_SEED_SHA: seed.sha256,
    }


def training(cfg: Config) -> tuple[str, dict[str, str]]:
    """(the plan's sha256, the tags naming every commitment the training
    depends on), or a refusal naming what is missing or changed."""
    # In protocol order: a changed source is first a stale gate receipt, a
    # changed input file first an input that no longer verifies; each names it.
    # The plan's gate receipt, which may be older than the newest (gate_receipt's `bound`).
    read = _read(cfg)
    tags = training_inputs(cfg, planned_gate(cfg, read))
    sha = committed_plan(cfg, read)
    return sha, tags | {schema.TAG_PLAN: sha, schema.TAG_REQUIRES_PREFIX + ledger.PLAN: sha}


def _selected(plan_sha: str, book: ledger.Ledger) -> dict[str, ledger.Entry]:
    """Arm -> the plan's candidate entry; a selection is made once, and should
    the ledger hold more, the first counts."""
    entries: dict[str, ledger.Entry] = {}
    for e in candidates.committed(plan_sha, book):
        entries.setdefault(e.details.get("arm"), e)
    return entries


def selected_train_runs(plan_sha: str) -> dict[str, str]:
    """Arm -> the train run whose checkpoint the plan's selection took (empty before select)."""
    return {arm: e.details["train_run_id"] for arm, e in _selected(plan_sha, ledger.Ledger()).items()}


def selecting_run(plan_sha: str) -> str | None:
    """The select run that committed the plan's candidates (None before select)."""
    entries = _selected(plan_sha, ledger.Ledger())
    return next((e.details.get("select_run_id") for e in entries.values()), None)


def selection(cfg: Config, plan_sha: str, book: ledger.Ledger) -> candidates.Selection:
    """The committed candidates, after checking that their weights on disk still hash to them."""
    entries = _selected(plan_sha, book)
    missing = [arm for arm in ARMS if arm not in entries]
    if missing:
        raise RefusedError(
            f"no final candidates selected under plan {plan_sha[:12]} (missing: {', '.join(missing)})",
            hint=f"run `python -m coopstudy select {cfg.arguments}` first",
        )
    chosen = {}
    for arm in ARMS:
        e = entries[arm]
        cand = candidates.Candidate(arm, e.digest, Path(e.details["path"]), e.details["train_run_id"])
        what = f"the {arm} candidate selected at {candidates.when(e.time)} by select run {e.details['select_run_id']}"
        actual = candidates.weights_sha256(cand, what)
        if actual != cand.sha256:
            raise RefusedError(
                f"{what}: the weights in {cand.path} hash to {actual[:12]}, not the selected {cand.sha256[:12]}; "
                "they changed after selection, refusing to score them",
                hint=f"delete {cand.path} to have it brought back from the `{schema.ART_CHECKPOINT}` artifact of train run {cand.train_run_id}",
            )
        chosen[arm] = cand
    return candidates.Selection(chosen, entries[ARMS[0]].details["select_run_id"])
