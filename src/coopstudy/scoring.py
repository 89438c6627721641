"""Scoring one model: greedy answers to the final test, judged by each family's
own reasoning-gym verifier, and the retention probes' per-document NLL.

Generation is batched: prompts sorted by their tokens, the prefix a batch
shares computed once, each prompt's own tokens left-padded after it, decoded
with a KV cache, each sequence stopped at its end of turn. Run in fp32, it gives
the same tokens as one prompt at a time (`python -m coopstudy bench generate`
checks this and measures the speed-up).

Answer extraction is the same for every family (see `extract_answer`); a case
is correct only when the verifier gives it full credit (1.0).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from coopstudy import machine, ui, workspace
from coopstudy.config import EvaluateConfig
from coopstudy.errors import UserError, labelled
from coopstudy.inputs import chat, seed, tasks
from coopstudy.record import schema

END_OF_TURN = "<|im_end|>"
"""ChatML's end of turn; generation also stops at the tokenizer's eos."""
LM_HEAD_CHUNK = 1024
"""Target positions per lm_head call in the NLL: bounds the (positions x vocab) logits."""

# "Answer: 12", "the answer is 12", "Final answer = 12" (the last one counts).
_ANSWER_MARKER = re.compile(r"\banswer\s*(?:is\b\s*:?|:|=)\s*", re.IGNORECASE)
# A number as the numeric verifiers read it: sign, thousands commas, decimals;
# not a digit run inside a word ("x2") or after a decimal point.
_NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:,\d{3})*(?:\.\d+)?")
_DECORATION = " \t\r\n\"'`*.$"


"""Called with the number of items just finished."""


# --- answers ---------------------------------------------------------------
INTEGER, NUMBER, TEXT = "integer", "number", "text"
"""The shapes of an expected answer `extract_answer` reads an output by."""


def answer_shape(expected: str) -> str:
    """INTEGER, NUMBER or TEXT: the expected answer's shape, never its value."""
    text = str(expected).strip().replace(",", "")
    try:
        number = Decimal(text)
    except InvalidOperation:
        return TEXT
    if not number.is_finite():
        return TEXT
    return NUMBER if "." in text or "e" in text.lower() else INTEGER


def _canonical(number: str, shape: str) -> str:
    """A number as every family's verifier takes it: no plus sign, no
    thousands commas, and no all-zero decimals where an integer is expected
    (gcd's, letter_counting's and count_bits' verifiers compare text, and give
    "+1", "1,000" or "1.0" partial credit only)."""
    number = number.lstrip("+").replace(",", "")
    return re.sub(r"\.0+$", "", number) if shape == INTEGER else number


def extract_answer(output: str, shape: str) -> str:
    """The answer in a model's output, by one rule for every family.

    1. Only the text before the end of turn counts, stripped.
    2. If it says "answer: X", "answer is X" or "answer = X", only what follows
       the last such marker, up to the end of that line, counts.
    3. When the expected answer is a number (`answer_shape`), the last number
       in that text is the answer ("16 * 33 = 528" gives 528), written as the
       verifiers take it (`_canonical`: "+1,000.0" gives 1000 where an
       integer is expected); otherwise the text itself, without surrounding
       quotes, markdown emphasis or a final period.
    4. No number where one is expected: the text as it is (the verifier
       scores it, usually 0).
    """
    text = output.split(END_OF_TURN, 1)[0].strip()
    markers = list(_ANSWER_MARKER.finditer(text))
    if markers:
        text = text[markers[-1].end() :].split("\n", 1)[0].strip()
    if shape != TEXT:
        numbers = _NUMBER.findall(text)
        if numbers:
            return _canonical(numbers[-1], shape)
    return text.strip(_DECORATION) or text


def score_case(case: dict[str, Any], output: str) -> dict[str, Any]:
    """One row of the test table: the extracted answer and the verifier's score."""
    entry = case["entry"]
    answer = extract_answer(output, answer_shape(entry["answer"]))
    score = tasks.score_answer(case["family"], answer, entry)
    return {
        "case_id": case["case_id"],
        "family": case["family"],
        "prompt": case["messages"][-1]["content"],
        "output": output,
        "answer": answer,
        "expected": str(entry["answer"]),
        "score": score,
        # The pre-registered rule: partial credit is not correct.
        "correct": score >= 1.0,
    }


