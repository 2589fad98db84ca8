"""A stand-in for ``LLMEngine``: emits one token per step per request, records which thread called
it, and can be told to die (raise ``EngineDeadError``) at its next step."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from tpspec.executor.executor import EngineDeadError
from tpspec.engine.outputs import CompletionOutput, RequestOutput


VOCAB_SIZE = 50_000


class FakeEngine:
    def __init__(self, tokenizer=None, max_model_len: int = 64, step_s: float = 0.002, default_tokens: int = 3):
        self.tokenizer = tokenizer
        self.config = SimpleNamespace(scheduler=SimpleNamespace(max_model_len=max_model_len), model="fake",
                                      arch=SimpleNamespace(vocab_size=VOCAB_SIZE))
        self.step_s = step_s
        self.default_tokens = default_tokens
        self.requests: dict[str, dict] = {}
        self.aborted: list[str] = []
        self.threads: set[int] = set()
        self.die = threading.Event()
        self.hold = threading.Event()  # while set, step() emits nothing (requests stay running)
        self.num_has_unfinished_calls = 0
        self.shut_down = False
        self.stats = {"num_steps": 0}
        self.death_listeners = []  # LLMEngine.on_worker_death: told by kill_worker()

    def _called(self) -> None:
        self.threads.add(threading.get_ident())

    def add_request(self, prompt, params=None, request_id=None, after=None) -> str:
        self._called()
        if prompt == "bad" or prompt == []:
            raise ValueError("prompt is bad")
        max_tokens = getattr(params, "max_tokens", None) or self.default_tokens
        ids = list(prompt) if isinstance(prompt, list) else [1]
        self.requests[request_id] = dict(prompt_ids=ids, out=[], max_tokens=max_tokens, reported=0)
        return request_id

    def _output(self, rid: str, r: dict, finish_reason: str | None) -> RequestOutput:
        new = r["out"][r["reported"]:]
        r["reported"] = len(r["out"])
        return RequestOutput(
            request_id=rid, prompt=None, prompt_token_ids=r["prompt_ids"],
            outputs=[CompletionOutput(0, "".join(f"t{t} " for t in r["out"]), list(r["out"]), None, finish_reason)],
            finished=finish_reason is not None, new_text="".join(f"t{t} " for t in new), new_token_ids=new,
        )

    def abort_request(self, request_id: str):
        self._called()
        r = self.requests.pop(request_id, None)
        if r is None:
            return None
        self.aborted.append(request_id)
        return self._output(request_id, r, "abort")

    def has_unfinished_requests(self) -> bool:
        self._called()
        self.num_has_unfinished_calls += 1
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self._called()
        if self.die.is_set():
            raise EngineDeadError("TP worker rank 1 (pid 0) died with exit code -9")
        time.sleep(self.step_s)
        self.stats["num_steps"] += 1
        if self.hold.is_set():
            return []
        outs = []
        for rid, r in list(self.requests.items()):
            r["out"].append(10 + len(r["out"]))
            done = len(r["out"]) >= r["max_tokens"]
            outs.append(self._output(rid, r, "length" if done else None))
            if done:
                del self.requests[rid]
        return outs

    def get_stats(self) -> dict:
        self._called()
        return {"num_steps": self.stats["num_steps"], "num_running": len(self.requests), "num_waiting": 0}

    def on_worker_death(self, callback) -> None:
        self.death_listeners.append(callback)

    def kill_worker(self) -> None:
        """What the executor's watchdog does when a worker dies: the listeners are told, from
        another thread; the next step would raise too."""
        self.die.set()
        for callback in self.death_listeners:
            callback("TP worker rank 1 (pid 0) died with exit code -9")

    def shutdown(self) -> None:
        self._called()
        self.shut_down = True
