"""Scoring: answer extraction and the families' own verifiers, batched greedy
generation against one prompt at a time, retention NLL against a plain
per-document computation, and the evaluate step on the tiny preset."""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import reasoning_gym
import torch
from fixtures import PLAN, fake_train_run, faults_of_a_large_tensor_made_again

from coopstudy import cli, config, scoring, workspace
from coopstudy.commit import require
from coopstudy.errors import UserError
from coopstudy.inputs import chat, tasks
from coopstudy.numerics import onednn
from coopstudy.record import schema, store


# --- answers ------------------------------------------------------------------
I, N, T = scoring.INTEGER, scoring.NUMBER, scoring.TEXT


@pytest.mark.parametrize(
    ("output", "shape", "expected"),
    [
        ("42", I, "42"),
        ("  42\n", I, "42"),
        ("The answer is 42.", I, "42"),
        ("16 * 33 = 528", I, "528"),  # extra text: the last number counts
        ("Let me see: 3 + 4 = 7\nAnswer: 7\nThat was easy, 100%", I, "7"),  # the marker's line only
        ("7 - 4 - 9 = -6", I, "-6"),
        ("x2 is 3.5", N, "3.5"),  # no number glued to a word
        ("I do not know", I, "I do not know"),  # no number: the text, for the verifier to reject
        ("**blue**.", T, "blue"),
        ("Final answer: \"cat\"", T, "cat"),
        ("42<|im_end|>junk 7", I, "42"),  # only the text before the end of turn
        # Written as every verifier takes it: before, gcd's gave "+1" 0.5 and "1.0" 0.33.
        ("The answer is +1.", I, "1"),
        ("Answer: 1,000", I, "1000"),
        ("Answer: 12.0", I, "12"),
        ("Answer: -4.00", I, "-4"),
        ("Answer: 12.0", N, "12.0"),  # a decimal answer keeps its decimals
        ("Answer: 2.50", I, "2.50"),  # not an integer: for the verifier to judge
    ],
)
def test_extract_answer_one_rule_for_every_family(output, shape, expected):
    assert scoring.extract_answer(output, shape) == expected


@pytest.mark.parametrize(
    ("expected", "shape"),
    [("7", I), ("-4", I), ("1,000", I), ("3.5", N), ("1e3", N), ("cat", T), ("NaN", T), ("", T)],
)
def test_answer_shape_is_the_expected_answers_shape(expected, shape):
    assert scoring.answer_shape(expected) == shape


FAMILIES = ("gcd", "products", "letter_counting", "chain_sum")


def _case(family: str, index: int = 0) -> dict:
    entry = reasoning_gym.create_dataset(family, seed=123, size=index + 1)[index]
    return {"case_id": f"{family}/{index}", "family": family, "messages": tasks.task_messages(entry["question"]), "entry": entry}


@pytest.mark.parametrize("family", FAMILIES)
def test_scores_are_the_family_verifiers_own(family):
    case = _case(family)
    right = case["entry"]["answer"]
    verifier = reasoning_gym.get_score_answer_fn(family)
    outputs = {
        "right": (right, True),
        "right with text around it": (f"Let me compute. The answer is {right}.\nHope that helps!", True),
        "right after working": (f"so 1 + 2 = 3, and the result is {right}", True),
        "wrong": (str(int(right) + 1), False),
        # The verifier gives partial credit when the expected answer appears
        # inside a longer one; only full credit is correct.
        "contains the right digits": (right + "0", False),
        "right, with a plus sign and zero decimals": (f"Answer: +{right.lstrip('-')}.0" if not right.startswith("-") else f"Answer: {right}.0", True),
    }
    for what, (output, correct) in outputs.items():
        row = scoring.score_case(case, output)
        assert row["score"] == verifier(row["answer"], case["entry"]), what
        assert row["correct"] is correct, (what, row)
        assert row["correct"] == (row["score"] == 1.0)
    partial = scoring.score_case(case, right + "0")
    assert 0 < partial["score"] < 1


def test_test_table_row_has_what_the_report_reads():
    row = scoring.score_case(_case("gcd"), "no idea")
    assert set(row) >= {"case_id", "family", "prompt", "output", "answer", "expected", "score", "correct"}
    assert row["prompt"].endswith(tasks.INSTRUCTION)
    assert row["score"] == 0.0 and row["correct"] is False


# --- a tiny model with the real tokenizer ----------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tiny_seed_home):
    from transformers import AutoTokenizer

    (seed_dir,) = (tiny_seed_home / "seeds").glob("random-*")
    return AutoTokenizer.from_pretrained(seed_dir)


