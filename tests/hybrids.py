"""What the hybrid tests in several folders share, importable from any of them (tests/ is on sys.path through its
conftest.py): `from hybrids import HYBRID_PRESETS`. Not in conftest.py, since every test folder's conftest is imported
as `conftest`, and a test importing from it gets whichever folder's was imported first (one pytest command over
tests/widgets and tests/execution failed to collect)."""

import numpy as np

HYBRID_PRESETS = ("qwen3-next-tiny", "qwen3.5-moe-tiny")


def assert_back_at_and_resumes(stepper, straight, position: int) -> None:
    """An interrupted Stepper is back at `position` (its trace and every cache), and stepping it to its end
    decodes what the uninterrupted `straight` trace did, tokens and logits bit for bit."""
    assert len(stepper.trace.steps) == position
    assert [c.offset for c in stepper.session.cache] == [position] * len(stepper.session.cache)
    while not stepper.done:
        stepper.step()
    assert stepper.trace.token_ids == straight.token_ids
    for a, b in zip(stepper.trace.steps, straight.steps, strict=True):
        assert np.array_equal(a.logits, b.logits), a.position
