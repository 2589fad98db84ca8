"""transformers' own reading of a GGUF file, the reference the real-model tests compare against."""

from __future__ import annotations

import os
from unittest import mock

import torch


def transformers_gguf_model(path: str):
    """transformers' causal LM from the GGUF file at ``path`` (its own name mapping and
    dequantization), in float32 and eval mode. transformers parses the file's header twice (once
    for the config, once for the tensors), each parse walking every vocabulary string: 11 s for
    Gemma 3's 262,144 tokens; here it is parsed once and both loads read that parse."""
    import gguf
    from transformers import AutoModelForCausalLM

    reader = gguf.GGUFReader(path)

    def the_parsed_file(p: str) -> gguf.GGUFReader:
        assert os.path.samefile(p, path), p
        return reader

    directory, filename = os.path.split(path)
    with mock.patch.object(gguf, "GGUFReader", the_parsed_file):
        return AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32).eval()
