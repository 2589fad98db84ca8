"""Where a chain head's served acceptance comes from: the engine's drafts beside the training
forward's, at the very origins the engine visits.

Runs the engine (TP 1, greedy, c = 1, k fixed) with an EAGLE-3 head (default: the shipped one) on
HumanEval prompts, recording at every drafting step the origin, the drafts and the target features
the runner handed over. Then, per sequence, runs the head's training forward
(``train/eagle3_module.py``, float32, on those same features and tokens) and scores:

- ``engine``: the engine's own drafts at its origins (what the engine's metrics count);
- ``trainer_at_engine_origins``: the training forward's drafts at those origins (equal to the
  engine's when training and serving compute the same head);
- ``trainer_all_origins``: the training forward at every origin, as trainers used to report it;
- each of these split at the first end-of-sequence token (past it, with ``ignore_eos``, the target
  writes text no drafter trained on).

With ``--held-out-features DIR`` (a ``train-draft`` work dir's ``held_out_features``), it also
scores the head on the first ``--held-out-seqs`` of those shards' sequences as the trainer does
(``train/held_out_acceptance.py``: along the origins greedy speculation visits, and at every
origin; the learning curves use the first 32).

  python benchmarks/chain_acceptance_origins.py --num-prompts 32 --held-out-features WORK_DIR/held_out_features \
      --result-file benchmarks/results/chain_acceptance_origins.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tpspec.bench.machine import machine_info


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--head", default=None, help="EAGLE-3 head folder (default: the shipped one)")
    p.add_argument("--k", type=int, default=6)
    p.add_argument("--first-prompt", type=int, default=0, help="HumanEval index (0-31: the trainer's held-out set)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--stop-at-eos", action="store_true", help="default: ignore_eos, as bench_speculative.py")
    p.add_argument("--held-out-features", default=None, metavar="DIR", help="also score the head on these feature shards")
    p.add_argument("--held-out-seqs", type=int, default=32)
    p.add_argument("--result-file", default=None)
    return p.parse_args(argv)


class Tally:
    """Acceptance lengths and first-draft acceptance, before and after the first end-of-sequence token."""

    def __init__(self):
        self.rows = {"before_eos": [], "after_eos": []}

    def add(self, part: str, length: int) -> None:
        self.rows[part].append(length)

    def result(self) -> dict:
        both = self.rows["before_eos"] + self.rows["after_eos"]
        out = {}
        for name, rows in (("all", both), *self.rows.items()):
            out[name] = {"origins": len(rows), "acceptance_length": sum(rows) / max(1, len(rows)),
                         "first_draft_acceptance": sum(r > 1 for r in rows) / max(1, len(rows))}
        return out


def main(argv=None) -> int:
    args = parse_args(argv)
    from tpspec.bench.datasets import humaneval_prompts
    from tpspec.config import ModelArchConfig
    from tpspec.engine.llm_engine import LLMEngine
    from tpspec.models.eagle3 import Eagle3Config
    from tpspec.models.loader.resolve import resolve_model
    from tpspec.sampling_params import SamplingParams
    from tpspec.spec_decode.chain_head import ChainHeadProposer
    from tpspec.config.speculative_methods import get_method
    from tpspec.spec_decode.resolve import shipped_drafter
    from tpspec.train.chain_trainer import build_chain_batch
    from tpspec.train.eagle3_module import Eagle3TrainModel
    from tpspec.train.train_draft import _target_tensors

    k = args.k
    head_folder = args.head or shipped_drafter(get_method("eagle3"), None)
    steps: list[dict] = []  # this request's drafting steps
    propose = ChainHeadProposer.propose

    def traced(self, inp):
        fed = propose(self, inp)
        steps.append({"start": inp.start_pos[0], "tokens": list(inp.token_ids[0]), "drafts": list(self.drafts(inp.req_ids[0])),
                      "features": inp.target_features[: inp.num_context(0)].float().clone()})  # [rows, F]
        return fed

    ChainHeadProposer.propose = traced
    spec = {"method": "eagle3", "model": head_folder, "num_speculative_tokens": k, "adaptive": False}
    engine = LLMEngine.from_args(speculative_config=spec, max_num_seqs=4)
    folder = resolve_model(None)
    arch = ModelArchConfig.from_folder(folder)
    cfg = Eagle3Config.from_folder(head_folder)
    head = Eagle3TrainModel(cfg, arch.num_hidden_layers, torch.arange(cfg.draft_vocab_size))
    state = {n: t.float() if t.is_floating_point() else t for n, t in load_file(f"{head_folder}/model.safetensors").items()}
    state.pop("t2d")
    head.load_state_dict(state)
    head.eval()
    embed = _target_tensors(folder, ["model.embed_tokens.weight"])["model.embed_tokens.weight"].float()  # [V, H]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=not args.stop_at_eos)
    tallies = {"engine": Tally(), "trainer_at_engine_origins": Tally(), "trainer_all_origins": Tally()}
    same = 0
    prompts = humaneval_prompts(args.first_prompt + args.num_prompts)[args.first_prompt :]
    for prompt in prompts:
        steps.clear()
        engine.add_request(prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        # the sequence and its features, as the runner handed them over
        n_feat = max(s["start"] + len(s["features"]) for s in steps)
        tok = torch.zeros(n_feat + 1, dtype=torch.int64)
        feat = torch.zeros(n_feat, steps[0]["features"].shape[1])  # [n_feat, F]
        for s in steps:
            end = min(s["start"] + len(s["tokens"]), n_feat + 1)
            tok[s["start"] : end] = torch.tensor(s["tokens"][: end - s["start"]])
            feat[s["start"] : s["start"] + len(s["features"])] = s["features"]
        # greedy: the output follows the target's argmax, so token t + 1 is the label at position t
        argmax = tok[1:]
        with torch.no_grad():
            feats, ids, _ = build_chain_batch([(tok[:n_feat], feat, argmax)], k)
            outs = head(feats, F.embedding(ids, embed), k)
            drafts = torch.stack([head.target_ids[head.lm_head(o[0]).argmax(-1)] for o in outs], 1)  # [n_feat, k]
        prompt_len = steps[0]["start"] + len(steps[0]["tokens"]) - 1
        eos = [i for i in range(prompt_len, n_feat) if int(tok[i]) in engine.eos_token_ids]
        eos_at = eos[0] if eos else n_feat

        def length(d: list[int], n: int) -> int:
            truth = tok[n + 1 : n + 1 + k].tolist()
            return 1 + int(torch.tensor([a == b for a, b in zip(d, truth)] + [False]).long().cumprod(0).sum())

        for s in steps:
            n = s["start"] + len(s["tokens"]) - 1  # the bonus token's position; draft 1 is n + 1
            if not s["drafts"] or n + k > n_feat:  # every label of the chain inside the traced sequence
                continue
            part = "before_eos" if n < eos_at else "after_eos"
            served, trained = length(s["drafts"][:k], n), length(drafts[n - 1].tolist(), n)
            tallies["engine"].add(part, served)
            tallies["trainer_at_engine_origins"].add(part, trained)
            same += int(served == trained)
        for n in range(prompt_len, n_feat - k + 1):
            tallies["trainer_all_origins"].add("before_eos" if n < eos_at else "after_eos", length(drafts[n - 1].tolist(), n))
    engine.shutdown()
    held_out = None
    if args.held_out_features:
        import tempfile

        from tpspec.train.eagle3_trainer import Eagle3Trainer
        from tpspec.train.recipe import TrainConfig
        from tpspec.train.trainer import FeatureData

        data = FeatureData.load(args.held_out_features)
        with tempfile.TemporaryDirectory() as scratch:  # the trainer's out_dir; nothing is written
            trainer = Eagle3Trainer(head, embed, data, data, TrainConfig(), scratch, k)
            held_out = {"features": args.held_out_features, "seqs": args.held_out_seqs, **trainer.evaluate(args.held_out_seqs)}
    result = {"machine": machine_info(), "head": head_folder, "k": k, "first_prompt": args.first_prompt,
              "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "stop_at_eos": args.stop_at_eos,
              "origins_with_equal_acceptance": same, **{name: t.result() for name, t in tallies.items()},
              "held_out_features": held_out}
    print(json.dumps({n: v for n, v in result.items() if n != "machine"}, indent=1))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
