"""Per-request sampling parameters kept on every rank in slot-indexed arrays, as vLLM's Model
Runner V2 keeps its ``SamplingStates``: written once when the rank admits a request, read each
step by one gather over the step's rows (``gather``), never rebuilt from Python lists. The
arrays live on the host (NumPy): a gather of a few rows there costs a microsecond or two, where
a torch op on tensors this small costs tens; the gathered rows then go to the device."""

from __future__ import annotations

import numpy as np
import torch

from tpspec.sample.sampler import SamplingMetadata, to_int64
from tpspec.sampling_params import SamplingParams

INITIAL_SLOTS = 64  # slots grow by doubling when more requests are alive on the rank


class SamplingStates:
    def __init__(self, device: torch.device | str = "cpu", num_slots: int = INITIAL_SLOTS):
        self.device = torch.device(device)
        self.slot_of: dict[str, int] = {}
        self._free: list[int] = []
        self._floats = np.zeros((0, 3), dtype=np.float32)  # [slots, (temperature, top_p, min_p)]
        self._ints = np.zeros((0, 2), dtype=np.int64)  # [slots, (top_k, seed)]
        self._logprobs = np.zeros(0, dtype=np.int64)  # [slots] top logprobs asked for, -1 = none
        self._allocate(num_slots)

    def _allocate(self, num_slots: int) -> None:
        start = self._floats.shape[0]
        grow = num_slots - start
        self._floats = np.concatenate([self._floats, np.tile(np.array([[0.0, 1.0, 0.0]], dtype=np.float32), (grow, 1))])
        self._ints = np.concatenate([self._ints, np.zeros((grow, 2), dtype=np.int64)])
        self._logprobs = np.concatenate([self._logprobs, np.full(grow, -1, dtype=np.int64)])
        self._free += range(num_slots - 1, start - 1, -1)  # lowest slot first

    def add(self, req_id: str, params: SamplingParams, seed: int) -> int:
        """Write the request's parameters into a free slot; returns the slot."""
        if not self._free:
            self._allocate(2 * self._floats.shape[0])
        slot = self._free.pop()
        self.slot_of[req_id] = slot
        # Through a float32 tensor, as SamplingMetadata.from_params rounds them (a huge temperature is inf).
        self._floats[slot] = torch.tensor([params.temperature, params.top_p, params.min_p], dtype=torch.float32).numpy()
        self._ints[slot] = (params.top_k, to_int64(seed))
        self._logprobs[slot] = -1 if params.logprobs is None else params.logprobs
        return slot

    def remove(self, req_id: str) -> None:
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)

    def __len__(self) -> int:
        return len(self.slot_of)

    def gather(
        self,
        slots: np.ndarray,  # [rows] int64, the slot of each row's request
        positions: torch.Tensor,  # [rows] int64, the position of the token each row samples
    ) -> SamplingMetadata:
        """The sampling metadata of a step's rows: one gather per parameter block."""
        floats, ints = self._floats[slots], self._ints[slots]  # [rows, 3], [rows, 2]
        greedy = floats[:, 0] == 0.0
        filtered = (ints[:, 0] != 0) | (floats[:, 1] != 1.0) | (floats[:, 2] != 0.0)
        logprobs = int(self._logprobs[slots].max()) if slots.shape[0] else -1
        f, i = torch.from_numpy(floats).to(self.device), torch.from_numpy(ints).to(self.device)
        return SamplingMetadata(
            temperature=f[:, 0], top_p=f[:, 1], min_p=f[:, 2], top_k=i[:, 0], seeds=i[:, 1],
            positions=positions, max_num_logprobs=None if logprobs < 0 else logprobs,
            all_greedy=bool(greedy.all()), all_random=not bool(greedy.any()),
            no_top_k_top_p_min_p=not bool(filtered.any()),
        )
