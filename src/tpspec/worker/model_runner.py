"""Runs the model on one rank: builds a step's tensors, runs the forward, samples.

Every rank runs this on the same inputs (SPMD); sampling uses the gathered logits, or with
``sampling_mode="vocab-parallel"`` each rank's own shard of them, and counter-based noise, so
every rank computes the same tokens (the same ones in both modes).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import torch
from tqdm import tqdm

from tpspec.config import EngineConfig
from tpspec.distributed import comm
from tpspec.distributed.parallel_state import get_tp_rank, get_tp_size
from tpspec.layers import cpu_kernels
from tpspec.layers.argmax import argmax_rows
from tpspec.layers.attention import AttentionMetadata, allocate_kv_cache, kv_cache_dtype, num_kv_blocks
from tpspec.layers.cpu_weights import CPU_FLOAT16_MAX_ROWS, INTEGER_FORMATS, pack_cpu_weights
from tpspec.models.loader.safetensors import iterate_weights
from tpspec.models.registry import get_model_class
from tpspec.sample import token_bitmask, vocab_parallel
from tpspec.sample.sampler import Sampler, SamplingMetadata, logprobs_of
from tpspec.sample.sampling_states import SamplingStates
from tpspec.sample.vocab_parallel import LogitsShard, shard_columns
from tpspec.spec_decode.rejection_sampler import RejectionSampler
from tpspec.spec_decode.speculator import DraftInput, Speculator, target_features
from tpspec.spec_decode.step_profile import profile_context, profile_grid
from tpspec.spec_decode.vocab_parallel_rejection import VocabParallelRejectionSampler
from tpspec.worker.grammars import RankGrammars
from tpspec.worker.request_state import RequestStates, ScheduledSeq
from tpspec.worker.step import NewRequest, StepInput, StepOutput, TokenLogprobs
from tpspec.worker.step_rows import StepRows

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Decode steps run at start-up with ``torch_compile``, as (batch size, context blocks): a size that
# changes between two compilations becomes dynamic in the next graph (torch.compile's automatic
# dynamic shapes), size 1 is always specialized, and ``layers.cpu_weights.linear`` branches past
# CPU_FLOAT16_MAX_ROWS rows. After these, no batch size or context length compiles again.
COMPILE_DECODE_WARMUP = ((1, 1), (1, 2), (2, 1), (CPU_FLOAT16_MAX_ROWS + 1, 2))


# The start-up step-time profile (speculation-length controller): row counts up to this many are
# measured, larger ones extrapolated linearly (compute-bound there). Points up to
# PROFILE_REPEAT_ROWS rows (fast, and the noisiest) are timed PROFILE_REPEATS times, the rest
# PROFILE_REPEATS_LARGE times (a single run of a large step was off by up to 2x).
PROFILE_MAX_ROWS = 256
PROFILE_REPEAT_ROWS = 16
PROFILE_REPEATS = 3
PROFILE_REPEATS_LARGE = 2


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device):
        self.config = config
        self.device = device
        self.dtype = DTYPES[config.dtype]
        self.block_size = config.cache.block_size
        self.sampler = Sampler(argmax_rows)
        self.requests = RequestStates()
        self.sampling_states = SamplingStates(device)
        self.grammars = RankGrammars(config)  # structured outputs
        self.speculator: Speculator | None = None
        self.rejection_sampler: RejectionSampler | None = None

    def load_model(self) -> None:
        t0 = time.perf_counter()
        cls = get_model_class(self.config.arch.architecture)
        with torch.device(self.device):
            self.model = cls(self.config.arch, self.dtype)
        loaded = self.model.load_weights(iterate_weights(self.config.model, show_progress=get_tp_rank() == 0))
        missing = {n for n, _ in self.model.named_parameters()} - loaded
        if missing:
            raise ValueError(f"checkpoint {self.config.model!r} lacks weights: {sorted(missing)[:5]}")
        self.model.eval()
        if self.device.type == "cpu":
            reason = cpu_kernels.unavailable()  # builds tpspec's CPU kernels on first use; decode ops then take them
            if reason:
                logger.info("tpspec's CPU kernels are unavailable (%s): PyTorch's ops instead", reason)
        formats = pack_cpu_weights(self.model, self.config.quantization)
        if self.config.batch_invariant and set(formats) - set(INTEGER_FORMATS):
            raise ValueError(
                f"batch_invariant needs every linear weight in the integer kernels (exactly Q4_1, Q4_K, Q5_0, Q6_K or Q8_0, "
                f"as a Q4_1 GGUF's are); this model's formats: {dict(formats)}"
            )
        self.num_blocks = num_kv_blocks(self.config, self.device)
        self.kv_caches = allocate_kv_cache(
            self.config.arch.num_hidden_layers, self.num_blocks * self.block_size, self.model.kv_cache_shape,
            kv_cache_dtype(self.config.cache.kv_cache_dtype, self.dtype, self.device), self.device,
        )
        logger.info(
            "rank %d: loaded %d tensors (%d local parameters) in %.1f s; KV cache %d blocks of %d tokens",
            get_tp_rank(), len(loaded), sum(p.numel() for p in self.model.parameters()),
            time.perf_counter() - t0, self.num_blocks, self.block_size,
        )
        if self.config.torch_compile:
            self.compile_decode()
        self.load_speculator()

    @torch.inference_mode()
    def compile_decode(self) -> None:
        """Compile the target's decode steps now (``torch_compile``), not on the first requests:
        the dummy decode steps of ``COMPILE_DECODE_WARMUP``, in the first blocks (no request owns
        a block yet)."""
        t0 = time.perf_counter()
        # One engine per process at a time: drop an earlier engine's graphs (another dtype, other
        # shapes), which would be checked first on every call and count against the recompile limit.
        torch.compiler.reset()
        self.model.compile_decode_layers()
        steps = tqdm(COMPILE_DECODE_WARMUP, desc="Compiling decode steps", unit="step", disable=get_tp_rank() != 0, leave=False)
        for batch, blocks in steps:
            blocks = min(blocks, self.num_blocks)
            ctx = blocks * self.block_size
            table = list(range(blocks))
            md = AttentionMetadata.build([1] * batch, [ctx] * batch, [table] * batch, self.block_size, self.device)
            ids = torch.zeros(batch, dtype=torch.int64, device=self.device)
            positions = torch.full((batch,), ctx - 1, device=self.device)
            self.model(ids, positions, self.kv_caches, md)
        logger.info("rank %d: compiled decode steps in %.1f s", get_tp_rank(), time.perf_counter() - t0)

    @torch.inference_mode()
    def profile_step_time(self) -> dict[str, list]:
        """Time the target's forward + LM head + argmax over the row counts of
        ``step_profile.profile_grid`` as verifications (sequences of k + 1 tokens) and over as many
        sequences of one token as a step may hold (decodes), and the drafter's feed and one
        drafting pass (dummy inputs in the first KV blocks, before any request owns one): the
        speculation-length controller's start-up cost curves (``StepTimeModel.from_profile``).
        Every rank runs the same forwards (their collectives line up); rank 0's times count."""
        spec, sc = self.config.speculative, self.config.scheduler
        k = spec.num_speculative_tokens
        rows_grid = profile_grid(min(sc.max_num_batched_tokens, sc.max_num_seqs * (k + 1), PROFILE_MAX_ROWS))
        seqs_grid = profile_grid(min(sc.max_num_batched_tokens, sc.max_num_seqs))

        def forward(rows: int, query_len: int) -> None:
            context = profile_context(sc.max_model_len, self.num_blocks * self.block_size, query_len)
            md, positions = AttentionMetadata.dummy(rows, query_len, self.block_size, self.device, context=context)
            hidden, _ = self.model(torch.zeros(rows, dtype=torch.int64, device=self.device), positions, self.kv_caches, md)
            self.model.compute_logits(hidden, "profile").argmax(dim=-1)

        t0 = time.perf_counter()
        out = {
            "rows_grid": rows_grid,
            "rows_s": [self._time(lambda r: forward(r, k + 1), r) for r in rows_grid],
            "seqs_grid": seqs_grid,
            "decode_s": [self._time(lambda r: forward(r, 1), r) for r in seqs_grid],
        }
        out["feed_s"] = [self._time(self.speculator.dummy_feed, r) for r in rows_grid]
        out["draft_pass_s"] = [self._time(self.speculator.dummy_pass, r) for r in rows_grid]
        comm.reset_comm_stats()  # the profile's collectives are not the engine's traffic
        logger.info("rank %d: profiled step times over %s rows and %s sequences in %.1f s", get_tp_rank(), rows_grid,
                    seqs_grid, time.perf_counter() - t0)
        return out

    def _time(self, fn, rows: int) -> float:
        """Seconds of ``fn(rows)``, the fastest of a few runs (the first call of ``fn`` warms it
        up; the first run of a shape can pay for allocations, and this machine is noisy)."""
        if rows == 1:
            fn(rows)
        best = float("inf")
        for _ in range(PROFILE_REPEATS if rows <= PROFILE_REPEAT_ROWS else PROFILE_REPEATS_LARGE):
            t0 = self._now()
            fn(rows)
            best = min(best, self._now() - t0)
        return best

    def load_speculator(self) -> None:
        """Build the speculator of the configured method (its row in ``config.speculative_methods``), if any."""
        spec = self.config.speculative
        if spec is None:
            return
        self.speculator = spec.method_spec.speculator_class()(spec, self.config, self.device)
        self.speculator.load(self.model, self.num_blocks * self.block_size)
        self.rejection_sampler = RejectionSampler()

    # ---- per-request state ------------------------------------------------------------------
    def add_request(self, new: NewRequest) -> None:
        self.requests.add(new)
        self.sampling_states.add(new.req_id, new.params, new.seed)
        self.grammars.add(new)
        if self.speculator is not None:
            self.speculator.add(new.req_id)

    def forget_request(self, req_id: str) -> None:
        self.requests.forget(req_id)
        self.sampling_states.remove(req_id)
        self.grammars.forget(req_id)
        if self.speculator is not None:
            self.speculator.forget(req_id)

    def _now(self) -> float:
        """The clock of the step's phase times and of the start-up profile (the controller's step-time
        model learns from both). On a CPU at TP 1, when the engine runs on a thread of its own
        (``AsyncEngine``: under ``tpspec serve``), this thread's CPU time: the caller's threads take
        the GIL from it mid-step (a forced switch every few ms while requests stream), and counted
        as wall time those waits landed in whichever phase was running; served at one stream the
        model so learned a drafter feed of 4.2 ms where it costs 0.4 (offline: 0.55), and held
        EAGLE-3 at k = 0. Elsewhere wall time: on the main thread (``LLM``, ``LLMEngine``: nothing
        takes the GIL from it, and wall time also counts an OpenMP barrier's sleep; with the thread
        clock offline EAGLE-3 held at k = 0 ran at 0.92x and 0.94x plain at 8 and 32 requests, 0.95x
        and 1.00x with wall time, one run each), on a GPU after synchronizing, and at TP > 1, where
        waiting for the other ranks in a collective is part of a step."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif (self.device.type == "cpu" and get_tp_size() == 1
              and threading.current_thread() is not threading.main_thread()):
            return time.thread_time()
        return time.perf_counter()

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        """One engine step: build inputs → target forward → verify → propose."""
        t0 = self._now()
        for req_id in step.finished_req_ids:
            self.forget_request(req_id)
        for new in step.new_requests:
            self.add_request(new)
        if not step.seqs:  # only ended requests to forget
            return StepOutput([], [])
        seqs = self._schedule(step)
        rows = StepRows.of(seqs, self.sampling_states.slot_of)
        input_ids, positions, md = self._build_inputs(seqs, rows)
        capture = self.speculator.capture_layers if self.speculator is not None else ()
        hidden, captured = self.model(input_ids, positions, self.kv_caches, md, capture)
        sampled, num_accepted, logprobs, meta = self._sample(seqs, rows, hidden)
        t1 = self._now()
        # The rank's copy of each request takes its new tokens; one that ended is forgotten and drafts no more.
        ended = [bool(emitted) and self.requests.append(s.req, emitted) for s, emitted in zip(seqs, sampled)]
        if len(self.grammars):
            for s, emitted in zip(seqs, sampled):
                self.grammars.accept(s.req_id, emitted)
        num_drafts, lag, drafter_start = [0] * len(seqs), [], []
        fed_rows = 0
        if self.speculator is not None:
            wanted = [s.step.num_draft if emitted and not end else 0 for s, emitted, end in zip(seqs, sampled, ended)]
            fed_rows = self._propose(seqs, sampled, wanted, captured, hidden, rows, meta)
            if self.config.cache.enable_prefix_caching:  # an ended request's blocks are cached: its backlog settled
                for s, end in zip(seqs, ended):
                    if end:
                        fed_rows += self.speculator.settle(s.req_id, s.block_table)
            num_drafts = [len(self.speculator.drafts(s.req_id)) for s in seqs]
            lag = [self.speculator.lag(s.req_id) for s in seqs]
            drafter_start = [self.speculator.context_start(s.req_id) for s in seqs]
        for s, end in zip(seqs, ended):
            if end:
                self.forget_request(s.req_id)
        t2 = self._now()
        return StepOutput(sampled, logprobs, num_accepted, num_drafts, lag, drafter_start, target_s=t1 - t0,
                          drafter_s=t2 - t1, drafter_fed_rows=fed_rows)

    def _schedule(self, step: StepInput) -> list[ScheduledSeq]:
        """Each scheduled request's share of the step: its tokens to feed, then the drafts to verify."""
        seqs = []
        for s, req in zip(step.seqs, self.requests.schedule(step.seqs)):
            drafts: list[int] = []
            if self.speculator is not None:
                if s.drafter_start is not None:  # the request's first step, or a restart
                    self.speculator.restart(s.req_id, s.drafter_start)
                drafts = self.speculator.drafts(s.req_id)
            if s.num_spec > len(drafts):
                raise RuntimeError(f"request {s.req_id!r}: asked to verify {s.num_spec} drafts, the ranks hold {len(drafts)}")
            end = s.start_pos + s.num_new_tokens
            tokens = req.token_ids_between(s.start_pos, end) + drafts[: s.num_spec]
            seqs.append(ScheduledSeq(s, req, tokens, sample=end == req.num_tokens))
        return seqs

    def _build_inputs(
        self, seqs: list[ScheduledSeq], rows: StepRows
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The target forward's inputs: token ids and positions [num_tokens], attention metadata."""
        input_ids = torch.tensor(list(itertools.chain.from_iterable(s.token_ids for s in seqs)), dtype=torch.int64)
        md = AttentionMetadata.build(
            rows.num_tokens.tolist(), (rows.start_pos + rows.num_tokens).tolist(), [s.block_table for s in seqs],
            self.block_size, self.device,
        )
        return input_ids.to(self.device), torch.from_numpy(rows.token_positions()).to(self.device), md

    def _sample(
        self, seqs: list[ScheduledSeq], rows: StepRows, hidden: torch.Tensor,  # [num_tokens, H]
    ) -> tuple[list[list[int]], list[int], list[list[TokenLogprobs] | None], SamplingMetadata | None]:
        """Verify every sampling sequence's drafts (k = 0: plain sampling). Returns per sequence
        its emitted tokens (accepted drafts + one recovered/bonus token; [] for a partial prefill
        chunk), its accepted drafts and their logprobs if asked for; and the step's sampling
        metadata (None: nothing sampled)."""
        sampled: list[list[int]] = [[] for _ in seqs]
        logprobs: list[list[TokenLogprobs] | None] = [None] * len(seqs)
        num_accepted = [0] * len(seqs)
        if rows.num_rows == 0:
            return sampled, num_accepted, logprobs, None
        sampling = rows.sampling.tolist()
        site = "sample" if self.rejection_sampler is None else "verify.sample"
        index = torch.from_numpy(rows.hidden_rows).to(self.device)
        if self.config.sampling_mode == "vocab-parallel":  # this rank's columns: no O(vocab) gather
            logits = self.model.compute_logits_shard(hidden[index])  # LogitsShard [rows, shard_size]
        else:
            logits = self.model.compute_logits(hidden[index], site)  # [rows, vocab]
        comm.count_rows(site, rows.num_rows)
        # The step's one sampling metadata: a gather from the slot-indexed states; drafting indexes it.
        meta = self.sampling_states.gather(rows.slots, torch.from_numpy(rows.positions).to(self.device))
        if len(self.grammars):  # structured outputs: forbidden tokens to -inf (each rank its own columns)
            bitmask = self.grammars.verify_bitmask([seqs[i].req_id for i in sampling], [seqs[i].num_spec for i in sampling])
            if bitmask is not None:
                argmax_only = meta.temperature == 0 if meta.max_num_logprobs is None else None
                token_bitmask.apply(logits, bitmask.to(self.device), argmax_only=argmax_only)
        if self.rejection_sampler is None or not rows.num_spec.any():
            # No drafts to verify: the Sampler, which is what verification of k = 0 draws.
            # Logprobs of emitted tokens come from _logprobs below, for both paths: don't compute them twice.
            if isinstance(logits, LogitsShard):
                tokens = vocab_parallel.sample(logits, meta, site).tolist()
            else:
                tokens = self.sampler(logits, meta, with_logprobs=False).sampled_token_ids.tolist()
            for j, i in enumerate(sampling):
                sampled[i] = [tokens[j]]
        else:
            out = self._verify(seqs, sampling, logits, meta, site)
            for j, i in enumerate(sampling):
                sampled[i], num_accepted[i] = out.output_token_ids[j], out.num_accepted[j]
        self._logprobs(seqs, sampling, logits, sampled, logprobs, site)
        return sampled, num_accepted, logprobs, meta

    def _verify(
        self, seqs: list[ScheduledSeq], sampling: list[int], logits: torch.Tensor | LogitsShard, meta: SamplingMetadata,
        site: str,
    ):
        """Rejection-sample the drafts of every sampling sequence (k = 0: plain sampling), from the
        gathered logits ``[rows, vocab]`` or (vocab-parallel) this rank's ``LogitsShard`` of them."""
        draft_ids, num_drafts, dists = [], [], []
        for i in sampling:
            s = seqs[i]
            drafts = s.token_ids[len(s.token_ids) - s.num_spec :]
            draft_ids += drafts
            num_drafts.append(s.num_spec)
            q = self.speculator.draft_dists(s.req_id)
            # The driver may verify only a prefix of the drafts (the chosen k, max_tokens, token
            # budget); their q is the same prefix.
            dists.append(q[: s.num_spec] if q is not None and s.num_spec else None)
        draft_tensor = torch.tensor(draft_ids, dtype=torch.int64, device=self.device)
        sharded = isinstance(logits, LogitsShard)
        draft_dists = None
        if any(q is not None for q in dists) and draft_ids:
            # q as the drafter kept it: full width ([k, vocab], or [k, padded vocab] from a replicated
            # draft), or this rank's columns (use_local_argmax_reduction); made what the verifier reads.
            full_width = not self.speculator.dists_sharded
            kept = torch.cat([q for q in dists if q is not None])  # [m, width]
            if sharded:
                kept = shard_columns(kept, logits.vocab_start, logits.shard_size, 0.0) if full_width else kept
                point = (logits.token_ids() == draft_tensor.unsqueeze(-1)).float()  # greedy drafts: point masses
            else:
                vocab = logits.shape[-1]
                kept = (kept if full_width else comm.all_gather(kept, site, dim=-1))[:, :vocab]
                point = torch.nn.functional.one_hot(draft_tensor, vocab).float()
            parts, off, used = [], 0, 0
            for q, n in zip(dists, num_drafts):
                parts.append(kept[used : used + n] if q is not None else point[off : off + n])
                used += n if q is not None else 0
                off += n
            draft_dists = torch.cat(parts)
        if sharded:
            return VocabParallelRejectionSampler()(logits, draft_tensor, num_drafts, meta, site, draft_dists)
        probs = None if draft_dists is None else draft_dists.gather(-1, draft_tensor.unsqueeze(-1)).squeeze(-1)
        return self.rejection_sampler(logits, draft_tensor, num_drafts, meta, draft_probs=probs, draft_dists=draft_dists)

    def _logprobs(self, seqs, sampling, logits, sampled, logprobs, site: str) -> None:
        """Log-probabilities (of the raw target distribution) of each emitted token and the
        request's top n, if asked for: from the gathered logits, or (vocab-parallel) one
        exchange of per-shard statistics (``vocab_parallel.logprobs_of``)."""
        wanted = [j for j, i in enumerate(sampling) if seqs[i].params.logprobs is not None]
        if not wanted:
            return
        offsets = [0]
        for i in sampling:
            offsets.append(offsets[-1] + seqs[i].num_spec + 1)
        rows = [offsets[j] + t for j in wanted for t in range(len(sampled[sampling[j]]))]
        tokens = torch.tensor([t for j in wanted for t in sampled[sampling[j]]], dtype=torch.int64, device=self.device)
        index = torch.tensor(rows, dtype=torch.int64, device=self.device)
        n = max(seqs[sampling[j]].params.logprobs for j in wanted)
        if isinstance(logits, LogitsShard):
            out = vocab_parallel.logprobs_of(logits.select(index), tokens, n, site)
        else:
            out = logprobs_of(logits.index_select(0, index), tokens, n)
        token_lp, top_lp, top_ids = out.token_logprob.tolist(), out.topk_logprobs.tolist(), out.topk_token_ids.tolist()
        r = 0
        for j in wanted:
            i = sampling[j]
            n_i = seqs[i].params.logprobs  # the first n_i of the top n are the top n_i
            entries = []
            for _ in sampled[i]:
                entries.append(TokenLogprobs(token_lp[r], list(zip(top_ids[r][:n_i], top_lp[r][:n_i]))))
                r += 1
            logprobs[i] = entries

    def _propose(
        self, seqs: list[ScheduledSeq], sampled: list[list[int]], wanted: list[int],
        captured: dict[int, torch.Tensor],
        final_hidden: torch.Tensor,  # [num_tokens, H] the target's final-norm output
        rows: StepRows, meta: SamplingMetadata | None,
    ) -> int:
        """Feed the drafter this step's verified tokens (and, if it reads them, the target's hidden
        states of those tokens) whatever k is, so its state stays valid, and have it hold
        ``wanted[i]`` drafts for each request's next step (0: none). Returns the rows the drafter
        fed (``Speculator.propose``)."""
        token_ids, context_rows = [], []
        offset = 0
        for s, emitted in zip(seqs, sampled):
            real = s.token_ids[: len(s.token_ids) - s.num_spec]
            token_ids.append(real + emitted)  # emitted = accepted drafts + bonus/recovered token
            # The target ran every kept token but the last emitted one (the bonus/recovered token).
            context_rows.extend(range(offset, offset + len(token_ids[-1]) - int(bool(emitted))))
            offset += len(s.token_ids)
        features = None
        if self.speculator.capture_layers:
            features = target_features(self.speculator.capture_layers, captured, final_hidden)  # a new tensor
            if len(context_rows) < offset:  # some rows are not kept (the last emitted token's, rejected drafts')
                features = features[torch.tensor(context_rows, dtype=torch.int64, device=self.device)]
        proposing = [i for i, n in enumerate(wanted) if n]
        sampling = None
        if proposing and self.speculator.draft_sample_method == "probabilistic":
            # One row per proposing sequence: its bonus row of the step's metadata (a proposing
            # sequence emitted tokens, so it was sampled); the drafter sets the positions it draws at.
            sampling = meta.select(torch.from_numpy(rows.last_row[proposing]).to(self.device))
        return self.speculator.propose(DraftInput(
            [s.req_id for s in seqs], token_ids, [s.start_pos for s in seqs], [s.block_table for s in seqs],
            [bool(e) for e in sampled], wanted, sampling, features, lambda i: seqs[i].req.all_token_ids,
            [self.grammars.get(s.req_id) for s in seqs] if len(self.grammars) else None,
        ))
