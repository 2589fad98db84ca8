"""Every CPU kernel (layers.cpu_kernels, csrc/bindings.cpp) called on a large input runs with the GIL
released: another Python thread (a server's HTTP event loop beside the engine thread) runs while the
kernel computes, instead of waiting for it to return; a decode-sized call keeps the GIL (releasing it
would cost more than the call's wait), a one-row product of a large weight (an LM head) does not. Measured, not read from the source: a thread that counts
(giving the GIL up after each count) advances during the kernel calls alone, with the interpreter's
switch interval raised so that nothing but a released GIL lets it in. A kernel that holds the GIL
leaves the count exactly where it was."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from tpspec.layers import cpu_kernels, int8_dot, q4_1, q8_0

pytestmark = pytest.mark.skipif(cpu_kernels.unavailable() is not None,
                                reason=f"no CPU kernels here: {cpu_kernels.unavailable()}")

AVX2 = int8_dot.ISAS.index("avx2")
KERNELS = ["q4_1_linear", "q8_0_linear", "q4_1_int8_linear", "q8_0_int8_linear", "add_rms_norm", "paged_attention",
           "write_kv", "rotary", "silu_and_mul", "argmax_rows"]


@pytest.fixture(scope="module")
def calls() -> dict:
    """Per kernel: a call of it on inputs above ``RELEASE_ELEMENTS`` or ``RELEASE_WORK`` (built here, so
    that no PyTorch op, which releases the GIL itself, runs inside the timed calls)."""
    k, g = cpu_kernels.kernels(), torch.Generator().manual_seed(0)
    rows, width = 64, 2048
    x = torch.randn(rows, width, generator=g)
    w4 = q4_1.quantize_exact(q4_1.round_to_q4_1(torch.randn(width, width, generator=g) * 0.05))
    d8 = (torch.rand(width, width // q8_0.GROUP, 1, generator=g) * 0.01 + 1e-3).half()
    q8 = torch.randint(-127, 128, (width, width // q8_0.GROUP, q8_0.GROUP), generator=g, dtype=torch.int8)
    q8[..., 0] = 127  # each group's largest magnitude: d = max |w| / 127, as llama.cpp rounds
    w8 = q8_0.quantize_exact((d8.float() * q8).flatten(1))
    i4 = int8_dot.quantize_exact_q4_1(q4_1.dequantize(w4), 15)
    i8 = int8_dot.quantize_exact_q8_0(q8_0.dequantize(w8), 15)
    tokens, heads, kv_heads, d, keys = 4096, 9, 3, 64, 4096
    hidden = torch.randn(tokens, heads * d, generator=g)
    heads_x = torch.randn(tokens, heads, d, generator=g)
    cos, sin = torch.randn(2, tokens, 1, d, generator=g)
    k_cache, v_cache = torch.randn(2, keys, kv_heads, d, generator=g)
    logits = torch.randn(64, 49152, generator=g)
    queries = 128
    q = torch.randn(queries, heads, d, generator=g)
    slots = torch.randperm(keys, generator=g).view(1, keys)
    key_range = torch.tensor([[0, keys - queries + 1 + i] for i in range(queries)])
    kv_head = torch.arange(heads) // (heads // kv_heads)
    token_seq = torch.zeros(queries, dtype=torch.int64)
    new_k, new_v = torch.randn(2, keys, kv_heads, d, generator=g)
    slot_mapping, norm_weight = torch.arange(keys), torch.ones(heads * d)
    return {
        "q4_1_linear": lambda: k.q4_1_linear(x, w4.qweight, w4.scales, w4.mins, False),
        "q8_0_linear": lambda: k.q8_0_linear(x, w8.qweight, w8.scales, False),
        "q4_1_int8_linear": lambda: k.q4_1_int8_linear(x, i4.qweight, i4.scales, i4.mins, i4.out_features, 15, AVX2),
        "q8_0_int8_linear": lambda: k.q8_0_int8_linear(x, i8.qweight, i8.scales, i8.qsums, i8.out_features, 15, AVX2),
        "add_rms_norm": lambda: k.add_rms_norm(hidden, hidden, norm_weight, 1e-5),
        "paged_attention": lambda: k.paged_attention(q, k_cache, v_cache, slots, token_seq, key_range, kv_head, d**-0.5,
                                                     False),
        "write_kv": lambda: k.write_kv(new_k, new_v, k_cache, v_cache, slot_mapping),
        "rotary": lambda: k.rotary(heads_x, cos, sin),
        "silu_and_mul": lambda: k.silu_and_mul(hidden),
        "argmax_rows": lambda: k.argmax_rows(logits),
    }


def _counts_during(call, seconds: float = 0.2) -> int:
    """How far a counting thread advanced during calls of ``call`` (and nothing else) repeated for
    ``seconds``. Each call's result is freed after the count is read: freeing a tensor releases the GIL."""
    count, stop, advanced = [0], threading.Event(), 0

    def counting():
        while not stop.is_set():
            count[0] += 1
            time.sleep(0)  # gives the GIL up: the caller takes it back as soon as its call returns

    interval = sys.getswitchinterval()
    sys.setswitchinterval(100.0)  # no forced switch: the counter runs only where the GIL is released
    thread = threading.Thread(target=counting, daemon=True)
    thread.start()
    try:
        time.sleep(0.05)  # the thread started and counting
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:  # long enough for the thread to get a core beside the kernel's threads
            before = count[0]
            result = call()
            advanced += count[0] - before
            del result
        return advanced
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        thread.join()


