"""Dispatch order comes from each rule's explicit priority, never from the order rules were
registered (imported, written) in; a missing or tied priority fails at registration."""

from __future__ import annotations

import random

import pytest
import torch

from nanreplay.diagnose import RULES, rule
from nanreplay.diagnose.model import Registry, Rule


def test_dispatch_order_is_the_priority_order():
    priorities = [r.priority for r in RULES]
    assert priorities == sorted(priorities, reverse=True)
    assert len(set(priorities)) == len(priorities)
    assert list(RULES)[-1].cause == "unrecognised"  # the rule for any op that always answers comes last


@pytest.mark.parametrize("order", ["reversed", "shuffled-0", "shuffled-1", "shuffled-2"])
def test_registration_order_does_not_change_dispatch_order(order):
    rules = list(RULES)
    if order == "reversed":
        rules.reverse()
    else:
        random.Random(int(order.split("-")[1])).shuffle(rules)
    assert [r.cause for r in rules] != [r.cause for r in RULES]
    registry = Registry()
    for r in rules:
        registry.add(r)
    assert [r.cause for r in registry] == [r.cause for r in RULES]


def test_a_rule_added_last_is_tried_by_its_priority():
    registry = Registry()
    for r in RULES:
        registry.add(r)
    trap = next(r for r in RULES if r.cause == "where_trap")
    registry.add(Rule("new_cause", frozenset({"aten.log"}), trap.priority + 1, lambda s: None))
    causes = [r.cause for r in registry]
    assert causes.index("new_cause") == causes.index("where_trap") - 1


def test_priority_is_required_and_unique():
    with pytest.raises(TypeError, match="explicit integer priority"):
        rule("new_cause", torch.ops.aten.sqrt)
    with pytest.raises(ValueError, match="must be unique"):
        rule("new_cause", torch.ops.aten.sqrt, priority=next(iter(RULES)).priority)
    assert "new_cause" not in {r.cause for r in RULES}
