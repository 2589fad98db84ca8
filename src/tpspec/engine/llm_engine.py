"""The synchronous engine: requests in, one scheduler step at a time, outputs out."""

from __future__ import annotations

import logging
import os
import random
import time


from tpspec.config import EngineConfig
from tpspec.distributed import comm
from tpspec.executor.executor import Executor
from tpspec.engine.detokenizer import IncrementalDetokenizer
from tpspec.engine.engine_args import EngineArgs, resolve_device
from tpspec.engine.kv_cache import BlockManager
from tpspec.engine.outputs import CompletionOutput, RequestOutput
from tpspec.engine.prompt_checks import check_prompt
from tpspec.engine.scheduler import Scheduler
from tpspec.engine.sequence import Request, RequestStatus
from tpspec.sampling_params import SamplingParams
from tpspec.engine.speculation.controller import PlanRequest, SpeculationLengthController
from tpspec.engine.speculation.metrics import SpecDecodeStats
from tpspec.engine.speculation.step_time import StepTimeModel
from tpspec.structured.grammar import grammar_compiler
from tpspec.tokenizer import Tokenizer
from tpspec.worker.step import StepOutput

logger = logging.getLogger(__name__)


class _Tracked:
    """Engine-side companions of a request: its detokenizer and what was already reported."""

    def __init__(self, req: Request, prompt: str | None, detok: IncrementalDetokenizer):
        self.req = req
        self.prompt = prompt
        self.detok = detok
        self.logprobs: list[dict[int, float]] | None = [] if req.sampling_params.logprobs is not None else None
        self.num_reported_tokens = 0
        self.pending_text = ""  # finalized text not yet reported

    def take_token(self, token_id: int) -> str | None:
        """``Request.on_token``: detokenize one output token; the stop string it completed, if any."""
        self.pending_text += self.detok.update([token_id])
        return self.detok.finished_by_stop


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, device_kind: str = "cpu"):
        self.config = config
        self.tokenizer = tokenizer
        self.executor = Executor(config, device_kind)
        num_blocks = self.executor.num_blocks
        self.block_manager = BlockManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                                          config.prefix_hash_lookahead)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, config.num_lookahead_tokens)
        spec = config.speculative
        self.spec_stats = SpecDecodeStats(spec.num_speculative_tokens) if spec else None
        self.controller = None
        if spec is not None:
            self.controller = SpeculationLengthController(spec, self._profile_step_time() if spec.adaptive else None)
        eos = set(config.arch.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self._grammar = None  # structured outputs' compiler (check_structured_outputs)
        self._rng = random.Random(config.seed)
        self._tracked: dict[str, _Tracked] = {}
        self._next_id = 0
        self.stats = {
            "num_requests": 0,
            "num_requests_finished": 0,
            "num_requests_aborted": 0,
            "num_prompt_tokens": 0,
            "num_generation_tokens": 0,
            "num_steps": 0,
            "num_preemptions": 0,
        }

    def _profile_step_time(self) -> StepTimeModel:
        """The adaptive controller's cost curves, measured on every rank at start-up."""
        return StepTimeModel.from_profile(self.config.speculative.method_spec, self.executor.call("profile_step_time"))

    @classmethod
    def from_args(cls, **engine_args) -> "LLMEngine":
        """An engine from ``EngineArgs`` keywords (``LLM``'s); an unknown keyword is a ``TypeError``
        naming it, a bad value a ``ValueError``."""
        args = EngineArgs(**engine_args)
        device_kind = resolve_device(args.device)
        config = args.create_engine_config(device_kind)  # every check before a worker starts
        return cls(config, Tokenizer.from_pretrained(config.model), device_kind)

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        after: str | None = None,
    ) -> str:
        """Queue a request; bad input raises ``ValueError`` and leaves the engine untouched.

        ``after``: another request with the same prompt (a sibling choice of ``n > 1``); with prefix
        caching this one is admitted only once that one has computed its prompt, and takes its
        blocks instead of prefilling the prompt again."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise ValueError(f"the engine runs one sequence per request, got n={params.n}: add each of "
                             "params.choices() (LLM.generate and the server do)")
        text, ids = (prompt, self.tokenizer.encode(prompt)) if isinstance(prompt, str) else (None, prompt)
        ids = check_prompt(ids, self.config.arch.vocab_size, self.config.scheduler.max_model_len)
        self.check_structured_outputs(params)
        max_len = self.config.scheduler.max_model_len
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already in use")
        max_tokens = max_len - len(ids) if params.max_tokens is None else min(params.max_tokens, max_len - len(ids))
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Request(request_id, ids, params, seed, max_tokens, self.eos_token_ids)
        if after is not None and self.config.cache.enable_prefix_caching:
            req.wait_for = after
        tracked = self._tracked[request_id] = _Tracked(req, text, IncrementalDetokenizer(self.tokenizer, ids, params))
        req.on_token = tracked.take_token
        self.scheduler.add_request(req)
        self.stats["num_requests"] += 1
        self.stats["num_prompt_tokens"] += len(ids)
        return request_id

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """Compile the request's grammar, if any (``GrammarError``, a ``ValueError``, naming the
        field, if the grammar engine rejects it); later compilations of the same grammar are cache
        hits, the ranks' in this process included. Thread-safe: the server compiles off the engine loop."""
        if params.structured_outputs is None:
            return
        if self._grammar is None:  # built on first use: most engines never constrain an output
            path = os.path.join(self.config.model, "tokenizer.json")
            self._grammar = grammar_compiler(path, self.config.arch.vocab_size, sorted(self.eos_token_ids))
        self._grammar.compile(params.structured_outputs)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks; returns its final output (None if unknown)."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return None
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self.stats["num_requests_aborted"] += 1
        return self._output(tracked)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- stepping -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns an output for every request that progressed or finished."""
        sched = self.scheduler.schedule()
        self.stats["num_preemptions"] += sched.num_preempted
        if not sched.requests:
            return []
        real_rows = sum(sched.num_new_tokens)
        plan = plan_reqs = None
        if self.controller is not None:
            max_len = self.config.scheduler.max_model_len
            plan_reqs = [  # a request proposes for a next step in which it will have one more token
                PlanRequest(req.request_id, sched.samples(i), req.num_spec_tokens, sched.max_spec[i],
                            max(0, min(self.controller.max_k, req.draft_room(max_len) - 1)), req.drafter_lag)
                for i, req in enumerate(sched.requests)
            ]
            plan = self.controller.plan(plan_reqs, real_rows)
            step_input = sched.step_input(plan.num_verify, plan.num_propose)
        else:
            step_input = sched.step_input([0] * len(sched.requests), [0] * len(sched.requests))
        t0 = time.perf_counter()
        result: StepOutput = self.executor.execute(step_input)
        step_s = time.perf_counter() - t0
        self.stats["num_steps"] += 1
        if plan is not None:
            for r, v, accepted in zip(plan_reqs, plan.num_verify, result.num_accepted):
                self.spec_stats.observe(v, accepted)
                self.controller.observe_verification(r.req_id, v, accepted)
            self.controller.observe_step(
                plan, plan_reqs, result.target_s, result.drafter_s, result.drafter_fed_rows, step_s
            )
        touched = self.scheduler.update(sched, result)
        index = {req.request_id: i for i, req in enumerate(sched.requests)}
        outputs = []
        for req, emitted in touched:
            i = index[req.request_id]
            tracked = self._tracked[req.request_id]
            before = len(req.output_token_ids) - emitted
            new_tokens = req.output_token_ids[before:]
            if tracked.logprobs is not None and result.logprobs[i] is not None:
                for token, lp in zip(new_tokens, result.logprobs[i]):
                    entry = dict(lp.top)
                    entry[token] = lp.token_logprob
                    tracked.logprobs.append(entry)
            self.stats["num_generation_tokens"] += emitted
            outputs.append(self._output(tracked))
        return outputs

    def _output(self, tracked: _Tracked) -> RequestOutput:
        req = tracked.req
        new_ids = req.output_token_ids[tracked.num_reported_tokens :]
        tracked.num_reported_tokens = len(req.output_token_ids)
        finished = req.status.finished
        if finished:  # release text held back as a possible stop-string start
            tracked.pending_text += tracked.detok.flush()
        new_text, tracked.pending_text = tracked.pending_text, ""
        if finished:
            self._tracked.pop(req.request_id, None)
            self.stats["num_requests_finished"] += 1
            if self.controller is not None:
                self.controller.forget(req.request_id)
        return RequestOutput(
            request_id=req.request_id,
            prompt=tracked.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=0,
                    text=tracked.detok.output_text,
                    token_ids=list(req.output_token_ids),
                    logprobs=tracked.logprobs,
                    finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason,
                )
            ],
            finished=finished,
            new_text=new_text,
            new_token_ids=new_ids,
        )

    # ---- introspection and teardown ---------------------------------------------------------
    def get_stats(self) -> dict:
        s = dict(self.stats)
        s.update(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks=self.block_manager.num_blocks,
            num_free_kv_blocks=self.block_manager.num_free_blocks,
            kv_cache_usage=self.block_manager.usage,
            num_cached_kv_blocks=self.block_manager.num_cached_blocks,
            prefix_cache_queries=self.block_manager.num_queried_tokens,
            prefix_cache_hits=self.block_manager.num_hit_tokens,
            comm=comm.get_comm_stats(),
            comm_bytes_per_row=self._comm_bytes_per_row(),
        )
        if self.spec_stats is not None:
            s.update(self.spec_stats.as_dict())
            s.update(self.controller.as_dict())
        return s

    @staticmethod
    def _comm_bytes_per_row() -> dict[str, float]:
        """Collective bytes per sampled row, per sampling site (``draft.sample``, ``verify.sample``,
        ``sample``), on the driver rank; 0 at TP 1."""
        stats = comm.get_comm_stats()
        return {
            site: stats.get(site, {}).get("bytes", 0) / rows for site, rows in comm.get_row_stats().items() if rows
        }

    def on_worker_death(self, callback) -> None:
        """Call ``callback(reason)`` once, from another thread, as soon as a TP worker dies
        (``Executor.on_death``); the engine's next call raises ``EngineDeadError`` either way."""
        self.executor.on_death(callback)

    def shutdown(self) -> None:
        self.executor.shutdown()
