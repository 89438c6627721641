"""Token weights, disjoint splits, the schedule and truncation, on the tiny
preset's tokenizer (the SmolLM2 one)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from coopstudy import config
from coopstudy.errors import UserError
from coopstudy.inputs import chat, conversations, data, tasks

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
    # A chat export with a duplicated conversation and conversations that
    # differ only in their answer.
    rows = [{"messages": [{"role": "user", "content": f"Q{i % 15}"}, {"role": "assistant", "content": f"A{i}"}]} for i in range(30)]
    rows.append(rows[0])
    export = tmp_path / "chats.jsonl"
    export.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config.load("tiny", [f"data.replay_source={export}", "data.replay_docs=20", "data.retention_docs=10"])

    built = data.build(cfg, tokenizer, tiny_seed)
    replay = [r for r in _rows(built, data.TRAIN) if r["kind"] == "replay"]
    retention = _rows(built, data.RETENTION)
    assert (len(replay), len(retention)) == (20, 10)
    assert not {r["doc_id"] for r in replay} & {r["doc_id"] for r in retention}
    assert not {tuple(r["input_ids"]) for r in replay} & {tuple(r["input_ids"]) for r in retention}
    assert built.manifest["conversations"] | {"sha256": None} == {"source": "chats.jsonl", "sha256": None, "rows": 31, "duplicates_dropped": 1, "usable": 30}
    assert built.manifest["checks"] == {"test_questions_in_training": 0, **dict.fromkeys(OVERLAP_CHECKS, 0)}
    assert {w for r in retention for w in r["weights"]} == {0.0, 1.0}

    # Test entries survive their trip through JSON: the verifier still scores the gold answer 1.0.
    cases = _rows(built, data.TEST)
    assert len(cases) == 16
    assert all(tasks.score_answer(c["family"], c["entry"]["answer"], c["entry"]) == 1.0 for c in cases)


OVERLAP_CHECKS = (
    "retention_in_replay",
    "retention_ids_in_replay",
    "replay_sharing_topic_with_retention",
    "replay_sharing_13gram_with_retention",
    "replay_sharing_long_message_with_retention",
)


def _chitchat(turns: list[tuple[str, str]]) -> dict:
    return {"messages": [[{"text": t, "timestamp": "t", "sender": s} for t in text.split("|")] for s, text in turns]}


def test_a_chitchat_conversation_becomes_user_and_assistant_turns():
    # Empty utterances go; the turns of one speaker that then meet merge; the
    # first speaker is the user; a trailing user turn goes.
    conv = _chitchat([("a", ""), ("b", "hi|you there?"), ("a", "yes"), ("b", ""), ("a", "still here"), ("b", "bye")])
    assert conversations._chitchat_messages(conv) == [
        {"role": "user", "content": "hi\nyou there?"},
        {"role": "assistant", "content": "yes\nstill here"},
    ]
    # The character budget cuts after an assistant turn, and keeps the first pair whatever its length.
    long = _chitchat([("a", "x" * 50), ("b", "y" * 50), ("a", "z" * 50), ("b", "w" * 50)])
    assert [m["content"][0] for m in conversations._chitchat_messages(long, max_chars=120)] == ["x", "y"]
    assert [m["content"][0] for m in conversations._chitchat_messages(long, max_chars=1)] == ["x", "y"]
    assert conversations._chitchat_messages(_chitchat([("a", "anyone?"), ("a", "hello?")])) == []


def test_the_chitchat_pool_is_the_package_offline():
    pool = conversations.load_pool(conversations.CHITCHAT, 10)
    info = pool.info
    assert info["package"] == "chitchat-dataset 0.9.0"
    assert info["sha256"] == "d2a5d0bf6acf354fef51f3af39cbece2220d3b8f6086b658c3d335105798312a"
    # 7,168 conversations; 3,151 have one speaker only; of the 4,017 answered,
    # 63 open with more than 300 characters and 6 repeat another.
    counts = ("conversations", "skipped_unanswered", "skipped_long_opening", "duplicates_dropped", "usable")
    assert [info[k] for k in counts] == [7168, 3151, 63, 6, 3948]
    for c in pool.conversations:
        roles = [m["role"] for m in c.messages]
        assert roles[0] == "user" and roles[-1] == "assistant" and all(a != b for a, b in zip(roles, roles[1:]))
        assert c.topic and all(m["content"] == m["content"].strip() and m["content"] for m in c.messages)
        assert len(c.messages[0]["content"]) <= conversations.OPENING_CHARS
        assert sum(len(m["content"]) for m in c.messages) <= conversations.CHUNK_CHARS or len(c.messages) == 2
    assert [c.doc_id for c in pool.conversations] == sorted(c.doc_id for c in pool.conversations)


@pytest.mark.parametrize("sizes", [(8, 16), (128, 2048)])
def test_chitchat_probes_share_no_topic_or_text_with_replay(sizes):
    retention_docs, replay_docs = sizes
    pool = conversations.load_pool(conversations.CHITCHAT, retention_docs + replay_docs)
    probes, replay, split = data.split_conversations(pool, retention_docs, replay_docs, 7)
    assert (len(probes), len(replay)) == sizes == (split["retention"], split["replay"])
    assert conversations.overlap_checks(probes, replay) == dict.fromkeys(OVERLAP_CHECKS, 0)
    assert len(split["retention_topics"]) == split["retention_groups"] >= data.RETENTION_MIN_GROUPS
    assert {c.topic for c in probes} <= set(split["retention_topics"])
    assert not {c.topic for c in replay} & set(split["retention_topics"])
    # Probes come first: more or less replay leaves them as they are.
    again, _, _ = data.split_conversations(pool, retention_docs, replay_docs // 2, 7)
    assert again == probes
    assert data.split_conversations(pool, retention_docs, replay_docs, 8)[0] != probes


def _conv(doc_id: str, answer: str, topic: str | None = None) -> conversations.Conversation:
    return conversations.Conversation(doc_id, ({"role": "user", "content": f"about {doc_id}"}, {"role": "assistant", "content": answer}), topic)


def test_what_counts_as_shared_text():
    line = "I would binge watch just about every single TV show there is on the streaming services"
    probe = conversations.Fingerprints.of([_conv("p", line), _conv("q", "Sure, why not? I think that could work out fine.")])
    assert probe.overlaps(_conv("a", "honestly " + line.upper() + "!!"))  # a 13-word run, whatever the case and punctuation
    assert probe.overlaps(_conv("b", "sure,  why not?   I think that could work out FINE."))  # a whole 40+ character message
    assert not probe.overlaps(_conv("c", "Sure, why not?"))  # short messages (greetings) are shared by hundreds
    assert not probe.overlaps(_conv("d", " ".join(line.split()[:12])))  # 12 words are not 13
    assert conversations.Fingerprints.of([_conv("e", "x", topic="T")]).overlaps(_conv("f", "y", topic="T"))


def test_the_overlap_checks_count_each_kind_of_leak_and_prepare_refuses_one(tokenizer, tiny_seed, monkeypatch):
    # The negative control of the manifest's zeros: the split skips all of these,
    # so only a split made to leak shows that each check counts what it names.
    line = "I would binge watch just about every single TV show there is on the streaming services"
    probes = [_conv("p", line, topic="T"), _conv("q", "Sure, why not? I think that could work out fine.")]
    leaks = {
        "retention_in_replay": _conv("p", line, topic="T"),
        "retention_ids_in_replay": _conv("p", "another answer"),
        "replay_sharing_topic_with_retention": _conv("t", "a different answer", topic="T"),
        f"replay_sharing_{conversations.NGRAM}gram_with_retention": _conv("n", "well, " + line.upper() + " honestly"),
        "replay_sharing_long_message_with_retention": _conv("m", "sure,  why not?   I think that could work out FINE."),
    }
    assert set(leaks) == set(OVERLAP_CHECKS)
    assert conversations.overlap_checks(probes, [_conv("fine", "no idea", topic="U")]) == dict.fromkeys(OVERLAP_CHECKS, 0)
    for check, leak in leaks.items():
        assert conversations.overlap_checks(probes, [leak])[check] == 1, check

    split = data.split_conversations

    def leaking(*args, **kwargs):
        retention, replay, info = split(*args, **kwargs)
        return retention, [*replay[:-1], retention[0]], info

    monkeypatch.setattr(data, "split_conversations", leaking)
    with pytest.raises(RuntimeError, match="retention against replay: retention_in_replay 1, retention_ids_in_replay 1"):
        data.build(config.load("tiny"), tokenizer, tiny_seed)


def test_replay_that_shares_text_with_a_probe_is_skipped(monkeypatch):
    monkeypatch.setattr(data, "RETENTION_MIN_GROUPS", 1)
    line = "I would binge watch just about every single TV show there is on the streaming services"
    pool = conversations.Pool([_conv("p", line, "A"), _conv("copy", f"{line}, really", "B"), _conv("fine", "no idea", "B")], {"source": "test"})
    seed = next(s for s in range(20) if data.split_conversations(pool, 1, 1, s)[0][0].doc_id == "p")
    probes, replay, split = data.split_conversations(pool, 1, 1, seed)
    assert [c.doc_id for c in replay] == ["fine"] and split["retention_topics"] == ["A"]
    with pytest.raises(UserError, match="data.replay_docs: 2 replay conversations do not fit: 3 distinct conversations, 1 held out"):
        data.split_conversations(pool, 1, 2, seed)


def test_pydoc_stays_a_named_source(tokenizer, tiny_seed):
    built = data.build(config.load("tiny", ["data.replay_source=pydoc"]), tokenizer, tiny_seed)
    assert built.manifest["conversations"]["source"] == "pydoc"
    assert built.manifest["checks"] == {"test_questions_in_training": 0, **dict.fromkeys(OVERLAP_CHECKS, 0)}
    replay = {r["doc_id"].split("/")[2] for r in _rows(built, data.TRAIN) if r["kind"] == "replay"}
    probes = {r["doc_id"].split("/")[2] for r in _rows(built, data.RETENTION)}
    assert replay and probes and not replay & probes  # no documentation topic on both sides


def test_truncation_is_counted(tokenizer, tiny_seed):
    whole = data.build(config.load("tiny", ["data.max_context=4096"]), tokenizer, tiny_seed)
    cut = data.build(config.load("tiny", ["data.max_context=190"]), tokenizer, tiny_seed)
    lengths = [len(r["input_ids"]) for name in (data.TRAIN, data.RETENTION) for r in _rows(whole, name)]
    assert whole.manifest["truncation"] | {"by_kind": {}} == {"max_context": 4096, "documents": 0, "tokens": 0, "by_kind": {}}
    over = [n - 190 for n in lengths if n > 190]
    assert over, "the tiny preset has documents longer than 190 tokens"
    assert (cut.manifest["truncation"]["documents"], cut.manifest["truncation"]["tokens"]) == (len(over), sum(over))
    assert max(len(r["input_ids"]) for name in (data.TRAIN, data.RETENTION) for r in _rows(cut, name)) == 190


@pytest.mark.parametrize("preset", ["smollm2-135m-cpu", "smollm2-1.7b"])
def test_the_study_presets_keep_every_screen_informative(preset):
    from analysis import stats

    cfg = config.load(preset)
    d, t = cfg.data, cfg.train
    cases = len(d.families) * d.test_per_family
    assert d.test_per_family >= 128 and cases >= 512
    # Non-inferiority can pass with real disagreement: at 512 cases 29 discordant each way still pass.
    assert stats.noninferiority_breakpoint(cases, cfg.screens.noninferiority_margin, cfg.screens.interval_level) >= 20
    assert t.updates * t.global_batch >= cfg.train_documents, "at least one full pass over the training documents"
    assert d.replay_source == conversations.CHITCHAT and d.retention_docs >= 128
