"""CPU weight formats and the product that dispatches on them: float32 weights reordered for
oneDNN, float16 weights through fbgemm, weights that are exactly Q4_1 or Q8_0 through tpspec's
kernels (``layers.q4_1``, ``layers.q8_0``, and with activations rounded to integers
``layers.int8_dot``, which takes Q5_0, Q4_K and Q6_K weights too: ``layers.q5_0``, ``q4_k``, ``q6_k``);
packed once at load (``pack_cpu_weights``), looked up by weight in every product
(``packed_weight_of``), and what ``--quantization auto`` picks."""

from __future__ import annotations

import collections
import functools
import logging
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tpspec.config.engine import QUANTIZATION_METHODS, QUANTIZATION_OPTIONS
from tpspec.cpu_features import has_fbgemm
from tpspec.layers import int8_dot, q4_1, q5_0, q8_0

logger = logging.getLogger(__name__)


# CPU float32 products of up to ONEDNN_MAX_ROWS rows (decode steps, speculative verification,
# draft blocks, small batches) run through oneDNN's matmul on the weight reordered once into its
# blocked layout (``torch.ops.mkldnn``, what inductor uses for frozen CPU weights): MKL's X·Aᵀ
# re-reads a weight poorly at few rows, the reordered one streams 1.5-3x faster there
# (benchmarks/bench_linear_rows.py; AVX-512 and AVX2 alike). oneDNN builds and keeps a kernel per
# (shape, row count), ~0.5 MiB each, so rows are padded up to one of ONEDNN_ROW_BUCKETS (at most
# 25% more) and every bucket's kernel is built when the weight is reordered: memory stays flat
# while serving. Past ONEDNN_MAX_ROWS (prefill) MKL is as fast. The cost: a second copy of the
# float32 weights.
ONEDNN_ROW_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64)
ONEDNN_MAX_ROWS = ONEDNN_ROW_BUCKETS[-1]
ONEDNN_PACK_ROWS = 16  # the row count the reordered layout is tuned for
# CPU float16 products run through fbgemm's float16 GEMM (``quantized.linear_dynamic_fp16``, the
# weight packed once): float16 weights read at half float32's bytes, widened in registers, float32
# activations and accumulation; as fast as torch's float16 matmul at one row and 5-6x faster at 16
# and more (benchmarks/bench_quantized_linear.py). Where it is missing (non-x86 builds) or inside
# torch.compile, torch's float16 matmul runs up to CPU_FLOAT16_MAX_ROWS rows and float32 past them
# (its float16 kernel falls 2.8x behind float32 at 100 rows).
CPU_FLOAT16_MAX_ROWS = 4
# Weights that are exactly Q4_1 or Q8_0 (quantization="q4_1"; layers.q4_1, layers.q8_0) run through
# tpspec's kernels up to QUANTIZED_MAX_ROWS rows, where they beat fbgemm's float16 GEMM (they read
# 0.56 or 1.06 bytes a weight against 2 but decode each row block anew); past them through that
# float16 GEMM (benchmarks/README.md, Q4_1 weights).
QUANTIZED_MAX_ROWS = 8
# What each --quantization packs an exactly-Q4_1 weight, an exactly-Q8_0 one and any other in (the
# integer kernels of "w4a8" and "w4a16" take every row count: no float16 copy; "w4a16-fp16" takes
# w4a16's up to QUANTIZED_MAX_ROWS rows and a float16 copy past them, as "q4_1" does with its own).
# A Q5_0 weight (Gemma 3's) is packed as Q8_0 groups (layers.q5_0); by the integer kernels a Q4_K one as
# Q4_1 groups with float32 scales (layers.q4_k), a Q6_K one as Q8_0 groups with a float32 scale per 16
# weights (layers.q6_k).
EXACT_FORMATS = {
    "q4_1": (("q4_1", q4_1.quantize_exact), ("q8_0", q8_0.quantize_exact), ("q8_0", q5_0.quantize_exact)),
    **{method: ((f"q4_1_int8{tail}", functools.partial(int8_dot.quantize_exact_q4_1, activation_bits=bits)),
                (f"q8_0_int8{tail}", functools.partial(int8_dot.quantize_exact_q8_0, activation_bits=bits)),
                (f"q8_0_int8{tail}", functools.partial(int8_dot.quantize_exact_q5_0, activation_bits=bits)),
                (f"q4_1_int8{tail}", functools.partial(int8_dot.quantize_exact_q4_k, activation_bits=bits)),
                (f"q8_0_int8{tail}", functools.partial(int8_dot.quantize_exact_q6_k, activation_bits=bits)))
       for method, bits, tail in (("w4a8", 8, ""), ("w4a16", 15, ""), ("w4a16-fp16", 15, "_fp16"))},
}
INTEGER_FORMATS = ("q4_1_int8", "q8_0_int8")  # the packed formats of the integer kernels (batch-invariant)
# Formats packed with a float16 copy that takes the products of more than QUANTIZED_MAX_ROWS rows
# (data = (the kernel's weight, fbgemm's float16 one)), and the kernel that takes the others
INTEGER_WITH_FLOAT16_COPY = ("q4_1_int8_fp16", "q8_0_int8_fp16")  # "w4a16-fp16"'s
SMALL_ROWS_KERNEL = {"q4_1": q4_1.q4_1_linear, "q8_0": q8_0.q8_0_linear,
                     **{fmt: int8_dot.int8_linear for fmt in INTEGER_WITH_FLOAT16_COPY}}
