"""The offline ``LLM`` API: chat templates, stop conditions, stats counters, seeded sampling, and
the ``tpspec generate`` command line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tpspec import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def smol():
    """The default model (real text, a real chat template)."""
    with LLM(num_kv_blocks=64, max_model_len=512) as llm:
        yield llm


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    with LLM(tiny_llama, num_kv_blocks=64, block_size=8, max_model_len=256) as llm:
        yield llm


# --- chat ---------------------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime number."}],
    [{"role": "user", "content": "What is the capital of France?"}],
]


def _hf_chat_ids(folder: str, conversations: list[list[dict]]) -> list[list[int]]:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    out = []
    for messages in conversations:
        ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


@pytest.mark.parametrize("which", ["smol", "tiny"])
def test_chat_prompt_is_the_rendered_template(which, request):
    llm = request.getfixturevalue(which)
    tok = llm.get_tokenizer()
    outs = llm.chat(CONVERSATIONS, GREEDY, use_tqdm=False)
    assert len(outs) == len(CONVERSATIONS)
    hf_ids = _hf_chat_ids(llm.llm_engine.config.model, CONVERSATIONS)
    for messages, out, expected in zip(CONVERSATIONS, outs, hf_ids):
        rendered = tok.apply_chat_template(messages, add_generation_prompt=True)
        assert rendered.endswith("<|im_start|>assistant\n") and messages[-1]["content"] in rendered
        assert out.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
        # The same ids transformers' own tokenizer makes of the same conversation.
        assert out.prompt_token_ids == expected
        # And chat generates exactly what generate() does on those ids.
        again = llm.generate([out.prompt_token_ids], GREEDY, use_tqdm=False)[0]
        assert again.outputs[0].token_ids == out.outputs[0].token_ids
    # A single conversation (not a list of them) gives one output.
    assert len(llm.chat(CONVERSATIONS[1], GREEDY, use_tqdm=False)) == 1


def test_chat_answers_sensibly(smol):
    out = smol.chat(CONVERSATIONS[1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text


# --- stop conditions ----------------------------------------------------------------------------

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def continuation(smol):
    """Greedy continuation of PROMPT, ignoring EOS (which comes at token 30): (token ids, text)."""
    out = smol.generate(PROMPT, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.outputs[0].text


def test_stop_string(smol, continuation):
    ids, text = continuation
    stop = text[8:12]
    assert stop and stop not in text[: 8 + len(stop) - 1]
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=24, stop=["never appears", stop], include_stop_str_in_output=include)
        out = smol.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)
        assert out.text == text[: text.index(stop) + (len(stop) if include else 0)]
        assert out.token_ids == ids[: len(out.token_ids)] and len(out.token_ids) < 24
        # The token that completed the stop string is the last one.
        tok = smol.get_tokenizer()
        assert stop not in tok.decode(out.token_ids[:-1]) and stop in tok.decode(out.token_ids)


def test_stop_string_completed_by_the_last_allowed_token_is_a_stop(smol, continuation):
    ids, text = continuation
    stop = text[8:12]
    tok = smol.get_tokenizer()
    n = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))
    out = smol.generate(PROMPT, SamplingParams(temperature=0, max_tokens=n, stop=stop), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == n
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_stop_token_ids(smol, continuation):
    ids, _ = continuation
    stop_id = ids[5]
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id])
    out = smol.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    assert out.token_ids == ids[: ids.index(stop_id) + 1]


def test_eos_ends_with_stop_and_ignore_eos_goes_on(smol, continuation):
    ids, _ = continuation
    eos = smol.get_tokenizer().eos_token_id
    assert eos in ids, "the continuation should reach EOS (it does for this prompt)"
    out = smol.generate(PROMPT, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    assert out.token_ids == ids[: ids.index(eos) + 1]
    assert len(ids) == 32  # ignore_eos went on to max_tokens


# --- stats --------------------------------------------------------------------------------------


def test_stats_count_requests_and_tokens(tiny):
    before = tiny.get_stats()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 7, 11)]
    outs = tiny.generate(["hello", "def add(a, b):", "import os"], params, use_tqdm=False)
    engine = tiny.llm_engine
    engine.add_request("hello", SamplingParams(max_tokens=50), request_id="to-abort")
    engine.step()
    assert tiny.get_stats()["num_running"] == 1 and tiny.get_stats()["kv_cache_usage"] > 0
    engine.abort_request("to-abort")
    after = tiny.get_stats()
    delta = {k: after[k] - before[k] for k in before if isinstance(before[k], int)}
    assert delta["num_requests"] == 4
    assert delta["num_requests_aborted"] == 1
    assert delta["num_prompt_tokens"] == sum(len(o.prompt_token_ids) for o in outs) + len(tiny.get_tokenizer().encode("hello"))
    assert delta["num_generation_tokens"] == 3 + 7 + 11 + 1
    assert delta["num_steps"] == 11 + 1  # one prefill+decode step per token of the longest, plus one
    assert delta["num_preemptions"] == 0
    assert after["num_running"] == after["num_waiting"] == 0
    assert after["num_free_kv_blocks"] == after["num_kv_blocks"] == 64 and after["kv_cache_usage"] == 0
    assert after["comm"] == {}  # TP 1: nothing crosses a wire


# --- seeded sampling ----------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible(tiny):
    prompts = ["hello", "def add(a, b):", "import os"]

    def sample(seed, **kw):
        return SamplingParams(temperature=1.5, seed=seed, max_tokens=16, ignore_eos=True, **kw)

    first = [o.outputs[0].token_ids for o in tiny.generate(prompts, [sample(1), sample(2), sample(3, top_p=0.9)], use_tqdm=False)]
    # Same seeds: same tokens, in another batch order and alone.
    again = [o.outputs[0].token_ids for o in tiny.generate(prompts[::-1], [sample(3, top_p=0.9), sample(2), sample(1)], use_tqdm=False)]
    assert again[::-1] == first
    assert tiny.generate(prompts[1], sample(2), use_tqdm=False)[0].outputs[0].token_ids == first[1]
    # Another seed, another sample; and it is a sample, not the greedy answer.
    assert tiny.generate(prompts[1], sample(99), use_tqdm=False)[0].outputs[0].token_ids != first[1]
    greedy = tiny.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] != first
    # Unseeded requests draw their own seeds: two identical ones differ.
    unseeded = tiny.generate(["hello"] * 2, SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


# --- command line -------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tpspec", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_generate(tiny_llama):
    r = _cli("generate", "--model", tiny_llama, "--max-tokens", "8", "--raw", "--ignore-eos", "-p", "hi")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "### Prompt: hi" in r.stdout
    assert "[8 tokens, finish_reason=length]" in r.stdout


def test_cli_missing_model_exits_2_with_the_message(tmp_path):
    missing = str(tmp_path / "no-such-model")
    r = _cli("generate", "--model", missing, "--max-tokens", "8", "-p", "hi")
    assert r.returncode == 2
    assert "no-such-model" in r.stderr and "not found" in r.stderr
    assert "Traceback" not in r.stderr
