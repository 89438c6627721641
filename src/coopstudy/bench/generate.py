"""`bench generate`: batched against one-at-a-time greedy generation on the
seed model (see `coopstudy.bench`)."""

from __future__ import annotations

import time

import torch

from coopstudy import scoring, ui
from coopstudy.config import Config
from coopstudy.inputs import chat, tasks
from coopstudy.inputs.tasks import DEV_SEED
from coopstudy.inputs.seed import resolve_seed
from coopstudy.record import schema, writer
from coopstudy.run import lock


def generation_cases(cfg: Config, items: int) -> list[dict]:
    """`items` cases of the development split, as `dev-split` draws it (the
    final test's draw at DEV_SEED, with the preset's family options, questions
    seen in training dropped), never the study's final test: nothing printed
    here invites a choice made on the questions the study is judged by. As even
    over the families as `items` allows, the first families taking one more."""
    d = cfg.data
    share, extra = divmod(items, len(d.families))
    wanted = {fam: share + (pos < extra) for pos, fam in enumerate(d.families)}
    tasks.check_development_seed(d, d.families, DEV_SEED, per_family=max(wanted.values()))  # the draw it makes
    training = {t.question for t in tasks.generate_training(d.families, d.tasks_per_family, d.generation_seed, d.family_options)}
    draw = tasks.generate_final(d.families, max(wanted.values()), DEV_SEED, training, d.family_options)
    out = []
    for t in draw.tasks:
        if wanted[t.family]:
            wanted[t.family] -= 1
            out.append(tasks.test_case(t))
    return out


def measure(cfg: Config, items: int) -> int:
    # Held before the model is loaded: on CUDA it takes the device's memory.
    with lock.one_process_job(f"coopstudy bench generate --preset {cfg.preset_argument}") as held:
        return _measure(cfg, items, held)


def _measure(cfg: Config, items: int, held: lock.Held) -> int:
    seed = resolve_seed(cfg)
    tokenizer = scoring.load_tokenizer(seed.path, "seed")
    model = scoring.load_model(seed.path, "seed", tokenizer)
    test = generation_cases(cfg, items)
    prompts = [chat.prompt_ids(tokenizer, c["messages"]) for c in test]
    common = {"max_new_tokens": cfg.evaluate.max_new_tokens, "stop": scoring.stop_ids(tokenizer), "pad_id": scoring.padding_id(tokenizer)}
    per_family = ", ".join(f"{fam} {sum(c['family'] == fam for c in test)}" for fam in cfg.data.families)
    print(
        f"seed {seed.path} ({seed.parameters:,} parameters), {len(test)} cases of the development split"
        f" (test seed {DEV_SEED:,}: {per_family}), max_new_tokens {cfg.evaluate.max_new_tokens},"
        f" torch threads {torch.get_num_threads()}, device {next(model.parameters()).device}",
        flush=True,
    )

    # Each mode: its metric suffix, its printed label, its batch size.
    modes = (("one_at_a_time", "one at a time", 1), ("batched", "batched", cfg.evaluate.batch_size))
    seconds = {}
    outputs = {}
    # The run opens before the first generation: an interrupt or a tracking
    # outage while measuring ends it KILLED or FAILED, as in the other benches.
    with writer.stage_run(schema.STAGE_BENCH, cfg, run_name=f"bench-generate-{cfg.preset}") as rec:
        held.note(run_id=rec.run_id)
        for mode, label, batch in modes:
            start = time.perf_counter()
            with ui.progress(label, len(test)) as advance:
                outputs[mode] = scoring.generate(model, prompts, batch_size=batch, progress=advance, **common)
            seconds[mode] = time.perf_counter() - start

        print(f"\n{'mode':<14} {'batch':>5} {'seconds':>8} {'cases/s':>8} {'new tokens':>10}")
        for mode, label, batch in modes:
            new_tokens = sum(len(g.tokens) + g.finished for g in outputs[mode])
            print(f"{label:<14} {batch:>5} {seconds[mode]:>8.2f} {len(test) / seconds[mode]:>8.2f} {new_tokens:>10}")
        speedup = seconds["one_at_a_time"] / seconds["batched"]
        differing = [c["case_id"] for c, a, b in zip(test, outputs["one_at_a_time"], outputs["batched"]) if a != b]
        print(f"speed-up {speedup:.1f}x (target at least 4x: {'met' if speedup >= 4 else 'NOT met'})")
        print(f"identical outputs: {len(test) - len(differing)}/{len(test)}" + (f" (differ: {', '.join(differing)})" if differing else ""))
        rec.log_metrics(
            {
                schema.M_BENCH_GENERATE_CASES: len(test),
                schema.M_BENCH_GENERATE_THREADS: torch.get_num_threads(),
                schema.M_BENCH_SPEEDUP: speedup,
                schema.M_BENCH_GENERATE_IDENTICAL: len(test) - len(differing),
                **{schema.M_BENCH_GENERATE_SECONDS_PREFIX + mode: s for mode, s in seconds.items()},
                **{schema.M_BENCH_GENERATE_RATE_PREFIX + mode: len(test) / s for mode, s in seconds.items()},
            }
        )

    rows = [scoring.score_case(c, tokenizer.decode(g.tokens, skip_special_tokens=True)) for c, g in zip(test, outputs["batched"])]
    print("\nseed strict accuracy (score 1.0) per family, development split:")
    for fam in dict.fromkeys(r["family"] for r in rows):
        mine = [r for r in rows if r["family"] == fam]
        print(f"  {fam:<16} {sum(r['correct'] for r in mine)}/{len(mine)}")
    return 1 if differing else 0