WITH_FLOAT16_COPY = tuple(SMALL_ROWS_KERNEL)


def _row_bucket(rows: int) -> int:
    return next(b for b in ONEDNN_ROW_BUCKETS if b >= rows)


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.shape[0]
    pad = _row_bucket(rows) - rows
    x = F.pad(x, (0, 0, 0, pad)) if pad else x.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out[:rows] if pad else out


def _fbgemm_float16_linear(x: torch.Tensor, packed, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.ops.quantized.linear_dynamic_fp16(x.float(), packed)  # float32 out
    if bias is not None:
        out += bias
    return out.to(x.dtype)


@dataclass(frozen=True)
class PackedWeight:
    # "onednn" (float32, reordered), "fp16" (fbgemm, float16 weights: a float16 model's own, or a
    # float32 model's with quantization="fp16"), "q4_1" or "q8_0" (a float32 weight that is exactly
    # Q4_1 or Q8_0, with quantization="q4_1"), "q4_1_int8" or "q8_0_int8" (likewise, with "w4a8" or "w4a16"),
    # "q4_1_int8_fp16" or "q8_0_int8_fp16" (likewise, with "w4a16-fp16")
    format: str
    # the library's packed weight; for "q4_1" and "q8_0", (Q4_1Weight or Q8_0Weight, fbgemm's float16
    # one); for "q4_1_int8" and "q8_0_int8", int8_dot's Q4_1Int8Weight or Q8_0Int8Weight; for their
    # "_fp16" forms, (that weight, fbgemm's float16 one)
    data: object
    # what it was packed for ("onednn", "fp16", or a quantization method: "q4_1", "w4a8", "w4a16", "w4a16-fp16"),
    # what a changed weight is packed again for
    packed_for: str


# Read once: torch.compile cannot trace the library checks (a graph break in every layer).
_HAS_ONEDNN = torch.backends.mkldnn.is_available()
_HAS_FBGEMM = has_fbgemm()


def _packable(w: torch.Tensor) -> bool:
    return w.device.type == "cpu" and (
        w.dtype == torch.float32 and _HAS_ONEDNN or w.dtype == torch.float16 and _HAS_FBGEMM
    )


def _pack(w: torch.Tensor, fmt: str) -> PackedWeight:
    """``w`` packed in ``fmt``; "q4_1", "w4a8", "w4a16" and "w4a16-fp16" give their Q4_1 or Q8_0 format where ``w`` is
    exactly Q4_1 or Q8_0, or another format those layouts hold (Q5_0; Q4_K and Q6_K in the integer kernels':
    ``EXACT_FORMATS``), "fp16" where it is none."""
    if fmt in EXACT_FORMATS:
        for name, quantize_exact in EXACT_FORMATS[fmt]:
            exact = quantize_exact(w.detach())
            if exact is not None:  # "q4_1" and "w4a16-fp16" keep a float16 copy for products of more rows
                return PackedWeight(name, (exact, _pack(w, "fp16").data) if name in WITH_FLOAT16_COPY else exact, fmt)
        return PackedWeight("fp16", _pack(w, "fp16").data, fmt)
    if fmt == "fp16":  # fbgemm rounds a float32 weight to float16 here
        return PackedWeight(fmt, torch.ops.quantized.linear_prepack_fp16(w.detach().float(), None), fmt)
    packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), ONEDNN_PACK_ROWS)
    with torch.inference_mode():
        for rows in ONEDNN_ROW_BUCKETS:  # build every bucket's kernel now
            torch.ops.mkldnn._linear_pointwise(w.new_zeros(rows, w.shape[1]), packed, None, "none", [], "")
    return PackedWeight(fmt, packed, fmt)


# weight.data_ptr() -> (the weight, its _version when packed, the packed weight). Keyed by address,
# not by module, so that the custom op below, which gets only tensors, finds it too; an entry is
# used only while its weight lives with the same storage, shape, dtype and version.
_PACKED: dict[int, tuple[weakref.ref, int, PackedWeight]] = {}
_GENERATION = 0  # counts the entries made and dropped: unchanged, every entry looked up before is still there


