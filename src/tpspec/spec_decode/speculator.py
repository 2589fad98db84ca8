"""``DraftModelSpeculator``: the base class of every model-based drafter.

It owns the one place where draft tokens are picked. Greedy drafting with
``use_local_argmax_reduction`` asks the draft model for ``get_top_tokens`` (each rank reduces
its vocab shard; only (value, id) pairs cross the wire, O(2·tp) per row); without the flag it
all-gathers the full logits and takes the argmax (O(vocab) per row). Probabilistic drafting
samples from the full draft distribution and keeps it for lossless verification. Subclasses
run their model and call ``sample_draft``; they never sample by themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpspec.config import EngineConfig, SpeculativeConfig
from tpspec.sample.gumbel import DRAFT, gumbel
from tpspec.sample.sampler import SamplingMetadata, apply_top_k_top_p_min_p

DRAFT_SAMPLE_SITE = "draft.sample"


@dataclass
class DraftSample:
    token_ids: torch.Tensor  # [rows] int64
    # Probabilistic drafting only: the draft distribution q each token was drawn from.
    dists: torch.Tensor | None = None  # [rows, vocab_size] float32


@dataclass
class DraftInput:
    """Per continuing sequence, after verification: the tokens the drafter (re)feeds.

    ``token_ids[i]`` are this step's real tokens of sequence i plus its accepted drafts and the
    new bonus/recovered token, starting at position ``start_pos[i]``; the drafter's KV below
    ``start_pos[i]`` is valid. ``propose[i]`` is False for a partial prefill chunk (feed only).
    """

    token_ids: list[list[int]]
    start_pos: list[int]
    block_tables: list[list[int]]
    propose: list[bool]
    sampling: SamplingMetadata | None  # one row per proposing sequence (probabilistic drafting)


@dataclass
class DraftOutput:
    drafts: list[list[int]]  # per sequence of the DraftInput ([] where propose is False)
    dists: list[torch.Tensor | None]  # per sequence: [k, vocab_size] q of each draft, or None


class DraftModelSpeculator:
    def __init__(self, spec_config: SpeculativeConfig, engine_config: EngineConfig, device: torch.device):
        self.spec_config = spec_config
        self.engine_config = engine_config
        self.device = device
        self.num_speculative_tokens = spec_config.num_speculative_tokens
        self.use_local_argmax_reduction = spec_config.use_local_argmax_reduction
        self.draft_sample_method = spec_config.draft_sample_method
        self.model = None

    # ---- loading --------------------------------------------------------------------------
    def load_model(self, target_model: torch.nn.Module, num_kv_slots: int) -> None:
        """Build the draft model (its KV cache gets ``num_kv_slots`` slots, the target's count, so
        the target's block tables address it) and validate the flag against it."""
        self.num_kv_slots = num_kv_slots
        self.model = self._build_model(target_model)
        self._validate_local_argmax_reduction()

    def _build_model(self, target_model: torch.nn.Module) -> torch.nn.Module:
        raise NotImplementedError

    def _validate_local_argmax_reduction(self) -> None:
        if not self.use_local_argmax_reduction:
            return
        if self.draft_sample_method == "probabilistic":
            raise ValueError(
                "speculative_config.use_local_argmax_reduction=true only applies to greedy draft selection; "
                "draft_sample_method='probabilistic' needs the full draft distribution"
            )
        if not callable(getattr(self.model, "get_top_tokens", None)):
            raise ValueError(
                f"speculative_config.use_local_argmax_reduction=true needs a draft model with get_top_tokens(); "
                f"{type(self.model).__name__} has none"
            )

    # ---- draft selection --------------------------------------------------------------------
    def _greedy_sample_draft(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [rows, hidden_size] -> [rows] int64 draft ids."""
        if self.use_local_argmax_reduction:
            return self.model.get_top_tokens(hidden, site=DRAFT_SAMPLE_SITE)
        return self.model.compute_logits(hidden, site=DRAFT_SAMPLE_SITE).argmax(dim=-1)

    def sample_draft(self, hidden: torch.Tensor, sampling: SamplingMetadata | None) -> DraftSample:
        """hidden: [rows, hidden_size]; ``sampling``: one row per hidden row (positions = the
        position each draft token will take). Greedy requests draft greedily either way."""
        if self.draft_sample_method == "greedy":
            return DraftSample(self._greedy_sample_draft(hidden))
        logits = self.model.compute_logits(hidden, site=DRAFT_SAMPLE_SITE)  # [rows, vocab_size]
        temperature = sampling.temperature.clamp(min=1e-2).unsqueeze(-1)  # greedy rows masked below
        scaled = apply_top_k_top_p_min_p(logits / temperature, sampling.top_k, sampling.top_p, sampling.min_p)
        dists = torch.softmax(scaled, dim=-1)
        token_ids = torch.arange(logits.shape[-1], device=logits.device)
        sampled = (scaled + gumbel(sampling.seeds, sampling.positions, token_ids, DRAFT)).argmax(dim=-1)
        greedy = sampling.temperature == 0
        if greedy.any():
            top = logits.argmax(dim=-1)
            sampled = torch.where(greedy, top, sampled)
            one_hot = torch.nn.functional.one_hot(top, logits.shape[-1]).float()
            dists = torch.where(greedy.unsqueeze(-1), one_hot, dists)
        return DraftSample(sampled, dists)

    # ---- proposing --------------------------------------------------------------------------
    def propose(self, inp: DraftInput, target_hidden: torch.Tensor | None) -> DraftOutput:
        raise NotImplementedError
