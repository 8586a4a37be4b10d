"""What the binding's host tests share: a host Context fixture, and the small
fp32 ResidualStack models with their batches."""

import numpy as np
import pytest

import stepgraph as sg

TOKENS = 32  # rows of a batch()


@pytest.fixture
def ctx():
    """A host Context, closed after the test."""
    with sg.Context("host") as context:
        yield context


def tiny_model(ctx, **overrides):
    """A one-layer stack of hidden 8 over a vocabulary of 16; keywords override its arguments."""
    args = dict(hidden=8, ffn=16, layers=1, vocab=16, dtype="float32")
    args.update(overrides)
    return sg.ResidualStack(ctx, **args)


def small_model(ctx):
    """A two-layer stack of hidden 32 over a vocabulary of 48, seed 3: the one batch() feeds."""
    return sg.ResidualStack(ctx, hidden=32, ffn=64, layers=2, vocab=48, dtype="float32", seed=3)


def batch(seed):
    """TOKENS normal rows of small_model's hidden size and their labels, drawn from `seed`."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((TOKENS, 32)).astype(np.float32), rng.integers(0, 48, TOKENS)
