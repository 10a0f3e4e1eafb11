"""Break one rule on purpose; the simulator must catch it within the CI seed budget.

A mutant counts as caught at the first seed whose run fails with the mutant and passes
without it (same seed, same schedule): on today's rules some seeds fail anyway (issue 25),
and those prove nothing about the mutant.
"""

from __future__ import annotations

import pytest

from .cluster import run
from .mutations import MUTANTS
from .test_seeds import CI_SEEDS


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_a_broken_rule_is_caught(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module, attribute, make = MUTANTS[name]
    real = getattr(module, attribute)
    for seed in range(CI_SEEDS):
        with monkeypatch.context() as patch:
            patch.setattr(module, attribute, make(real))
            mutated = run(seed)
        if mutated.ok:
            continue
        assert getattr(module, attribute) is real
        baseline = run(seed, mutated.faults, mutated.config)
        if baseline.ok:
            print(f"{name}: caught at seed {seed}: {mutated.failures[0]}")
            print(f"  replay without the mutant: {baseline.replay_command()}")
            return
    pytest.fail(f"{name}: no seed of {CI_SEEDS} told the mutant from the real rule")
