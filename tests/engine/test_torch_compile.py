"""``torch_compile=True``: decode steps through the compiled decoder layer give the eager engine's
tokens (float32, greedy and seeded) through the same packed products (fbgemm's on the default
float16 weights; the compiled graph calls ``tpspec::packed_linear``) without graph breaks, and every
graph is compiled at start-up: serving batches of other sizes and contexts of every length compiles
nothing more. TP > 1 is refused."""

from __future__ import annotations

import pytest
import torch._dynamo.utils

import tpspec.layers.cpu_weights

from tpspec import LLM, SamplingParams

# 1 to ~20 tokens with the tiny tokenizer; 7 at once passes CPU_FLOAT16_MAX_ROWS + 1 decode rows.
PROMPTS = [
    "def add(a, b):",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "import",
    "Tensor parallelism splits the vocabulary across ranks, and",
    "for i in range(10):",
    "class",
    "Speculative decoding drafts tokens that the target then verifies",
]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SEEDED = [SamplingParams(temperature=1.5, seed=20 + i, top_p=0.95, max_tokens=20, ignore_eos=True) for i in range(3)]


def _generate(folder: str, tp: int, torch_compile: bool, monkeypatch) -> dict:
    packed_products = []
    for kernel in ("_onednn_linear", "_fbgemm_float16_linear"):  # float32 weights, float16 weights (the default)
        original = getattr(tpspec.layers.cpu_weights, kernel)
        monkeypatch.setattr(tpspec.layers.cpu_weights, kernel, lambda *a, f=original: packed_products.append(1) or f(*a))
    with LLM(folder, tensor_parallel_size=tp, num_kv_blocks=96, max_model_len=128, torch_compile=torch_compile) as llm:
        graphs_at_start = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        packed_products.clear()  # the start-up compilation's dummy steps
        model = llm.llm_engine.executor.runner.model  # TP 1: the driver runs the model
        compiled_layer, compiled_calls = model._compiled_layer, []
        if compiled_layer is not None:  # count the layer calls that go through the compiled graphs
            model._compiled_layer = lambda *args: compiled_calls.append(1) or compiled_layer(*args)
        one_at_a_time = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS[:2]]
        batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        seeded = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], SEEDED, use_tqdm=False)]
        graphs_after = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return dict(tokens=(one_at_a_time, batched, seeded), new_graphs=graphs_after - graphs_at_start,
                graphs_at_start=graphs_at_start, compiled_calls=len(compiled_calls), num_layers=len(model.layers),
                packed_products=len(packed_products))


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
def test_compiled_decode_equals_eager_and_compiles_only_at_start(fixture, request, monkeypatch):
    folder = request.getfixturevalue(fixture)
    torch._dynamo.utils.counters.clear()
    eager = _generate(folder, 1, torch_compile=False, monkeypatch=monkeypatch)
    assert eager["graphs_at_start"] == 0 and eager["new_graphs"] == 0
    compiled = _generate(folder, 1, torch_compile=True, monkeypatch=monkeypatch)
    # The driver is rank 0: its compilations are counted here. One graph per layer call: a break
    # splits the layer into several graphs with Python between them, slower than eager.
    assert compiled["graphs_at_start"] >= 1
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert compiled["new_graphs"] == 0
    # Decode steps really ran compiled: every layer of each of at least 19 steps per generate call.
    assert compiled["compiled_calls"] >= 3 * 19 * compiled["num_layers"]
    assert compiled["compiled_calls"] % compiled["num_layers"] == 0 and eager["compiled_calls"] == 0
    assert compiled["tokens"] == eager["tokens"]
    # Every product the eager engine ran through the packed weight, the compiled one did too.
    assert compiled["packed_products"] == eager["packed_products"] > compiled["compiled_calls"]
    assert all(len(t) == 20 for group in compiled["tokens"] for t in group)


def test_tensor_parallel_torch_compile_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="torch_compile needs tensor_parallel_size=1, got 2"):
        LLM(tiny_llama, tensor_parallel_size=2, torch_compile=True)
