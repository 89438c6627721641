"""Benchmark: batched against one-at-a-time greedy generation on the seed model.

    python -m coopstudy.bench_generate --preset smollm2-135m-cpu [--items 32]

Draws test-like cases (the families and test seed of the preset, the prompt
form of the final test; nothing from the prepared files is needed), generates
their answers once prompt by prompt and once in batches of
evaluate.batch_size, prints cases/s for both and the speed-up, and checks that
both give the same tokens for every case (exit 1 if not). Also prints the
seed's strict accuracy per family on these cases. Evaluation is not a timed
arm: torch keeps its default thread count, which is printed.
"""

from __future__ import annotations

import argparse
import sys
import time

from coopstudy import config as config_mod
from coopstudy import chat, evaluate, tasks
from coopstudy.errors import UserError
from coopstudy.seed import resolve_seed


def cases(cfg: config_mod.Config, items: int) -> list[dict]:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coopstudy.bench_generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="smollm2-135m-cpu")
    parser.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--items", type=int, default=32, help="test cases to generate (default 32)")
    args = parser.parse_args(argv)
    try:
        return _bench(config_mod.load(args.preset, args.overrides), args.items)
    except UserError as err:
        print(f"bench_generate: error: {err}", file=sys.stderr)
        return 2


def _bench(cfg: config_mod.Config, items: int) -> int:
    import torch

    seed = resolve_seed(cfg)
    tokenizer = evaluate.load_tokenizer(seed.path, "seed")
    model = evaluate.load_model(seed.path, "seed", tokenizer)
    test = cases(cfg, items)
    prompts = [chat.prompt_ids(tokenizer, c["messages"]) for c in test]
    common = {"max_new_tokens": cfg.evaluate.max_new_tokens, "stop": evaluate.stop_ids(tokenizer), "pad_id": evaluate.padding_id(tokenizer)}
    print(
        f"seed {seed.path} ({seed.parameters:,} parameters), {len(test)} cases, max_new_tokens "
        f"{cfg.evaluate.max_new_tokens}, torch threads {torch.get_num_threads()}, device {next(model.parameters()).device}",
        flush=True,
    )

    timings = {}
    outputs = {}
    for label, batch in (("one at a time", 1), ("batched", cfg.evaluate.batch_size)):
        start = time.perf_counter()
        with evaluate.progress_bar(label, len(test)) as advance:
            outputs[label] = evaluate.generate(model, prompts, batch_size=batch, progress=advance, **common)
        timings[label] = (batch, time.perf_counter() - start)

    print(f"\n{'mode':<14} {'batch':>5} {'seconds':>8} {'cases/s':>8} {'new tokens':>10}")
    for label, (batch, seconds) in timings.items():
        new_tokens = sum(len(g.tokens) + g.finished for g in outputs[label])
        print(f"{label:<14} {batch:>5} {seconds:>8.2f} {len(test) / seconds:>8.2f} {new_tokens:>10}")
    speedup = timings["one at a time"][1] / timings["batched"][1]
    differing = [c["case_id"] for c, a, b in zip(test, outputs["one at a time"], outputs["batched"]) if a != b]
    print(f"speed-up {speedup:.1f}x (target at least 4x: {'met' if speedup >= 4 else 'NOT met'})")
    print(f"identical outputs: {len(test) - len(differing)}/{len(test)}" + (f" (differ: {', '.join(differing)})" if differing else ""))

    rows = [evaluate.score_case(c, tokenizer.decode(g.tokens, skip_special_tokens=True)) for c, g in zip(test, outputs["batched"])]
    print("\nseed strict accuracy (score 1.0) per family:")
    for fam in dict.fromkeys(r["family"] for r in rows):
        mine = [r for r in rows if r["family"] == fam]
        print(f"  {fam:<16} {sum(r['correct'] for r in mine)}/{len(mine)}")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
