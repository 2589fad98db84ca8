import math

import pytest
import torch

from tpspec.sample.gumbel import ACCEPT, DRAFT, RESIDUAL, SAMPLE, gumbel, random_bits, uniform


def chi2_sf(x: float, dof: int) -> float:
    """Upper tail of the chi-square distribution (Wilson-Hilferty approximation)."""
    z = ((x / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def uniformity_p(u: torch.Tensor, bins: int = 64) -> float:
    counts = torch.histc(u.double().flatten(), bins=bins, min=0.0, max=1.0)
    expected = u.numel() / bins
    return chi2_sf(float(((counts - expected) ** 2 / expected).sum()), bins - 1)


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


SEEDS = ids(0, 1, -1, 2**40 + 7, -(2**63), 2**63 - 1, 12345, 99)
POSITIONS = ids(0, 0, 5, 1, 2**33, 77, 4095, 100000)
VOCAB = torch.arange(5000, dtype=torch.int64)


def test_shape_dtype_and_open_interval():
    u = uniform(SEEDS, POSITIONS, VOCAB, SAMPLE)
    assert u.shape == (8, 5000) and u.dtype == torch.float32
    assert bool((u > 0).all()) and bool((u < 1).all())
    g = gumbel(SEEDS, POSITIONS, VOCAB, SAMPLE)
    assert bool(torch.isfinite(g).all())


def test_extremes_stay_inside_the_open_interval():
    # 23-bit lattice: the smallest and largest values are exactly 2^-24 and 1 - 2^-24.
    u = uniform(torch.arange(64, dtype=torch.int64), torch.zeros(64, dtype=torch.int64),
                torch.arange(100000, dtype=torch.int64), SAMPLE)
    assert float(u.min()) >= 2.0**-24 and float(u.max()) <= 1 - 2.0**-24
    k = u.double() * 2**23 - 0.5
    assert bool((k == k.round()).all()), "values must sit on the (k + 0.5) / 2^23 lattice"


def test_pure_function_of_the_key():
    a = gumbel(SEEDS, POSITIONS, VOCAB, DRAFT)
    b = gumbel(SEEDS.clone(), POSITIONS.clone(), VOCAB.clone(), DRAFT)
    assert torch.equal(a, b)


@pytest.mark.parametrize("fn", [uniform, gumbel, random_bits])
def test_sliced_equals_whole_bit_for_bit(fn):
    """Sharding invariance: any split of the vocab (and of the batch) gives the same numbers."""
    vocab = torch.arange(49152 + 13, dtype=torch.int64)
    whole = fn(SEEDS, POSITIONS, vocab, SAMPLE)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        cuts = sorted(torch.randint(1, vocab.numel(), (3,), generator=gen).tolist())
        bounds = [0, *cuts, vocab.numel()]
        pieces = [fn(SEEDS, POSITIONS, vocab[a:b], SAMPLE) for a, b in zip(bounds, bounds[1:])]
        assert torch.equal(torch.cat(pieces, dim=1), whole)
    rows = [fn(SEEDS[i:i + 1], POSITIONS[i:i + 1], vocab, SAMPLE) for i in range(len(SEEDS))]
    assert torch.equal(torch.cat(rows, dim=0), whole)


def test_per_row_token_ids_equal_gather_from_the_full_slice():
    picked = torch.randint(0, 5000, (8, 7), generator=torch.Generator().manual_seed(1))
    full = uniform(SEEDS, POSITIONS, VOCAB, ACCEPT)
    assert torch.equal(uniform(SEEDS, POSITIONS, picked, ACCEPT), full.gather(1, picked))


def test_uniformity_chi_square():
    seeds = torch.arange(16, dtype=torch.int64) * 1000003
    positions = torch.arange(16, dtype=torch.int64)
    u = uniform(seeds, positions, torch.arange(20000, dtype=torch.int64), SAMPLE)
    assert uniformity_p(u) > 1e-4
    # Also along the counter axis that sampling tests use: one token, many positions.
    u = uniform(torch.full((50000,), 7, dtype=torch.int64), torch.arange(50000, dtype=torch.int64), ids(3), SAMPLE)
    assert uniformity_p(u) > 1e-4
    # The test bites: a slightly non-uniform sample fails it.
    assert uniformity_p(u**1.05) < 1e-6


def test_every_output_bit_is_balanced():
    bits = random_bits(torch.arange(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64), VOCAB, SAMPLE)
    n = bits.numel()
    for j in range(32):
        ones = int(((bits >> j) & 1).sum())
        assert abs(ones - n / 2) < 5 * math.sqrt(n / 4), f"bit {j} is biased"


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def _pair_independence_p(a: torch.Tensor, b: torch.Tensor, bins: int = 8) -> float:
    """Chi-square test of independence over a bins x bins grid of (a, b)."""
    cell = (a.flatten() * bins).long() * bins + (b.flatten() * bins).long()
    counts = torch.bincount(cell, minlength=bins * bins).double()
    expected = a.numel() / bins**2
    return chi2_sf(float(((counts - expected) ** 2 / expected).sum()), bins**2 - 1)


def _variants():
    seeds = torch.arange(10, dtype=torch.int64) * 7919
    positions = torch.arange(10, dtype=torch.int64) + 100
    vocab = torch.arange(8000, dtype=torch.int64)
    base = uniform(seeds, positions, vocab, SAMPLE)
    return base, {
        "other stream": uniform(seeds, positions, vocab, DRAFT),
        "next position": uniform(seeds, positions + 1, vocab, SAMPLE),
        "next seed": uniform(seeds + 1, positions, vocab, SAMPLE),
        "seed high half": uniform(seeds + 2**32, positions, vocab, SAMPLE),
        "position high half": uniform(seeds, positions + 2**32, vocab, SAMPLE),
        "next token": uniform(seeds, positions, vocab + 1, SAMPLE),
        "position as seed": uniform(positions, seeds, vocab, SAMPLE),
    }


@pytest.mark.parametrize("name", list(_variants()[1]))
def test_neighbouring_keys_are_independent(name):
    base, variants = _variants()
    other = variants[name]
    assert not torch.equal(base, other)
    assert abs(_corr(base, other)) < 5 / math.sqrt(base.numel())
    assert _pair_independence_p(base, other) > 1e-4


def test_independence_test_bites():
    base, _ = _variants()
    shifted = (base + 0.01 * torch.rand(base.shape, generator=torch.Generator().manual_seed(0))) % 1.0
    assert _pair_independence_p(base, shifted) < 1e-6


def test_streams_are_distinct():
    outs = [uniform(SEEDS, POSITIONS, VOCAB, s) for s in (SAMPLE, DRAFT, ACCEPT, RESIDUAL)]
    for i in range(4):
        for j in range(i + 1, 4):
            assert abs(_corr(outs[i], outs[j])) < 5 / math.sqrt(outs[i].numel())


def test_gumbel_moments():
    g = gumbel(torch.arange(20, dtype=torch.int64), torch.zeros(20, dtype=torch.int64),
               torch.arange(50000, dtype=torch.int64), RESIDUAL).double()
    n = g.numel()
    euler_gamma, variance = 0.5772156649, math.pi**2 / 6
    assert abs(float(g.mean()) - euler_gamma) < 5 * math.sqrt(variance / n)
    assert abs(float(g.var()) - variance) < 0.02


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"seeds": ids(1).int()}, "seeds"),
        ({"positions": ids(1, 2)}, "positions"),
        ({"token_ids": torch.arange(4.0)}, "token_ids"),
        ({"token_ids": torch.zeros(2, 3, dtype=torch.int64)}, "token_ids"),
        ({"stream": -1}, "stream"),
        ({"stream": 2**32}, "stream"),
        ({"stream": True}, "stream"),
    ],
)
def test_bad_inputs_raise(kwargs, field):
    args = {"seeds": ids(1), "positions": ids(0), "token_ids": torch.arange(4), "stream": SAMPLE, **kwargs}
    with pytest.raises(ValueError, match=field):
        uniform(**args)
