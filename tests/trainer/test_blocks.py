"""Block labels (trainer/blocks.py): whether a copy's next lines stand in what its person wrote,
read from the workspace memory; and the lines head's fit to them (trainer/update/lines.py)."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import sqlalchemy as sa
import torch

from tabloop.core.memory import remember
from tabloop.core.policy.actions import Completion
from tabloop.core.policy.context import prepare_context
from tabloop.core.policy.model import GPT
from tabloop.core.policy.tokenizer import CodeTokenizer, train_tokenizer
from tabloop.core.recall import Proposal
from tests.trainer.test_update import FAMILY_A, FAMILY_B, _set_gate, proposal_rollouts
from trainer.blocks import block_label, block_labels, prefix_tail
from trainer.update import Batch, UpdateConfig, UpdateInputs, make_optimizer, update

PREFIX = "import os\n\n\ndef main(argv):\n    for name in argv:\n        print(nam"
FIRST, MORE = "e)", "        size = len(name)\n        total += size"


@pytest.mark.parametrize(
    ("written", "low", "high"),
    [
        (f"e)\n{MORE}  \n    return total\n", 1.0, 1.0),  # as proposed (trailing spaces aside)
        ("e)\n        size = len(name)\n        total -= size\n", 0.95, 0.99),  # a character
        ("e)\n        pass\n        total += size\n", 0.55, 0.7),  # its first line not
        ("e)\n    return None\n\n", 0.0, 0.4),  # something else
        (f"e, end='')\n{MORE}\n", 1.0, 1.0),  # the copied line aside
    ],
)
def test_block_label_is_how_much_of_the_block_was_written(
    written: str, low: float, high: float
) -> None:
    label = block_label(PREFIX + written, PREFIX, MORE)
    assert label is not None and low <= label <= high, label


@pytest.mark.parametrize(
    "written",
    [
        "e)\n        size = len(name)\n        tot",  # not written that far yet
        "e)\n        size = len(name)\n        total += size",  # its last line not whole yet
        "",  # nothing after the cursor yet
    ],
)
def test_block_label_waits_for_the_lines_to_be_written(written: str) -> None:
    assert block_label(PREFIX + written, PREFIX, MORE) is None


def test_block_label_needs_the_cursor_found_once() -> None:
    """A prefix tail that occurs twice in the document (a file that repeats itself) says
    nowhere which occurrence was the cursor: no label."""
    written = f"e)\n{MORE}\n"
    assert block_label(PREFIX + written + PREFIX + written, PREFIX, MORE) is None
    assert block_label("unrelated text\n" * 5, PREFIX, MORE) is None


@pytest.mark.parametrize("fim", [False, True], ids=["left-to-right", "fim"])
def test_prefix_tail_is_the_prefix_the_rollout_was_sampled_after(
    small_code: list[str], tiny_tokenizer: CodeTokenizer, fim: bool
) -> None:
    """The logged context, decoded, and the healed bytes give back the end of the prefix (a
    FIM context's suffix part left out)."""
    tokenizer = train_tokenizer(small_code, vocab_size=400, fim=True) if fim else tiny_tokenizer
    healing = prepare_context(tokenizer, PREFIX, 512, 32, suffix="\n    return total\n")
    tail = prefix_tail(tokenizer, healing.context_ids, healing.constraint.decode())
    assert healing.constraint and PREFIX.endswith(tail) and len(tail) > 40


def _row(tokenizer: CodeTokenizer, user: str, path: str, more: str, drawn: bool = True) -> object:
    healing = prepare_context(tokenizer, PREFIX, 512, 32)
    recall = {"text": FIRST, "copied": True, "more": more}
    if drawn:
        recall["lines"] = {"more": False, "logprob": math.log(0.5)}
    return SimpleNamespace(
        user_id=user,
        workspace_id=None,
        file_path=path,
        context_token_ids=healing.context_ids,
        heal_text=healing.constraint.decode(),
        recall=recall,
    )


def test_block_labels_read_each_persons_own_document(
    engine: sa.Engine, tiny_tokenizer: CodeTokenizer
) -> None:
    """Each rollout's label comes from its own person's latest document of its file; a copy
    without a lines draw, a file nobody wrote further and another person's file give none."""
    with engine.begin() as conn:
        for user, written in (("ada", f"e)\n{MORE}\n"), ("bob", "e)\n        x = 1\n        y\n")):
            remember(
                conn,
                workspace="team",
                scope=None,
                user_id=user,
                document="main.py",
                prefix=PREFIX + written,
                suffix="",
            )
    rows = [
        _row(tiny_tokenizer, "ada", "main.py", MORE),
        _row(tiny_tokenizer, "bob", "main.py", MORE),
        _row(tiny_tokenizer, "ada", "main.py", MORE, drawn=False),
        _row(tiny_tokenizer, "ada", "other.py", MORE),
        _row(tiny_tokenizer, "cyd", "main.py", MORE),
    ]
    labels = block_labels(engine, tiny_tokenizer, rows)
    assert labels[0] == 1.0 and labels[1] is not None and labels[1] < 0.5
    assert labels[2:] == [None, None, None]


def test_the_lines_fit_shows_lines_where_they_stand(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    """Both families copy a proposal with lines after its first; what the people wrote has
    those lines on B and something else on A, and what people kept says a standing block pays
    shown and one that does not costs. One update with the block labels sets the lines head apart:
    p(more) below 0.2 on A and above 0.8 on B (from 0.5). Without labels the fit leaves the
    head as it was."""
    _set_gate(tiny_model, -30.0)
    with torch.no_grad():
        tiny_model.gate.copy.weight.zero_()
        tiny_model.gate.copy.bias.fill_(30.0)  # always copied
        tiny_model.gate.lines.bias.zero_()
    proposal = Proposal("value + offset", "memory", 24, 3, 3, "    return value\n    pass")
    gen = torch.Generator().manual_seed(0)

    rollouts = proposal_rollouts(tiny_model, tiny_tokenizer, proposal, gen)

    def p_more(comps: list[Completion]) -> float:
        assert all(c.recall and "lines" in c.recall for c in comps)
        drawn = [(c.recall["lines"]["more"], math.exp(c.recall["lines"]["logprob"])) for c in comps]  # type: ignore[index]  # noqa: E501
        return sum(q if yes else 1.0 - q for yes, q in drawn) / len(drawn)

    a, b = rollouts(FAMILY_A, 10), rollouts(FAMILY_B, 10)
    cfg = UpdateConfig(learning_rate=0.0, lines_fit_min=40)
    before = copy.deepcopy(tiny_model)
    labels = [0.1] * len(a) + [0.9] * len(b)
    shown = [bool(c.recall["lines"]["more"]) for c in a + b]  # type: ignore[index]
    # kept characters: a standing block shown with its lines 60, one that does not stand none,
    # the first line alone 30
    kept = [
        (60.0 if y > 0.5 else 0.0) if more else 30.0 for y, more in zip(labels, shown, strict=True)
    ]
    for blocks in (None, labels):
        model = copy.deepcopy(before)
        batch = Batch.of(a + b, [k / 20 for k in kept], blocks=blocks, kept=kept)
        m = update(
            UpdateInputs(model, before, tiny_tokenizer, batch, make_optimizer(model, cfg), cfg)
        )
        if blocks is None:
            assert "lines_fit/fitted" not in m
            assert torch.equal(model.gate.lines.hidden, before.gate.lines.hidden)
    assert m["lines_fit/fitted"] == 1.0 and m["lines_fit/labels"] == len(a) + len(b)
    tiny_model.load_state_dict(model.state_dict())
    final_a, final_b = p_more(rollouts(FAMILY_A, 8)), p_more(rollouts(FAMILY_B, 8))
    assert final_a < 0.2 and final_b > 0.8, (final_a, final_b)
