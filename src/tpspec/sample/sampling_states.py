"""Per-request sampling parameters kept on every rank in slot-indexed tensors, as vLLM's Model
Runner V2 keeps its ``SamplingStates``: written once when the rank admits a request, read each
step by one gather over the step's rows (``gather``), never rebuilt from Python lists."""

from __future__ import annotations

import torch

from tpspec.sample.sampler import SamplingMetadata, to_int64
from tpspec.sampling_params import SamplingParams

INITIAL_SLOTS = 64  # slots grow by doubling when more requests are alive on the rank


class SamplingStates:
    def __init__(self, device: torch.device | str = "cpu", num_slots: int = INITIAL_SLOTS):
        self.device = torch.device(device)
        self.slot_of: dict[str, int] = {}
        self._free: list[int] = []
        self._allocate(num_slots)

    def _allocate(self, num_slots: int) -> None:
        old = getattr(self, "temperature", None)
        start = 0 if old is None else old.shape[0]

        def grown(name: str, dtype: torch.dtype, fill: float | int) -> torch.Tensor:
            t = torch.full((num_slots,), fill, dtype=dtype, device=self.device)
            if old is not None:
                t[:start] = getattr(self, name)
            return t

        self.temperature = grown("temperature", torch.float32, 0.0)  # [slots], 0 = greedy
        self.top_k = grown("top_k", torch.int64, 0)  # [slots], 0 = off
        self.top_p = grown("top_p", torch.float32, 1.0)  # [slots], 1 = off
        self.min_p = grown("min_p", torch.float32, 0.0)  # [slots], 0 = off
        self.seeds = grown("seeds", torch.int64, 0)  # [slots]
        self.logprobs = grown("logprobs", torch.int64, -1)  # [slots] top logprobs asked for, -1 = none
        self._free += range(num_slots - 1, start - 1, -1)  # lowest slot first

    def add(self, req_id: str, params: SamplingParams, seed: int) -> int:
        """Write the request's parameters into a free slot; returns the slot."""
        if not self._free:
            self._allocate(2 * self.temperature.shape[0])
        slot = self._free.pop()
        self.slot_of[req_id] = slot
        # Through float32 tensors, as SamplingMetadata.from_params rounds them (a huge temperature is inf).
        self.temperature[slot] = torch.tensor(params.temperature, dtype=torch.float32)
        self.top_k[slot] = params.top_k
        self.top_p[slot] = torch.tensor(params.top_p, dtype=torch.float32)
        self.min_p[slot] = torch.tensor(params.min_p, dtype=torch.float32)
        self.seeds[slot] = to_int64(seed)
        self.logprobs[slot] = -1 if params.logprobs is None else params.logprobs
        return slot

    def remove(self, req_id: str) -> None:
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)

    def __len__(self) -> int:
        return len(self.slot_of)

    def gather(
        self,
        slots: torch.Tensor,  # [rows] int64, the slot of each row's request
        positions: torch.Tensor,  # [rows] int64, the position of the token each row samples
    ) -> SamplingMetadata:
        """The sampling metadata of a step's rows: one gather per parameter."""
        temperature = self.temperature.index_select(0, slots)
        top_k, top_p, min_p = (t.index_select(0, slots) for t in (self.top_k, self.top_p, self.min_p))
        logprobs = int(self.logprobs.index_select(0, slots).max()) if slots.numel() else -1
        greedy = temperature == 0
        return SamplingMetadata(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            seeds=self.seeds.index_select(0, slots), positions=positions,
            max_num_logprobs=None if logprobs < 0 else logprobs,
            all_greedy=bool(greedy.all()), all_random=not bool(greedy.any()),
            no_top_k_top_p_min_p=not bool(((top_k != 0) | (top_p != 1.0) | (min_p != 0.0)).any()),
        )
