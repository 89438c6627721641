"""`bench generate`: batched against one-at-a-time greedy generation on the
seed model (see `coopstudy.bench`)."""

from __future__ import annotations

import time

import torch

from coopstudy import scoring, ui
from coopstudy.config import Config
from coopstudy.inputs import chat, tasks
from coopstudy.inputs.seed import resolve_seed


def generation_cases(cfg: Config, items: int) -> list[dict]:
    """`items` cases spread evenly over the families, as the final test asks them."""
    families = cfg.data.families
    per_family = -(-items // len(families))
    out = []
    for pos, fam in enumerate(families):
        ds = tasks.dataset(fam, tasks.family_seed(cfg.data.test_seed, pos), per_family)
        out += [
            {"case_id": f"{fam}/{i}", "family": fam, "messages": tasks.task_messages(ds[i]["question"]), "entry": ds[i]}
            for i in range(per_family)
        ]
    return out[:items]


def measure(cfg: Config, items: int) -> int:
    seed = resolve_seed(cfg)
    tokenizer = scoring.load_tokenizer(seed.path, "seed")
    model = scoring.load_model(seed.path, "seed", tokenizer)
    test = generation_cases(cfg, items)
    prompts = [chat.prompt_ids(tokenizer, c["messages"]) for c in test]
    common = {"max_new_tokens": cfg.evaluate.max_new_tokens, "stop": scoring.stop_ids(tokenizer), "pad_id": scoring.padding_id(tokenizer)}
    print(
        f"seed {seed.path} ({seed.parameters:,} parameters), {len(test)} cases, max_new_tokens "
        f"{cfg.evaluate.max_new_tokens}, torch threads {torch.get_num_threads()}, device {next(model.parameters()).device}",
        flush=True,
    )

    timings = {}
    outputs = {}
    for label, batch in (("one at a time", 1), ("batched", cfg.evaluate.batch_size)):
        start = time.perf_counter()
        with ui.progress(label, len(test)) as advance:
            outputs[label] = scoring.generate(model, prompts, batch_size=batch, progress=advance, **common)
        timings[label] = (batch, time.perf_counter() - start)

    print(f"\n{'mode':<14} {'batch':>5} {'seconds':>8} {'cases/s':>8} {'new tokens':>10}")
    for label, (batch, seconds) in timings.items():
        new_tokens = sum(len(g.tokens) + g.finished for g in outputs[label])
        print(f"{label:<14} {batch:>5} {seconds:>8.2f} {len(test) / seconds:>8.2f} {new_tokens:>10}")
    speedup = timings["one at a time"][1] / timings["batched"][1]
    differing = [c["case_id"] for c, a, b in zip(test, outputs["one at a time"], outputs["batched"]) if a != b]
    print(f"speed-up {speedup:.1f}x (target at least 4x: {'met' if speedup >= 4 else 'NOT met'})")
    print(f"identical outputs: {len(test) - len(differing)}/{len(test)}" + (f" (differ: {', '.join(differing)})" if differing else ""))

    rows = [scoring.score_case(c, tokenizer.decode(g.tokens, skip_special_tokens=True)) for c, g in zip(test, outputs["batched"])]
    print("\nseed strict accuracy (score 1.0) per family:")
    for fam in dict.fromkeys(r["family"] for r in rows):
        mine = [r for r in rows if r["family"] == fam]
        print(f"  {fam:<16} {sum(r['correct'] for r in mine)}/{len(mine)}")
    return 1 if differing else 0
