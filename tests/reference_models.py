"""transformers' own reading of a GGUF file, the reference the real-model tests compare against."""

from __future__ import annotations

import functools
import os
from unittest import mock

import torch

from tpspec.models.loader.gguf import GGUFFile, parsed_once


def transformers_gguf_model(path: str):
    """transformers' causal LM from the GGUF file at ``path`` (its own name mapping and
    dequantization), in float32 and eval mode. transformers parses the file's header twice (once
    for the config, once for the tensors), each parse walking every vocabulary string; here it is
    parsed once (``GGUFFile``: 2.2 s for Gemma 3's 262,144 tokens, against 8.5 s a parse by gguf-py's
    own reader) and both loads read that parse. Its name mapping builds gguf-py's tensor-name map
    once per module of the model (397 times for the default model, 3.9 s); here once per
    architecture and layer count (the map is only read)."""
    import gguf
    from transformers import AutoModelForCausalLM

    directory, filename = os.path.split(path)
    name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    with parsed_once(GGUFFile(path)), mock.patch.object(gguf, "get_tensor_name_map", name_map):
        return AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32).eval()
