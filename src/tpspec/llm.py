"""Offline API shaped like vLLM's ``LLM``."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from tqdm import tqdm

from tpspec.engine.llm_engine import LLMEngine
from tpspec.engine.outputs import RequestOutput
from tpspec.sampling_params import SamplingParams


class LLM:
    """``LLM(model=None)`` serves the embedded default model (SmolLM2-135M-Instruct); the other
    keywords are ``EngineArgs``' (``tensor_parallel_size``, ``dtype``, ``speculative_config``, ...)."""

    def __init__(self, model: str | None = None, **engine_args):
        self.llm_engine = LLMEngine.from_args(model=model, **engine_args)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in the order given, with ``n`` completions each
        (``SamplingParams.n``: the prompt is prefilled once, its choices share its KV blocks). A
        prompt is text or token ids."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(
                    f"got {len(sampling_params)} sampling params for {len(prompts)} prompts; pass one or one per prompt"
                )
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        engine = self.llm_engine
        groups: list[list[str]] = []  # per prompt, the engine requests of its choices
        try:
            for p, sp in zip(prompts, (sp or SamplingParams() for sp in params)):
                group: list[str] = []
                groups.append(group)
                choices = sp.choices() if isinstance(sp, SamplingParams) else [sp]  # (the engine refuses the latter)
                for choice in choices:
                    group.append(engine.add_request(p, choice, after=group[0] if group else None))
        except Exception:
            for rid in (r for g in groups for r in g):
                engine.abort_request(rid)
            raise
        final = self._run([r for g in groups for r in g], use_tqdm)
        return [self._merge([final[r] for r in g]) for g in groups]

    @staticmethod
    def _merge(choices: list[RequestOutput]) -> RequestOutput:
        """The outputs of one prompt's choices as one ``RequestOutput`` (the first one's id)."""
        if len(choices) == 1:
            return choices[0]
        first = choices[0]
        outputs = [dataclasses.replace(c.outputs[0], index=i) for i, c in enumerate(choices)]
        return dataclasses.replace(first, outputs=outputs, new_text="", new_token_ids=[])

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template and generate a reply."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.llm_engine.tokenizer
        prompts = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        engine = self.llm_engine
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        try:
            with tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm) as bar:
                while len(final) < len(ids):
                    for out in engine.step():
                        if out.finished and out.request_id in wanted:
                            final[out.request_id] = out
                            bar.update(1)
        except BaseException:  # Ctrl-C, a dead engine: end this call's requests and free their blocks
            for rid in ids:
                if rid not in final:
                    try:
                        engine.abort_request(rid)
                    except Exception:  # noqa: BLE001 - e.g. a dead TP group; the first error matters
                        pass
            raise
        return final

    def get_stats(self) -> dict:
        return self.llm_engine.get_stats()

    def shutdown(self) -> None:
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        engine = getattr(self, "llm_engine", None)
        if engine is not None:
            engine.shutdown()