def packing_generation() -> int:
    """A number that changes whenever an entry of the registry is made or dropped."""
    return _GENERATION


def packed_entry(w: torch.Tensor) -> tuple[weakref.ref, int, PackedWeight] | None:
    """The registry's entry at ``w``'s address (its weight, that weight's version when packed, the
    packed weight), None if there is none; it is ``w``'s own only if ``packed_weight_of(w)`` made or
    confirmed it since ``w`` last changed."""
    return _PACKED.get(w.data_ptr())


def packed_weight_of(w: torch.Tensor, fmt: str | None = None) -> PackedWeight | None:
    """``w`` packed for its CPU kernel: in ``fmt`` if given (``pack_cpu_weights``), else in the
    format it was packed in last, else its dtype's (float32: oneDNN, float16: fbgemm). Packed on
    first use, again (same format) when the weight changes; None where the plain kernel applies
    (not a CPU float32/float16 weight, or the library missing)."""
    if not _packable(w):
        return None
    entry = _PACKED.get(w.data_ptr())
    if entry is not None:
        ref, version, packed = entry
        t = ref()
        if t is not None and t.data_ptr() == w.data_ptr() and t.shape == w.shape and t.dtype == w.dtype:
            if t._version == version and (fmt in (None, packed.format) or packed.format in _formats_of(fmt)):
                return packed
            fmt = fmt or packed.packed_for  # changed: packed again as it was (a format name is no method)
    packed = _pack(w, fmt or ("fp16" if w.dtype == torch.float16 else "onednn"))
    key = w.data_ptr()
    _PACKED[key] = (weakref.ref(w, lambda ref, key=key: _forget(key, ref)), w._version, packed)
    global _GENERATION
    _GENERATION += 1
    return packed


def _formats_of(fmt: str | None) -> tuple[str, ...]:
    """The formats packing in ``fmt`` can give."""
    return (*(name for name, _ in EXACT_FORMATS[fmt]), "fp16") if fmt in EXACT_FORMATS else ()


def _forget(key: int, ref: weakref.ref) -> None:
    """A packed weight's tensor died: drop its entry, unless a newer weight took its address."""
    global _GENERATION
    if _PACKED.get(key, (None,))[0] is ref:
        del _PACKED[key]
        _GENERATION += 1