@pytest.fixture(scope="module", params=["torch", "onednn"])
def model(request, tokenizer):
    """The test model with torch's linear layers, and with oneDNN's as
    `scoring.load_model` gives it on CPU: batching must not change what
    either computes."""
    plain = _plain_model(tokenizer)
    if request.param == "onednn":
        assert onednn.route_linears(plain) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer; the head
    return plain


def _plain_model(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    # A larger init than the seed's makes the logits peaked: greedy decoding
    # then writes varied text instead of repeating one token, so a wrong
    # position or a leaking pad would change the outputs.
    config_ = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2, tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config_).eval()


def _prompts(tokenizer) -> list[list[int]]:
    questions = ["What is 2+2?", "Find the GCD of 12 and 18. This question is much longer than the others are.", "hi", "Count the r in strawberry"]
    return [chat.prompt_ids(tokenizer, tasks.task_messages(q)) for q in questions * 2]


def _plain_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """One prompt alone through transformers' generate: no padding, no shared prefix."""
    with torch.inference_mode():
        seq = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return seq[0, len(prompt) :].tolist()


def test_a_tokenizer_whose_eos_is_its_unk_still_stops_on_it(tokenizer):
    # A base model's tokenizer (SmolLM2-1.7B's): eos, unk and bos are one <|endoftext|>.
    # Before, its eos was dropped with the unk an unknown <|im_end|> looks up as.
    assert scoring.stop_ids(tokenizer) == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    base = copy.deepcopy(tokenizer)
    base.eos_token = base.unk_token
    assert base.eos_token_id == base.unk_token_id
    assert scoring.stop_ids(base) == sorted([base.unk_token_id, base.convert_tokens_to_ids("<|im_end|>")])


def test_batched_generation_gives_the_same_tokens_as_one_prompt_at_a_time(model, tokenizer):
    prompts = _prompts(tokenizer)
    assert len({len(p) for p in prompts}) > 1  # padding is exercised
    assert scoring.shared_prefix(prompts) > 0  # and the shared prefix, computed once per batch
    common = {"max_new_tokens": 12, "stop": scoring.stop_ids(tokenizer), "pad_id": scoring.padding_id(tokenizer)}
    alone = scoring.generate(model, prompts, batch_size=1, **common)
    batched = scoring.generate(model, prompts, batch_size=3, **common)
    assert batched == alone
    assert [g.tokens for g in alone] == [_plain_greedy(model, p, 12) for p in prompts]
    assert len({tuple(g.tokens) for g in alone}) > 1
    assert all(len(g.tokens) == 12 and not g.finished for g in alone)


def test_a_generation_config_beside_the_weights_does_not_change_how_a_model_is_decoded(tiny_seed_home, tokenizer, tmp_path):
    # Before, generate() took what its settings left unset from the folder's generation_config.json:
    # a file the weights' hash does not cover decided one model's answers.
    (seed_dir,) = (tiny_seed_home / "seeds").glob("random-*")
    tuned = shutil.copytree(seed_dir, tmp_path / "tuned")
    (tuned / "generation_config.json").write_text(json.dumps({"no_repeat_ngram_size": 1, "repetition_penalty": 5.0, "min_new_tokens": 12}))
    prompts = _prompts(tokenizer)[:6]
    common = {"max_new_tokens": 12, "batch_size": 3, "stop": scoring.stop_ids(tokenizer), "pad_id": scoring.padding_id(tokenizer)}
    plain = scoring.generate(scoring.load_model(seed_dir, "seed", tokenizer), prompts, **common)
    assert scoring.generate(scoring.load_model(tuned, "tuned", tokenizer), prompts, **common) == plain


def test_the_shared_prefix_leaves_every_prompt_a_token_of_its_own():
    assert scoring.shared_prefix([[1, 2, 3, 4], [1, 2, 3, 5, 6]]) == 3
    assert scoring.shared_prefix([[1, 2, 3], [1, 2, 3, 4]]) == 2
    assert scoring.shared_prefix([[7, 2], [1, 2]]) == 0
    assert scoring.shared_prefix([[1, 2, 3]]) == 2