def test_every_kernel_is_timed_here(calls):
    """``KERNELS`` is the module's list: a new kernel needs a call here (and its size in bindings.cpp)."""
    module = cpu_kernels.kernels()
    exported = {name for name in dir(module) if not name.startswith("_") and callable(getattr(module, name))}
    assert exported == set(KERNELS) == set(calls)
    assert module.RELEASE_ELEMENTS == 1 << 16 and module.RELEASE_WORK == 1 << 21


def test_a_call_that_holds_the_gil_leaves_the_count_alone():
    """The measurement's control: Python work in the calling thread lets the counter in nowhere."""
    assert _counts_during(lambda: sum(range(20_000))) == 0


@pytest.mark.parametrize("name", KERNELS)
def test_a_kernel_lets_another_thread_run(calls, name):
    call = calls[name]
    call()  # warm: the first call may allocate what later calls reuse
    assert _counts_during(call) > 0, f"{name} held the GIL through its calls"


def test_a_decode_sized_call_keeps_the_gil():
    """One sequence's rotary (9 heads of 64), its argmax over 8,192 draft logits, its product by a
    layer's 576 x 576 weight and its attention over 1,000 keys: under the bounds, no switch."""
    k, g = cpu_kernels.kernels(), torch.Generator().manual_seed(0)
    x, cos, sin = torch.randn(1, 9, 64), torch.randn(1, 1, 64), torch.randn(1, 1, 64)
    logits = torch.randn(1, 8192)
    layer = int8_dot.quantize_exact_q4_1(q4_1.round_to_q4_1(torch.randn(576, 576, generator=g) * 0.05), 15)
    row = torch.randn(1, 576)
    keys = 1000
    k_cache, v_cache = torch.randn(2, keys, 3, 64, generator=g)
    slots = torch.arange(keys).view(1, keys)
    ranges, seq, kv_head = torch.tensor([[0, keys]]), torch.zeros(1, dtype=torch.int64), torch.arange(9) // 3
    assert x.numel() < k.RELEASE_ELEMENTS and logits.numel() < k.RELEASE_ELEMENTS
    assert layer.qweight.nbytes < k.RELEASE_WORK and x.numel() * keys < k.RELEASE_WORK
    assert _counts_during(lambda: k.rotary(x, cos, sin)) == 0
    assert _counts_during(lambda: k.argmax_rows(logits)) == 0
    assert _counts_during(lambda: k.q4_1_int8_linear(row, layer.qweight, layer.scales, layer.mins, 576, 15, AVX2)) == 0
    assert _counts_during(lambda: k.paged_attention(x, k_cache, v_cache, slots, seq, ranges, kv_head, 0.125, False)) == 0


def test_a_one_row_product_of_a_large_weight_releases_it():
    """An LM head at one sequence: one row, but all of an 8,192 x 576 Q8_0 weight's 4.7 MB read."""
    k, g = cpu_kernels.kernels(), torch.Generator().manual_seed(0)
    d = (torch.rand(8192, 18, 1, generator=g) * 0.01 + 1e-3).half()
    q = torch.randint(-127, 128, (8192, 18, q8_0.GROUP), generator=g, dtype=torch.int8)
    q[..., 0] = 127
    head = int8_dot.quantize_exact_q8_0((d.float() * q).flatten(1), 15)
    row = torch.randn(1, 576)
    assert row.shape[0] * head.qweight.nbytes >= k.RELEASE_WORK
    assert _counts_during(lambda: k.q8_0_int8_linear(row, head.qweight, head.scales, head.qsums, 8192, 15, AVX2)) > 0