@torch.library.custom_op("tpspec::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``linear`` through ``weight``'s packed kernel, as one opaque op: what a ``torch.compile``d
    graph calls, so it fuses the elementwise work around the products and keeps the packed kernels.
    x: [num_rows, in_features] -> [num_rows, out_features]."""
    return linear(x, weight, bias, packed_weight_of(weight))


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


class PackedCPUWeight:
    """A layer whose CPU ``weight`` runs through its packed kernel (``packed_weight_of``)."""

    weight: nn.Parameter

    def packed_weight(self) -> PackedWeight | None:
        """``packed_weight_of(self.weight)``, its registry entry remembered on the layer while it
        is still the entry for the same tensor at the same version (a forward looks 121 weights up;
        this check is a forward 1.03-1.04x faster at one row than the full lookup)."""
        w = self.weight
        last = self.__dict__.get("_packed_last")  # (the weight, its _PACKED entry when looked up)
        if last is not None and last[0] is w:
            entry = _PACKED.get(w.data_ptr())
            if entry is last[1] and entry[1] == w._version:  # not re-packed, not changed since
                return entry[2]
        packed = packed_weight_of(w)
        entry = _PACKED.get(w.data_ptr())
        self.__dict__["_packed_last"] = (w, entry) if entry is not None and entry[2] is packed else None
        return packed

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x·Wᵀ (+ bias) through the packed kernel, inside a ``torch.compile``d graph too.
        x: [num_rows, in_features] -> [num_rows, out_features]."""
        if torch.compiler.is_compiling():
            if _packable(self.weight):
                return torch.ops.tpspec.packed_linear(x, self.weight, bias)
            return linear(x, self.weight, bias)
        return linear(x, self.weight, bias, self.packed_weight())


def pack_cpu_weights(model: nn.Module, quantization: str | None = None) -> collections.Counter:
    """Pack every such layer's weight now (at load), not in the first request's forward; with
    ``quantization="fp16"`` float32 weights in fbgemm's float16 layout, with "q4_1" those that are
    exactly Q4_1 or Q8_0 (or Q5_0) in their kernels' (and in float16 for more rows), with "w4a8" or
    "w4a16" those and Q4_K and Q6_K ones in the integer kernels', the rest in float16; logs and
    returns how many weights each format got."""
    formats = collections.Counter()
    for module in model.modules():
        if isinstance(module, PackedCPUWeight):
            w = module.weight
            quantized = quantization in QUANTIZATION_METHODS and w.dtype == torch.float32 and _packable(w) and _HAS_FBGEMM
            packed = packed_weight_of(w, quantization if quantized else None)
            formats[packed.format if packed is not None else str(w.dtype).removeprefix("torch.")] += 1
    if formats:
        logger.info("%s: linear weights by format: %s", type(model).__name__,
                    ", ".join(f"{n} {fmt}" for fmt, n in formats.most_common()))
    return formats


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | None = None) -> torch.Tensor:
    """``F.linear``, through ``packed`` (``packed_weight_of(weight)``) where given: the integer kernels
    for any row count (with a float16 copy, "w4a16-fp16": up to ``QUANTIZED_MAX_ROWS`` rows), the Q4_1
    and Q8_0 kernels up to ``QUANTIZED_MAX_ROWS`` rows, fbgemm for float16
    weights, oneDNN for float32 up to
    ``ONEDNN_MAX_ROWS`` rows. Without it, float16 on CPU with more than ``CPU_FLOAT16_MAX_ROWS`` rows
    goes through float32 (exact upcasts, float32 accumulation either way) and is rounded back to
    float16.
    x: [num_rows, in_features] -> [num_rows, out_features]."""
    if packed is not None:
        if packed.format in INTEGER_FORMATS:
            out = int8_dot.int8_linear(x, packed.data)
            return out if bias is None else out + bias
        if packed.format in WITH_FLOAT16_COPY:
            quantized, fp16 = packed.data
            if x.shape[0] > QUANTIZED_MAX_ROWS:
                return _fbgemm_float16_linear(x, fp16, bias)
            out = SMALL_ROWS_KERNEL[packed.format](x, quantized)
            return out if bias is None else out + bias
        if packed.format == "fp16":
            return _fbgemm_float16_linear(x, packed.data, bias)
        if x.shape[0] <= ONEDNN_MAX_ROWS:
            return _onednn_linear(x, packed.data, bias)
    if weight.dtype == torch.float16 and weight.device.type == "cpu" and x.shape[0] > CPU_FLOAT16_MAX_ROWS:
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(torch.float16)
    return F.linear(x, weight, bias)


def resolve_quantization(quantization: str | None, dtype: str, device_type: str,
                         batch_invariant: bool = False) -> str | None:
    """``auto`` means, for a float32 model on a CPU whose torch has fbgemm and where tpspec's CPU
    kernels build (AVX2, FMA, F16C and a C++ compiler; ``layers.cpu_kernels``): "w4a16" where the
    integer kernels take their AVX-512 VNNI path (``int8_dot.isa``) or ``batch_invariant`` asks for
    it, else "w4a16-fp16"; "fp16" where the kernels do not build; elsewhere None. "w4a16" multiplies
    weights that are exactly Q4_1 or Q8_0 (the default model's) by activations rounded to 15 bits in
    integer multiply-adds, every row count through one kernel (batch-invariant): on the default
    model 32 of 32 greedy 64-token HumanEval sequences identical to float32's, chosen-token logprobs
    within 0.0024 nats, and with VNNI faster than "q4_1" (exact weights, float32 widening up to 8
    rows, the "fp16" copy past that) at every row count. On the AVX2 path its products are faster
    than "q4_1"'s kernel up to 8 rows but slower than that float16 copy past them, so there "auto"
    picks "w4a16-fp16": "w4a16" up to 8 rows, the float16 copy past them (on a Zen 5's AVX2 path
    one sequence 1.57-1.59x "q4_1"'s tokens per second, 32 the same; 31 of 32 sequences identical
    one at a time; benchmarks/history.md). The bound every method is held to: at least 28
    of 32 such sequences identical and logprobs within 0.05 nats (``benchmarks/dtype_agreement.py``;
    "w4a8", llama.cpp's 8-bit activations, misses it: 14 of 32). ``none`` (or None): off."""
    if quantization is not None and quantization not in QUANTIZATION_OPTIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_OPTIONS}, got {quantization!r}")
    if quantization == "auto":
        from tpspec.cpu_features import has_fbgemm

        if device_type != "cpu" or dtype != "float32" or not has_fbgemm():
            return None
        from tpspec.layers import cpu_kernels

        if cpu_kernels.unavailable() is not None:
            return "fp16"
        from tpspec.layers import int8_dot

        return "w4a16" if batch_invariant or int8_dot.isa() == "avx512_vnni" else "w4a16-fp16"
    return None if quantization == "none" else quantization
