"""Weight-only quantized linear kernels on this CPU, beside float32: which one `--quantization` uses.

Times one forward's matrices of the default model (30 layers of qkv 960×576, o 576×576, gate+up
3072×576, down 576×1536, and the tied LM head 49152×576; random weights) for each row count and
kernel, float32 activations in and out: the best of ``--repeats`` passes after one warm-up pass.

Kernels: ``float32`` (``F.linear``, MKL), ``float32-onednn`` (the weight reordered for oneDNN,
tpspec's float32 path up to 64 rows), ``float16`` (``F.linear`` on float16), ``int8`` (torch's
``_weight_int8pack_mm``: int8 weights, one float scale per output row), ``int4-g32`` (torch's
``_weight_int4pack_mm_for_cpu``: 4-bit weights, a scale and a zero per 32 inputs, GGUF Q4_1's
blocks), ``int8-dynamic`` (fbgemm's ``quantized.linear_dynamic``: the activations quantized to
8 bits too, per call), ``float16-fbgemm`` (fbgemm's float16 GEMM, ``--quantization fp16``),
``q4_1`` (tpspec's Q4_1 kernel, ``--quantization q4_1``; the weights rounded to Q4_1 first),
``w4a16`` and ``w4a8`` (tpspec's integer kernels on the same Q4_1 weights, activations rounded to
15 and 8 bits; ``ATEN_CPU_CAPABILITY=avx2`` takes their AVX2 path on an AVX-512 VNNI CPU).

  python3 benchmarks/bench_quantized_linear.py --result-file benchmarks/results/quantized_linear.json
  ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 python3 benchmarks/bench_quantized_linear.py

The first line printed names the CPU, its ISA flags and any ISA caps in effect.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import torch
import torch.nn.functional as F

from tpspec.cpu_features import cpu_model_and_isa, isa_caps

SHAPES = [(576 + 2 * 192, 576), (576, 576), (2 * 1536, 576), (576, 1536)]  # (out, in) per layer
LAYERS = 30
LM_HEAD = (49152, 576)
GROUP = 32

Kernel = Callable[[torch.Tensor], torch.Tensor]


def _float32(w: torch.Tensor) -> Kernel:
    return lambda x: F.linear(x, w)


def _float32_onednn(w: torch.Tensor) -> Kernel:
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _float16(w: torch.Tensor) -> Kernel:
    w16 = w.half()
    return lambda x: F.linear(x.half(), w16).float()


def _int8(w: torch.Tensor) -> Kernel:
    scale = w.abs().amax(1).clamp(min=1e-8) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, q, scale)


def _int4_g32(w: torch.Tensor) -> Kernel:
    n, k = w.shape
    g = w.view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_and_zeros = torch.stack([scale.T, (lo + 8 * scale).T], -1).contiguous()  # [k / GROUP, n, 2]
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_and_zeros)


def _int8_dynamic(w: torch.Tensor) -> Kernel:
    scale = w.abs().amax(1).clamp(min=1e-8) / 127
    qw = torch.quantize_per_channel(w, scale.double(), torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(qw, None)
    return lambda x: torch.ops.quantized.linear_dynamic(x, packed, True)


def _float16_fbgemm(w: torch.Tensor) -> Kernel:
    packed = torch.ops.quantized.linear_prepack_fp16(w, None)
    return lambda x: torch.ops.quantized.linear_dynamic_fp16(x, packed)


def _q4_1(w: torch.Tensor) -> Kernel:
    from tpspec.layers.q4_1 import q4_1_linear, quantize_exact, round_to_q4_1

    weight = quantize_exact(round_to_q4_1(w))  # as llama.cpp rounds them: exactly Q4_1
    return lambda x: q4_1_linear(x, weight)


def _integer(bits: int):
    def build(w: torch.Tensor) -> Kernel:
        from tpspec.layers.int8_dot import int8_linear, quantize_exact_q4_1
        from tpspec.layers.q4_1 import round_to_q4_1

        weight = quantize_exact_q4_1(round_to_q4_1(w), bits)
        return lambda x: int8_linear(x, weight)
    return build


KERNELS = {
    "float32": _float32,
    "float32-onednn": _float32_onednn,
    "float16": _float16,
    "int8": _int8,
    "int4-g32": _int4_g32,
    "int8-dynamic": _int8_dynamic,
    "float16-fbgemm": _float16_fbgemm,
    "q4_1": _q4_1,
    "w4a16": _integer(15),
    "w4a8": _integer(8),
}


def time_pass(kernels: list[tuple[Kernel, int]], rows: int, repeats: int) -> float:
    """Best seconds of one pass over every matrix, ``rows`` float32 input rows."""
    inputs = {k: torch.randn(rows, k) for _, k in kernels}
    with torch.inference_mode():
        for fn, k in kernels:
            fn(inputs[k])
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for fn, k in kernels:
                fn(inputs[k])
            best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 100])
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--result-file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = [torch.randn(o, i) / i**0.5 for _ in range(LAYERS) for o, i in SHAPES] + [torch.randn(*LM_HEAD)]
    model, flags = cpu_model_and_isa()
    caps = isa_caps()
    print(f"{model}; ISA {' '.join(flags)}; caps {caps or 'none'}; torch {torch.__version__}; {args.threads} thread(s)")
    print(f"ms per pass over {LAYERS} layers + the LM head")
    print("| rows | " + " | ".join(args.kernels) + " |")
    print("|---|" + "---|" * len(args.kernels))
    results = {name: {} for name in args.kernels}
    built = {name: [(KERNELS[name](w), w.shape[1]) for w in weights] for name in args.kernels}
    for rows in args.rows:
        for name in args.kernels:
            results[name][rows] = 1e3 * time_pass(built[name], rows, args.repeats)
        print(f"| {rows} | " + " | ".join(f"{results[n][rows]:.1f}" for n in args.kernels) + " |")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({"cpu": model, "isa": flags, "isa_caps": caps, "torch": torch.__version__,
                       "threads": args.threads, "ms_per_pass": results}, f, indent=1)


if __name__ == "__main__":
    main()
