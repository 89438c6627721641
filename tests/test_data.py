"""Token weights, disjoint splits, the schedule and truncation, on the tiny
preset's tokenizer (the SmolLM2 one)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from coopstudy import config
from coopstudy.errors import UserError
from coopstudy.inputs import chat, data, tasks

# The shared seed and prepared-store fixtures (made once per session).


@pytest.fixture
def tokenizer(tiny_seed):
    return AutoTokenizer.from_pretrained(tiny_seed.path)


def _rows(built: data.Built, name: str) -> list[dict]:
    return [json.loads(line) for line in built.files[name].decode().splitlines()]


def test_weights_of_a_hand_made_conversation(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Bye now"},
    ]
    ids, weights = chat.encode(tokenizer, messages, 2.0)
    header = [("<|im_start|>", 0), ("ass", 0), ("istant", 0), ("Ċ", 0)]
    expected = (
        [("<|im_start|>", 0), ("system", 0), ("Ċ", 0), ("Be", 0), ("Ġbrief", 0), (".", 0), ("<|im_end|>", 0), ("Ċ", 0)]
        + [("<|im_start|>", 0), ("user", 0), ("Ċ", 0), ("Hi", 0), ("<|im_end|>", 0), ("Ċ", 0)]
        + header
        + [("Hello", 2), ("Ġthere", 2), ("<|im_end|>", 2), ("Ċ", 0)]
        + [("<|im_start|>", 0), ("user", 0), ("Ċ", 0), ("By", 0), ("e", 0), ("<|im_end|>", 0), ("Ċ", 0)]
        + header
        + [("By", 2), ("e", 2), ("Ġnow", 2), ("<|im_end|>", 2), ("Ċ", 0)]
    )
    assert list(zip(tokenizer.convert_ids_to_tokens(ids), weights)) == expected
    # The same tokens the template gives for the whole conversation.
    assert ids == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)


def test_a_task_weighs_its_answer_and_keeps_the_test_prompt(tokenizer):
    task = tasks.generate_training(["gcd"], 1, 1000)[0]
    ids, weights = chat.encode(tokenizer, tasks.training_messages(task), 8.0)
    prompt = chat.prompt_ids(tokenizer, tasks.task_messages(task.question))
    # The prompt weighs 0 and is exactly what the model is given at test time;
    # the answer and the end of the turn weigh 8; the closing newline 0.
    assert ids[: len(prompt)] == prompt and set(weights[: len(prompt)]) == {0.0}
    answer = [i for i, w in zip(ids, weights) if w]
    assert tokenizer.decode(answer) == f"{task.entry['answer']}<|im_end|>"
    assert weights[len(prompt) : len(prompt) + len(answer)] == [8.0] * len(answer)
    assert weights[len(prompt) + len(answer) :] == [0.0] * (len(ids) - len(prompt) - len(answer))


def test_final_test_questions_are_never_training_questions():
    # products repeats small questions often: the check must actually drop some.
    train = tasks.generate_training(["products", "gcd"], 300, 1000)
    seen = {t.question for t in train}
    final = tasks.generate_final(["products", "gcd"], 100, 9_000_000, seen)
    questions = [t.question for t in final.tasks]
    assert len(questions) == 200 == len(set(questions))
    assert not seen & set(questions)
    assert final.seen_in_training["products"] > 0 and final.dropped >= final.seen_in_training["products"]


def test_overlapping_seed_ranges_are_refused():
    with pytest.raises(UserError, match="data.test_seed: the seed ranges of training gcd"):
        tasks.check_seed_ranges(["gcd", "products"], 1000, 100, 1050, 10)
    tasks.check_seed_ranges(["gcd", "products"], 1000, 100, 9_000_000, 10)


def test_schedule_is_seeded_and_the_same_for_every_arm():
    base = config.load("tiny")
    other_arms = config.load("tiny", ["arms.compressed.workers=4", "arms.compressed.microbatch=1", "arms.control.microbatch=8", "train.lr=0.5"])
    assert data.inputs_key(base) == data.inputs_key(other_arms)
    assert data.inputs_key(base) != data.inputs_key(config.load("tiny", ["data.schedule_seed=12"]))

    schedule = data.make_schedule(20, 7, 8, seed=11)
    assert len(schedule) == 7 and {len(batch) for batch in schedule} == {8}
    flat = [i for batch in schedule for i in batch]
    # Each pass is a permutation: the first 20 slots hold every document once.
    assert sorted(flat[:20]) == list(range(20)) and sorted(flat[20:40]) == list(range(20))
    assert flat[:20] != flat[20:40], "each pass has its own permutation"
    assert data.make_schedule(20, 7, 8, seed=11) == schedule
    assert data.make_schedule(20, 7, 8, seed=12) != schedule


def test_replay_and_retention_are_disjoint_and_test_entries_verify(tokenizer, tiny_seed, tmp_path):
    # A chat export with a duplicated conversation, an unusable row, and
    # conversations that differ only in their answer.
    rows = [{"messages": [{"role": "user", "content": f"Q{i % 15}"}, {"role": "assistant", "content": f"A{i}"}]} for i in range(30)]
    rows.append(rows[0])
    rows.append({"messages": [{"role": "assistant", "content": "opens with an answer"}]})
    export = tmp_path / "chats.jsonl"
    export.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config.load("tiny", [f"data.replay_source={export}", "data.replay_docs=20", "data.retention_docs=10"])

    built = data.build(cfg, tokenizer, tiny_seed)
    replay = [r for r in _rows(built, data.TRAIN) if r["kind"] == "replay"]
    retention = _rows(built, data.RETENTION)
    assert (len(replay), len(retention)) == (20, 10)
    assert not {r["doc_id"] for r in replay} & {r["doc_id"] for r in retention}
    assert not {tuple(r["input_ids"]) for r in replay} & {tuple(r["input_ids"]) for r in retention}
    assert built.manifest["conversations"] | {"sha256": None} == {"source": "chats.jsonl", "sha256": None, "rows": 32, "skipped": 1, "duplicates_dropped": 1}
    assert built.manifest["checks"] == {"test_questions_in_training": 0, "retention_in_replay": 0}
    assert {w for r in retention for w in r["weights"]} == {0.0, 1.0}

    # Test entries survive their trip through JSON: the verifier still scores the gold answer 1.0.
    cases = _rows(built, data.TEST)
    assert len(cases) == 16
    assert all(tasks.score_answer(c["family"], c["entry"]["answer"], c["entry"]) == 1.0 for c in cases)


def test_truncation_is_counted(tokenizer, tiny_seed):
    whole = data.build(config.load("tiny", ["data.max_context=4096"]), tokenizer, tiny_seed)
    cut = data.build(config.load("tiny", ["data.max_context=100"]), tokenizer, tiny_seed)
    lengths = [len(r["input_ids"]) for name in (data.TRAIN, data.RETENTION) for r in _rows(whole, name)]
    assert whole.manifest["truncation"] | {"by_kind": {}} == {"max_context": 4096, "documents": 0, "tokens": 0, "by_kind": {}}
    over = [n - 100 for n in lengths if n > 100]
    assert over, "the tiny preset has documents longer than 100 tokens"
    assert (cut.manifest["truncation"]["documents"], cut.manifest["truncation"]["tokens"]) == (len(over), sum(over))
    assert max(len(r["input_ids"]) for name in (data.TRAIN, data.RETENTION) for r in _rows(cut, name)) == 100