# --- models ------------------------------------------------------------------
def _cannot_load(name: str, what: str, path: Path, err: BaseException, *, remade: bool = True) -> UserError:
    """A model folder that cannot be loaded and, where the study made it and
    `remade` (its weights hash as recorded, so only its other files can be
    what is wrong), how to have it made again: a seed is converted again, a
    checkpoint comes back from its train run's artifact."""
    hint = None
    if remade:
        hint = seed.remake_hint(path)
        if hint is None and path.is_relative_to(workspace.home() / workspace.CHECKPOINTS):
            hint = f"delete {path} to have it brought back from its train run's `{schema.ART_CHECKPOINT}` artifact"
    return UserError(f"{name}: the {what} in {path} cannot be loaded ({labelled(err)})", hint=hint)


def load_tokenizer(path: Path, name: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as err:  # noqa: BLE001 - any failure means the same: no usable tokenizer there
        raise _cannot_load(name, "tokenizer", path, err) from None


def check_tokenizer(tokenizer: Any, reference: Any, name: str) -> None:
    """Refuse a tokenizer that would read or write tokens differently from the seed's."""
    problems = []
    if len(tokenizer) != len(reference):
        problems.append(f"{len(tokenizer)} tokens, the seed's has {len(reference)}")
    elif tokenizer.get_vocab() != reference.get_vocab():
        problems.append("the same size but different tokens")
    for attr in ("bos_token", "eos_token", "pad_token"):
        mine, theirs = getattr(tokenizer, attr), getattr(reference, attr)
        if mine != theirs:
            problems.append(f"{attr} {mine!r}, the seed's is {theirs!r}")
    if sorted(tokenizer.all_special_tokens) != sorted(reference.all_special_tokens):
        problems.append("different special tokens")
    if tokenizer.chat_template != reference.chat_template:
        problems.append("a different chat template")
    if problems:
        raise UserError(f"{name}: its tokenizer does not match the seed model's ({'; '.join(problems)})")


def check_weights(path: Path, name: str) -> None:
    """Refuse weights whose safetensors header is unreadable or does not fit
    the file: a cheap check of every model before any is scored."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"{name}: no *.safetensors weights in {path}")
    for file in files:
        try:
            with safe_open(file, framework="pt") as weights:
                weights.keys()
        except Exception as err:  # noqa: BLE001 - a bad header raises several error types
            # The weights hash as the run recorded them: its artifact holds the same bytes.
            raise _cannot_load(name, "checkpoint", path, err, remade=False) from None


def load_model(path: Path, name: str, tokenizer: Any) -> Any:
    """The model in fp32 on the evaluation device; a UserError for anything
    missing, unreadable or too small for its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from coopstudy.numerics import onednn

    ui.hide_transformers_bars()
    if not (path / "config.json").is_file():
        raise UserError(f"{name}: {path} is not a model directory (no config.json)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        # Scoring is fp32 on CPU, where MKL's sgemm can run at half oneDNN's
        # speed and a batch's activations are mapped afresh at every layer:
        # together about half of the evaluation's time (machine.keep_freed_memory).
        machine.keep_freed_memory()
    try:
        # fp32, so that batched and one-at-a-time decoding pick the same tokens.
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except Exception as err:  # noqa: BLE001 - truncated file, bad header, missing tensor: all "cannot load"
        raise _cannot_load(name, "checkpoint", path, err) from None
    if model.get_input_embeddings().num_embeddings < len(tokenizer):
        raise UserError(
            f"{name}: the model embeds {model.get_input_embeddings().num_embeddings} tokens, "
            f"its tokenizer has {len(tokenizer)}"
        )
    # generate() fills what its settings leave unset from the model's own generation_config.json
    # (a repetition penalty, a minimum length): a file beside the hashed weights would decide how
    # one model is decoded. Every model is decoded by generate()'s settings alone.
    model.generation_config = GenerationConfig()
    model = model.to(device).eval()
    if device == "cpu":
        onednn.route_linears(model)
    return model


def stop_ids(tokenizer: Any) -> list[int]:
    """Token ids that end a turn: the tokenizer's eos and ChatML's <|im_end|>."""
    end = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    # A tokenizer without <|im_end|> looks it up as its unk. Its eos stays whatever it is: a base
    # model's (SmolLM2-1.7B's) eos, unk and bos are one <|endoftext|>, and dropped, its seed would
    # write on past the end of its answer into text whose last number is scored.
    ids = {tokenizer.eos_token_id, end if end != tokenizer.unk_token_id else None}
    return sorted(i for i in ids if isinstance(i, int))


def padding_id(tokenizer: Any) -> int:
    """Padding is masked out; a tokenizer without a pad token pads with its end of turn."""
    return stop_ids(tokenizer)[0] if tokenizer.pad_token_id is None else tokenizer.pad_token_id


# --- generation ----------------------------------------------------------------
@dataclass(frozen=True)
class Generated:
    tokens: list[int]
    """Generated ids before the end of turn (which is not included)."""
    finished: bool
    """False when max_new_tokens cut the answer short."""


def shared_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """How many leading tokens all `prompts` share, short of the shortest's
    last: generation starts from a token of each prompt's own."""
    first = prompts[0]
    limit = min(len(p) for p in prompts) - 1
    n = 0
    while n < limit and all(p[n] == first[n] for p in prompts):
        n += 1
    return n


def generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    batch_size: int,
    stop: Sequence[int],
    pad_id: int,
    progress: ui.Advance | None = None,
) -> list[Generated]:
    """Greedy continuations of token prompts, in the prompts' order."""
    import torch
    from transformers import GenerationConfig

    settings = GenerationConfig(
        do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, eos_token_id=list(stop), pad_token_id=pad_id
    )
    device = next(model.parameters()).device
    # Sorted by their tokens: the prompts of a batch share a long prefix (the
    # chat template's system turn, a family's wording), computed once per
    # batch, and a family's prompts have similar lengths (little padding).
    order = sorted(range(len(prompts)), key=lambda i: (list(prompts[i]), i))
    out: list[Generated | None] = [None] * len(prompts)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        shared = shared_prefix([prompts[i] for i in rows])
        width = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        ids[:, :shared] = torch.tensor(list(prompts[rows[0]][:shared]), dtype=torch.long)
        mask[:, :shared] = 1
        for r, i in enumerate(rows):
            # Padding between the shared prefix and each prompt's own tokens:
            # every prompt ends where generation starts, and generate()
            # derives position ids from the mask, so a padded prompt sees the
            # same positions as it would alone.
            own = list(prompts[i][shared:])
            ids[r, width - len(own) :] = torch.tensor(own, dtype=torch.long)
            mask[r, width - len(own) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        with torch.inference_mode():
            # The shared prefix is computed once, its keys and values copied to every row.
            cache = None
            if shared:
                cache = model.get_decoder()(input_ids=ids[:1, :shared], use_cache=True).cache
                cache.batch_repeat_interleave(len(rows))
            seqs = model.generate(input_ids=ids, attention_mask=mask, generation_config=settings, cache=cache)
        for r, i in enumerate(rows):
            new = seqs[r, width:].tolist()
            cut = next((k for k, t in enumerate(new) if t in stop), None)
            out[i] = Generated(new if cut is None else new[:cut], cut is not None)
        if progress:
            progress(len(rows))
    return out  # type: ignore[return-value]


# --- retention ---------------------------------------------------------------------
def retention_nll(model: Any, documents: Sequence[Any], *, batch_size: int, progress: ui.Advance | None = None) -> list[dict[str, Any]]:
    """Per document: the NLL (nats) of its target tokens (weight > 0) given the
    tokens before them, summed and averaged per token. Targets count equally,
    whatever their weight: the probe measures the assistant turns as written.

    `batch_size` documents at a time, packed into one row as training packs
    a microbatch (batching.pack, objective.packed_hidden): every document
    sees only itself and every computed position is a real token (the right
    padding this replaced computed 1.34 positions per real token on the CPU
    preset's probes, 64 to a batch, sorted by length)."""
    import torch

    from coopstudy.numerics import batching, objective

    device = next(model.parameters()).device
    # logits = lm_head(final hidden state), as in Llama; a model that rescales
    # or caps its logits would need its own head here.
    head = model.get_output_embeddings()
    sums = [0.0] * len(documents)
    counts = [0] * len(documents)
    for start in range(0, len(documents), batch_size):
        rows = range(start, min(start + batch_size, len(documents)))
        mb = batching.pack([documents[i] for i in rows], device=device)
        # Position t predicts token t + 1; pack weighs every document's first
        # token 0, so no prediction crosses a document boundary.
        targets = mb.weights[0, 1:] > 0
        # The document of each predicting position: the row's bounds say where each lies.
        doc_of = torch.repeat_interleave(torch.tensor(rows), torch.tensor(mb.bounds).diff())[1:][targets.cpu()]
        if len(doc_of):
            with torch.inference_mode():
                picked = objective.packed_hidden(model, mb.input_ids, mb.position_ids, mb.bounds)[0, :-1][targets]
                # Only the hidden states that predict a target go through the
                # vocabulary projection: the full logits would be tokens x vocab.
                expected = mb.input_ids[0, 1:][targets]
                nll = torch.cat([
                    torch.nn.functional.cross_entropy(head(picked[k : k + LM_HEAD_CHUNK]).float(), expected[k : k + LM_HEAD_CHUNK], reduction="none")
                    for k in range(0, len(expected), LM_HEAD_CHUNK)
                ])
            for i, value in zip(doc_of.tolist(), nll.double().cpu().tolist()):
                sums[i] += value
                counts[i] += 1
        if progress:
            progress(len(rows))
    return [
        {
            "doc_id": doc.doc_id,
            "kind": doc.kind,
            "tokens": counts[i],
            "nll_sum": sums[i],
            "mean_nll": sums[i] / counts[i] if counts[i] else None,
        }
        for i, doc in enumerate(documents)
    ]


# --- one model, end to end -------------------------------------------------------
@dataclass(frozen=True)
class Scored:
    cases: list[dict[str, Any]]
    retention: list[dict[str, Any]]
    metrics: dict[str, float]


def summarize(cases: Sequence[dict[str, Any]], retention: Sequence[dict[str, Any]], families: Sequence[str]) -> dict[str, float]:
    """Accuracy overall and per family; mean retention NLL, document-weighted
    like the retention screen."""
    metrics = {schema.M_ACCURACY: sum(c["correct"] for c in cases) / len(cases)}
    for fam in families:
        mine = [c for c in cases if c["family"] == fam]
        if mine:
            metrics[schema.M_ACCURACY_PREFIX + fam] = sum(c["correct"] for c in mine) / len(mine)
    scored = [r["mean_nll"] for r in retention if r["tokens"]]
    if scored:
        metrics[schema.M_RETENTION_NLL] = sum(scored) / len(scored)
    return metrics


def score_model(
    model: Any,
    tokenizer: Any,
    test: Sequence[dict[str, Any]],
    retention: Sequence[Any],
    settings: EvaluateConfig,
    label: str,
    test_name: str = "final test",
) -> Scored:
    """The test table, the retention table and the metrics of one model;
    `test_name` says in its progress which test set it answers."""
    import torch

    if not test:
        raise UserError(f"the {test_name} set is empty; nothing to score")
    prompts = [chat.prompt_ids(tokenizer, case["messages"]) for case in test]
    start = time.perf_counter()
    with ui.progress(f"{label}: {test_name}", len(test)) as advance:
        generated = generate(
            model, prompts, max_new_tokens=settings.max_new_tokens, batch_size=settings.batch_size,
            stop=stop_ids(tokenizer), pad_id=padding_id(tokenizer), progress=advance,
        )
    seconds = time.perf_counter() - start
    cases = []
    for case, gen in zip(test, generated):
        row = score_case(case, tokenizer.decode(gen.tokens, skip_special_tokens=True))
        cases.append(row | {"finished": gen.finished})
    with ui.progress(f"{label}: retention", len(retention)) as advance:
        nll = retention_nll(model, retention, batch_size=settings.batch_size, progress=advance)
    families = list(dict.fromkeys(c["family"] for c in test))
    metrics = summarize(cases, nll, families) | {
        schema.M_TEST_CASES: len(cases),
        schema.M_GENERATE_SECONDS: seconds,
        schema.M_GENERATE_ITEMS_PER_SECOND: len(cases) / seconds if seconds > 0 else math.nan,
        schema.M_EVAL_THREADS: torch.get_num_threads(),
    }
    return Scored(cases, nll, metrics)
