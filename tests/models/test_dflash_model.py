"""The serving DFlash model (paged context K/V + block over the cache) equals the dense
training/reference model on the same checkpoint, at TP 1 and with its layers sharded at TP 2."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.distributed_utils import run_distributed

CTX = 11  # context tokens
BLOCK = 6  # [last token, MASK × 5]


def _inputs(width: int):
    gen = torch.Generator().manual_seed(7)
    features = torch.randn(CTX, width, generator=gen) * 2  # [CTX, n·H]
    block_ids = torch.tensor([17] + [999] * (BLOCK - 1))
    return features, block_ids


def _serving(target_folder: str, draft_folder: str):
    """Run on every rank: write the context, run one block; returns (hidden, top tokens)."""
    from tpspec.config import ModelArchConfig
    from tpspec.layers.attention import AttentionMetadata, allocate_kv_cache
    from tpspec.models.dflash import DFlashConfig, DFlashDraftModel
    from tpspec.models.llama import LlamaForCausalLM
    from tpspec.models.loader.safetensors import iterate_weights

    target = LlamaForCausalLM(ModelArchConfig.from_folder(target_folder))
    target.load_weights(iterate_weights(target_folder))
    cfg = DFlashConfig.from_folder(draft_folder)
    model = DFlashDraftModel(cfg, target)
    loaded = model.load_weights(iterate_weights(draft_folder))
    assert loaded == {n for n, _ in model.named_parameters()}
    block_size, num_blocks = 4, 8
    kv = allocate_kv_cache(cfg.arch.num_hidden_layers, num_blocks * block_size, model.kv_cache_shape, torch.float32)
    table = [5, 2, 7, 0, 3]  # scattered blocks: slots come from the table
    features, block_ids = _inputs(len(cfg.target_layer_ids) * cfg.arch.hidden_size)
    pos = torch.arange(CTX)
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(CTX)])
    with torch.inference_mode():
        model.write_context(features, pos, slots, kv)
        md = AttentionMetadata.build([BLOCK], [CTX + BLOCK], [table], block_size, torch.device("cpu"), non_causal_tail=[BLOCK])
        hidden = model(target.embed_tokens(block_ids), torch.arange(CTX, CTX + BLOCK), kv, md)
        return hidden, model.get_top_tokens(hidden), model.compute_logits(hidden).argmax(-1)


def _reference(target_folder: str, draft_folder: str, hidden_context: int = 0) -> torch.Tensor:
    """The dense training model on the same inputs; its first ``hidden_context`` context tokens masked."""
    from safetensors.torch import load_file

    from tpspec.models.dflash import DFlashConfig
    from tpspec.train.dflash_module import DFlashTrainModel

    cfg = DFlashConfig.from_folder(draft_folder)
    model = DFlashTrainModel(cfg)
    model.load_state_dict(load_file(f"{draft_folder}/model.safetensors"))
    embed = load_file(f"{target_folder}/model.safetensors")["model.embed_tokens.weight"]
    features, block_ids = _inputs(len(cfg.target_layer_ids) * cfg.arch.hidden_size)
    mask = torch.ones(1, BLOCK, CTX + BLOCK, dtype=torch.bool)
    mask[:, :, :hidden_context] = False
    with torch.no_grad():
        return model(features[None], torch.arange(CTX)[None], F.embedding(block_ids, embed)[None],
                     torch.arange(CTX, CTX + BLOCK)[None], mask)[0]


def test_serving_model_matches_reference_tp1(tiny_llama, tiny_dflash):
    ref = _reference(tiny_llama, tiny_dflash)
    hidden, top, full = _serving(tiny_llama, tiny_dflash)
    torch.testing.assert_close(hidden, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(top, full)


def test_serving_model_matches_reference_tp2(tiny_llama, tiny_dflash):
    ref = _reference(tiny_llama, tiny_dflash)
    (h0, top0, full0), (h1, top1, _) = run_distributed(_serving, 2, tiny_llama, tiny_dflash)
    torch.testing.assert_close(h0, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h1, h0, rtol=0, atol=0)  # ranks agree exactly after the all-reduce
    assert torch.equal(top0, full0) and torch.equal(top0, top1)


def test_context_is_what_the_block_reads(tiny_llama, tiny_dflash):
    """A block whose context is cut short must differ: the cache really carries the context."""
    ref = _reference(tiny_llama, tiny_dflash)
    assert (_reference(tiny_llama, tiny_dflash, hidden_context=3) - ref).abs().max() > 1e-2
