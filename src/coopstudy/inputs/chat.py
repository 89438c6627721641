"""A conversation as training tokens with per-token target weights.

The model's own chat template renders the conversation. Each assistant turn's
content and the end-of-turn token after it are targets of the given weight;
everything else (system and user turns, role headers, separators) weighs 0.
The text is tokenized in segments cut at those boundaries, so the prompt
tokens of a task are exactly what `apply_chat_template(..., add_generation_prompt=True)`
gives at test time, and the answer tokens are what the model must generate
after them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from coopstudy.errors import UserError


def render(tokenizer: Any, messages: Sequence[dict[str, str]], *, generation_prompt: bool = False) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("the seed model's tokenizer has no chat template; conversations cannot be rendered")
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)


def _end_of_turn(tokenizer: Any, rest: str) -> str:
    """The special token that closes a turn, if the rendering puts one right after the content."""
    matches = [tok for tok in tokenizer.get_added_vocab() if tok and rest.startswith(tok)]
    return max(matches, key=len, default="")


def segments(tokenizer: Any, messages: Sequence[dict[str, str]], weight: float) -> list[tuple[str, float]]:
    """The rendered conversation cut into (text, weight) pieces."""
    full = render(tokenizer, messages)
    out: list[tuple[str, float]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        # The template renders a prefix of the conversation as a prefix of the
        # text (ChatML does): the assistant's content starts right after the
        # rendering of everything before it plus the generation prompt.
        prefix = render(tokenizer, messages[:i], generation_prompt=True)
        start, end = len(prefix), len(prefix) + len(message["content"])
        if start < cursor or not full.startswith(prefix) or full[start:end] != message["content"]:
            raise UserError(
                "the seed model's chat template does not render a conversation's beginning as a prefix of "
                "the whole; assistant turns cannot be located"
            )
        end += len(_end_of_turn(tokenizer, full[end:]))
        out += [(full[cursor:start], 0.0), (full[start:end], weight)]
        cursor = end
    out.append((full[cursor:], 0.0))
    return [(text, w) for text, w in out if text]


def encode(tokenizer: Any, messages: Sequence[dict[str, str]], weight: float) -> tuple[list[int], list[float]]:
    """input_ids and weights; weights[i] weighs token i as a prediction from the tokens before it."""
    ids: list[int] = []
    weights: list[float] = []
    for text, w in segments(tokenizer, messages, weight):
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        weights += [w] * len(piece)
    if weights and weights[0]:
        # Nothing predicts the first token; a template that opens with an
        # assistant turn would make it a target.
        raise UserError("a conversation must not open with an assistant turn")
    return ids, weights


def prompt_ids(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """The tokens a model is given to answer `messages` (generation prompt included)."""
    return tokenizer(render(tokenizer, messages, generation_prompt=True), add_special_tokens=False)["input_ids"]