def test_generation_stops_at_end_of_turn(model, tokenizer):
    prompts = _prompts(tokenizer)[:4]
    pad = scoring.padding_id(tokenizer)
    free = scoring.generate(model, prompts, max_new_tokens=12, batch_size=4, stop=scoring.stop_ids(tokenizer), pad_id=pad)
    # Pretend the fourth token the first prompt produces ends a turn.
    stop = free[0].tokens[3]
    cut = scoring.generate(model, prompts, max_new_tokens=12, batch_size=4, stop=[stop], pad_id=pad)
    assert cut[0].finished and cut[0].tokens == free[0].tokens[: free[0].tokens.index(stop)]
    untouched = [(before, after) for before, after in zip(free[1:], cut[1:]) if stop not in before.tokens]
    assert untouched, "every prompt produced the stop token; pick another"
    for before, after in untouched:
        assert after == before


@dataclass(frozen=True)
class Doc:
    doc_id: str
    kind: str
    input_ids: tuple[int, ...]
    weights: tuple[float, ...]


def _plain_nll(model, doc: Doc) -> tuple[float, int]:
    """One document alone, no padding: the sum of -log p(token i | tokens < i) over targets."""
    with torch.no_grad():
        logits = model(torch.tensor([doc.input_ids])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    targets = [i for i in range(1, len(doc.input_ids)) if doc.weights[i] > 0]
    return -sum(logp[i - 1, doc.input_ids[i]].item() for i in targets), len(targets)


def test_retention_nll_equals_one_document_at_a_time(model, tokenizer):
    gen = torch.Generator().manual_seed(1)
    docs = []
    for k, n in enumerate((40, 7, 23, 40, 15)):
        ids = torch.randint(0, len(tokenizer), (n,), generator=gen).tolist()
        weights = [0.0] * n
        for i in range(n // 3, n):
            weights[i] = 1.0 if i % 4 else 0.0  # two assistant turns with a prompt token between
        docs.append(Doc(f"doc{k}", "retention", tuple(ids), tuple(weights)))
    rows = scoring.retention_nll(model, docs, batch_size=3)
    assert [r["doc_id"] for r in rows] == [d.doc_id for d in docs]
    for doc, row in zip(docs, rows):
        total, count = _plain_nll(model, doc)
        assert row["tokens"] == count
        assert row["nll_sum"] == pytest.approx(total, rel=1e-5)
        assert row["mean_nll"] == pytest.approx(total / count, rel=1e-5)


def test_a_model_loaded_for_scoring_on_cpu_computes_through_onednn(tokenizer, tmp_path):
    # What evaluate scores: every linear layer through oneDNN, the logits
    # torch's to fp32 rounding.
    plain = _plain_model(tokenizer)
    plain.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = scoring.load_model(tmp_path, "seed", tokenizer)
    assert {type(m) for m in loaded.modules() if isinstance(m, torch.nn.Linear)} == {onednn.Linear}
    ids = torch.tensor([_prompts(tokenizer)[1]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_scoring_process_keeps_the_memory_it_frees():
    # A batch's activations are made again at every layer; glibc's default
    # would unmap and fault each of them anew.
    kept = faults_of_a_large_tensor_made_again(setup="from coopstudy import machine; assert machine.keep_freed_memory()")
    default = faults_of_a_large_tensor_made_again()
    assert kept < 100 < default, (kept, default)


def test_summary_is_strict_accuracy_per_family_and_document_weighted_nll():
    cases = [
        {"family": "gcd", "correct": True},
        {"family": "gcd", "correct": False},
        {"family": "products", "correct": False},
        {"family": "products", "correct": False},
    ]
    retention = [{"tokens": 10, "mean_nll": 1.0}, {"tokens": 1000, "mean_nll": 3.0}]
    m = scoring.summarize(cases, retention, ["gcd", "products"])
    assert m[schema.M_ACCURACY] == 0.25
    assert m[schema.M_ACCURACY_PREFIX + "gcd"] == 0.5
    assert m[schema.M_ACCURACY_PREFIX + "products"] == 0.0
    assert m[schema.M_RETENTION_NLL] == 2.0


def test_a_tokenizer_unlike_the_seeds_is_refused(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(tmp_path)
    other = AutoTokenizer.from_pretrained(tmp_path)
    scoring.check_tokenizer(other, tokenizer, "control")  # a copy matches
    other.add_tokens(["<|extra|>"])
    with pytest.raises(UserError, match=r"control: its tokenizer does not match the seed model's \(49153 tokens, the seed's has 49152\)"):
        scoring.check_tokenizer(other, tokenizer, "control")


def test_an_empty_test_set_is_refused(model, tokenizer):
    with pytest.raises(UserError, match="final test set is empty"):
        scoring.score_model(model, tokenizer, [], [], config.load("tiny").evaluate, "seed")


# --- the evaluate step on tiny ---------------------------------------------------------
def _runs(filter_string: str) -> list:
    return store.search_runs("coopstudy", filter_string)


@pytest.fixture
def selected(prepared_tiny, planned):
    """Prepared tiny inputs, both arms 'trained' (checkpoints that are copies
    of the seed, recorded as train runs would record them) and selected."""
    cfg = config.load("tiny")
    (seed_dir,) = (Path(prepared_tiny.home) / "seeds").glob("random-*")
    for arm in ("control", "compressed"):
        fake_train_run(cfg, arm, seed_dir)
    assert cli.main(["select", "--preset", "tiny"]) == 0
    return cfg


@pytest.fixture
def selected_apart(prepared_tiny, planned, tmp_path):
    """As `selected`, but the compressed arm's checkpoint is the seed with its
    final norm scaled: weights evaluate must load and score as their own."""
    from safetensors.torch import load_file, save_file

    cfg = config.load("tiny")
    (seed_dir,) = (Path(prepared_tiny.home) / "seeds").glob("random-*")
    apart = tmp_path / "apart"
    shutil.copytree(seed_dir, apart)
    weights = load_file(apart / workspace.WEIGHTS_FILE)
    (norm,) = [k for k in weights if k.endswith("norm.weight") and not k.startswith("model.layers.")]
    weights[norm] = weights[norm] * 1.5
    save_file(weights, apart / workspace.WEIGHTS_FILE, metadata={"format": "pt"})
    fake_train_run(cfg, "control", seed_dir)
    fake_train_run(cfg, "compressed", apart)
    assert cli.main(["select", "--preset", "tiny"]) == 0
    return cfg


def _child_runs() -> dict[str, object]:
    return {r.data.tags[schema.TAG_MODEL]: r for r in _runs(f"tags.`{schema.TAG_MODEL}` != ''")}


def _table(run, artifact: str) -> list[dict]:
    raw = json.loads(store.download_artifact(run.info.run_id, artifact).read_text())
    return [dict(zip(raw["columns"], row)) for row in raw["data"]]


@pytest.mark.slow
def test_evaluate_scores_three_models_in_child_runs(selected_apart, capsys):
    assert cli.main(["evaluate", "--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    for name in ("seed", "control", "compressed"):
        assert f"{name} " in out
    (parent,) = [r for r in _runs(f"tags.`{schema.TAG_STAGE}` = 'evaluate'") if schema.TAG_MODEL not in r.data.tags]
    assert parent.info.status == "FINISHED"
    # What it spent, which the report sets against the budget: one device for as long as it held it.
    spent = parent.data.metrics
    assert spent[schema.M_COMPLETE_SECONDS] > 1.0 and spent[schema.M_DEVICE_SECONDS] == spent[schema.M_COMPLETE_SECONDS]
    assert spent[schema.M_COST_USD] == 0.0  # tiny prices a device at 0
    children = _child_runs()
    assert set(children) == {"seed", "control", "compressed"}
    prepared_test = [json.loads(line) for line in next(Path(workspace.home(), "prepared").glob("*/test.jsonl")).read_text().splitlines()]
    families = config.load("tiny").data.families
    for name, run in children.items():
        assert run.info.status == "FINISHED"
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert run.data.tags[schema.TAG_STAGE] == schema.STAGE_EVALUATE
        assert run.data.tags[schema.TAG_PLAN] == PLAN
        m = run.data.metrics
        assert set(m) >= {schema.M_ACCURACY, schema.M_RETENTION_NLL, *(schema.M_ACCURACY_PREFIX + f for f in families)}
        # One value each: the logged model's metrics are the run's, not a second point beside them.
        assert all(len(store.client().get_metric_history(run.info.run_id, k)) == 1 for k in m), name
        cases = _table(run, schema.ART_TEST_TABLE)
        assert [c["case_id"] for c in cases] == [c["case_id"] for c in prepared_test]
        assert all(c["correct"] == (c["score"] == 1.0) for c in cases)
        assert m[schema.M_ACCURACY] == sum(c["correct"] for c in cases) / len(cases)
        docs = _table(run, schema.ART_RETENTION_TABLE)
        assert len(docs) == config.load("tiny").data.retention_docs
        assert all(d["tokens"] > 0 and d["mean_nll"] == pytest.approx(d["nll_sum"] / d["tokens"]) for d in docs)
    # Each child scored its own weights: the control's checkpoint is a copy of
    # the seed (the same scores, document by document), the compressed arm's
    # is not (other NLLs), and each run names the hash it loaded.
    (select,) = _runs(f"tags.`{schema.TAG_STAGE}` = '{schema.STAGE_SELECT}'")
    ledger_shas = {arm: select.data.tags[schema.TAG_CANDIDATE_PREFIX + arm] for arm in config.ARMS}
    shas = {name: run.data.tags[schema.TAG_CHECKPOINT_SHA] for name, run in children.items()}
    assert shas == {"seed": shas["control"], **ledger_shas} and shas["compressed"] != shas["seed"]
    nll = {name: [d["nll_sum"] for d in _table(run, schema.ART_RETENTION_TABLE)] for name, run in children.items()}
    assert nll["control"] == nll["seed"] and nll["compressed"] != nll["seed"]
    # Once per plan, as training: the screens read the first evaluation, so a second would be
    # spent for nothing (or a try for other numbers where scoring does not repeat).
    assert cli.main(["evaluate", "--preset", "tiny"]) == 2
    said = (f"the models were evaluated under plan {PLAN[:12]} (evaluate run {parent.info.run_id}): an evaluation is made once per "
            "plan, the first one the screens read; go on: `python -m coopstudy report --preset tiny`")  # fmt: skip
    assert capsys.readouterr().err.strip() == f"coopstudy evaluate: error: {said}"
    assert len(_runs(f"tags.`{schema.TAG_MODEL}` != ''")) == 3  # nothing scored again


@pytest.mark.slow
def test_an_evaluate_stopped_after_a_model_takes_its_scores_when_run_again(selected, capsys, monkeypatch):
    # Before, every model was scored again: the seed's minutes spent on a run the report lists as evidence.
    score, scored = scoring.score_model, []

    def stopped_at_control(model, tokenizer, test, retention, settings, label, *rest):
        if label == "control":
            raise KeyboardInterrupt
        return score(model, tokenizer, test, retention, settings, label, *rest)

    monkeypatch.setattr(scoring, "score_model", stopped_at_control)
    assert cli.main(["evaluate", "--preset", "tiny"]) == 130
    (seed,) = [r for r in _runs(f"tags.`{schema.TAG_MODEL}` = 'seed'")]
    assert seed.info.status == "FINISHED"
    monkeypatch.setattr(scoring, "score_model", lambda *args: scored.append(args[5]) or score(*args))
    capsys.readouterr()
    assert cli.main(["evaluate", "--preset", "tiny"]) == 0
    assert scored == ["control", "compressed"]
    out = capsys.readouterr().out
    assert f"(run {seed.info.run_id}, an earlier evaluate's: taken, not scored again)" in out, out
    (parent,) = _runs(f"tags.`{schema.TAG_STAGE}` = 'evaluate' and attributes.status = 'FINISHED' and tags.`{schema.TAG_MODEL}` IS NULL")
    assert parent.data.tags[schema.TAG_SCORED_BY_PREFIX + "seed"] == seed.info.run_id
    assert [r.info.status for r in _runs(f"tags.`{schema.TAG_MODEL}` = 'control'")] in (["FINISHED", "KILLED"], ["KILLED", "FINISHED"])


@pytest.mark.slow
def test_an_earlier_evaluation_that_lacks_part_of_its_record_is_refused_not_taken(selected, capsys):
    # Ended FINISHED while an outage kept its tables back: the report would read it as it is.
    from coopstudy.inputs.seed import resolve_seed

    client = store.client()
    experiment = client.get_experiment_by_name("coopstudy").experiment_id
    tags = {schema.TAG_STAGE: schema.STAGE_EVALUATE, schema.TAG_PLAN: PLAN, schema.TAG_MODEL: "seed",
            schema.TAG_CHECKPOINT_SHA: resolve_seed(selected).sha256}  # fmt: skip
    earlier = client.create_run(experiment, tags=tags).info.run_id
    client.log_metric(earlier, schema.M_ACCURACY, 0.5)
    client.set_terminated(earlier, "FINISHED")
    assert cli.main(["evaluate", "--preset", "tiny"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"coopstudy evaluate: error: model seed: its first finished evaluation, run {earlier}, which the report reads, lacks "
        f"{schema.M_GENERATE_ITEMS_PER_SECOND}, {schema.M_EVAL_THREADS}, {schema.ART_TEST_TABLE}, {schema.ART_RETENTION_TABLE}"
    )


def _failed_evaluate_error() -> str:
    (run,) = _runs(f"tags.`{schema.TAG_STAGE}` = 'evaluate' and attributes.status = 'FAILED'")
    # A failed evaluate spent its device time too.
    assert run.data.metrics[schema.M_DEVICE_SECONDS] == run.data.metrics[schema.M_COMPLETE_SECONDS] > 0
    return run.data.tags[schema.TAG_ERROR]


@pytest.mark.slow
def test_evaluate_refuses_a_candidate_whose_tokenizer_differs(selected, capsys):
    from transformers import AutoTokenizer

    (entry,) = [e for e in _ledger_candidates() if e.details["arm"] == "control"]
    path = Path(entry.details["path"])
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    tok.save_pretrained(path)  # the weights, which the selection hashed, are untouched
    assert cli.main(["evaluate", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "control: its tokenizer does not match the seed model's" in err
    assert "control: its tokenizer does not match" in _failed_evaluate_error()
    assert not _child_runs()  # refused before any model was scored


@pytest.mark.slow
def test_evaluate_refuses_a_checkpoint_that_cannot_be_loaded(prepared_tiny, planned, capsys):
    # Garbage weights recorded as such by a (broken) train run: the hashes
    # agree, so only loading can tell.
    cfg = config.load("tiny")
    (seed_dir,) = (Path(prepared_tiny.home) / "seeds").glob("random-*")
    fake_train_run(cfg, "control", seed_dir)
    fake_train_run(cfg, "compressed", seed_dir, corrupt=True)
    assert cli.main(["select", "--preset", "tiny"]) == 0
    assert cli.main(["evaluate", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "compressed: the checkpoint in" in err and "cannot be loaded" in err
    assert "Traceback" not in err
    assert "cannot be loaded" in _failed_evaluate_error()
    assert not _child_runs()  # refused before any model was scored


@pytest.mark.slow
def test_a_checkpoint_whose_other_files_are_spoilt_is_brought_back_as_the_refusal_says(prepared_tiny, planned, capsys):
    # The weights hash as selected, so only the tokenizer's file can be what is
    # wrong: the refusal says to delete the folder, and evaluate then brings
    # it back, whole, from the train run's checkpoint artifact.
    cfg = config.load("tiny")
    (seed_dir,) = (Path(prepared_tiny.home) / "seeds").glob("random-*")
    for arm in ("control", "compressed"):
        run_id, folder = fake_train_run(cfg, arm, seed_dir)
        store.client().log_artifacts(run_id, str(folder), schema.ART_CHECKPOINT)
    assert cli.main(["select", "--preset", "tiny"]) == 0
    (entry,) = [e for e in _ledger_candidates() if e.details["arm"] == "compressed"]
    folder = Path(entry.details["path"])
    (folder / "tokenizer.json").write_text("{ not json")
    capsys.readouterr()

    assert cli.main(["evaluate", "--preset", "tiny"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"coopstudy evaluate: error: compressed: the tokenizer in {folder} cannot be loaded ("), line
    assert line.endswith(f"; delete {folder} to have it brought back from its train run's `{schema.ART_CHECKPOINT}` artifact"), line
    assert not _child_runs()

    shutil.rmtree(folder)
    assert cli.main(["evaluate", "--preset", "tiny"]) == 0
    assert "bringing the folder back from the `checkpoint` artifact" in capsys.readouterr().out
    assert json.loads((folder / "tokenizer.json").read_text()) == json.loads((seed_dir / "tokenizer.json").read_text())
    assert len(_child_runs()) == 3


def test_evaluate_refuses_an_empty_test_set(planned, monkeypatch, capsys, tmp_path):
    from coopstudy.commit import candidates
    from coopstudy.inputs import data

    # An empty prepared test cannot come out of prepare (the config forbids
    # it), so the step is given one.
    monkeypatch.setattr(require, "selection", lambda cfg, plan_sha, book: candidates.Selection({}, "run0"))
    empty = data.Prepared(folder=tmp_path, digest="0" * 64, train=[], retention=[], test=[], schedule=[], manifest={})
    monkeypatch.setattr(require, "seeded_inputs", lambda cfg: (empty, None))  # refused before the seed is used
    assert cli.main(["evaluate", "--preset", "tiny"]) == 2
    assert f"the final test set in {tmp_path} is empty" in capsys.readouterr().err
    assert "is empty" in _failed_evaluate_error()


def _ledger_candidates():
    from coopstudy.commit import ledger

    return [e for e in ledger.Ledger().entries() if e.kind == ledger.CANDIDATE]
