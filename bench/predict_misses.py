"""How early can a layer's misses be known? Recall of the cold routings by router guesses.

    python bench/predict_misses.py M.gguf --profile P.json --prompts held_out.jsonl \
        [--hot-fraction 0.6] [--prompt-tokens 512] [--decode 64] [--candidates 1 2 4 8] [--device cpu]

Issue 6 asks to measure, not guess, whether prefetching a layer's likely experts pays. A prefetch
only helps where it finds the routings that would otherwise be read over PCIe (the cold ones) in
time, and every wrong guess costs the same link. This replays a held-out prompt through the model
(one forward, causal, so every token is a decode step's worth of routings), then decodes
``--decode`` tokens greedily from it, places experts as the store would (the profile's hot set at
``--hot-fraction``) and, for every MoE layer and token, the prompt's and the decoded ones apart,
compares the experts actually routed with two guesses from the layer's router:

  same layer   the block's input (before its attention): what ``runtime.kernels.prefetch`` uses;
               lead time: one attention / DeltaNet step.
  one ahead    the previous block's input: lead time a whole layer.
  after attn   the previous block's residual after its attention (its MoE's input, before the
               norm): lead time that MoE and this block's attention.

For each guess it reports what the current prefetch copies (the top-k guess's cold members) and
the top ``c`` cold experts by guessed logit, as recall (share of the cold routings found) and
copies per token (what the link must carry for them). Softmax-routed archs only (the guess is the
top of the router's logits, as ``MoEModel.guess_experts`` takes it).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from bench.store_bench import held_out_prompt
from sparkpack.runtime.generate import Session, generate
from sparkpack.runtime.models import StoreOptions, load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--profile", type=Path, required=True, help="calibrated on another prompt set")
    ap.add_argument("--prompts", type=Path, required=True, help="held-out corpus the prompt comes from")
    ap.add_argument("--hot-fraction", type=float, default=0.6)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64, help="greedy tokens decoded after the prompt")
    ap.add_argument("--candidates", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    model = load_model(args.model, device=args.device, dtype=torch.bfloat16 if args.device == "cuda" else torch.float32,
                       store=StoreOptions(hot_fraction=args.hot_fraction, profile=args.profile, prefetch=False,
                                          cache_slots=0))
    if not getattr(model, "topk_of_logits", False):
        raise SystemExit(f"{model.arch}: the guess is a softmax router's top logits; this arch routes otherwise")
    hot = model.experts.hot
    prompt = held_out_prompt(model, args.prompts, args.prompt_tokens)
    inputs: dict[int, list[torch.Tensor]] = {}
    mids: dict[int, list[torch.Tensor]] = {}
    routed: dict[int, list[np.ndarray]] = {}
    block = model.block

    def recording_block(il, x, cache, pos0):
        inputs.setdefault(il, []).append(x.float().cpu())
        return block(il, x, cache, pos0)

    ffn = model.ffn

    def recording_ffn(il, h, x):
        mids.setdefault(il, []).append(x.float().cpu())
        return ffn(il, h, x)

    model.block = recording_block
    model.ffn = recording_ffn
    model.experts.observe_routing = lambda il, ids: routed.setdefault(il, []).append(ids.cpu().numpy())
    # eager steps: a replayed CUDA graph would not call the recording block
    decoded = list(generate(model, None, prompt, None, args.decode, stop_ids=(), session=Session(model, graphs=False)))
    n_prompt = len(prompt)
    result = {"model": args.model.name, "prompt_tokens": n_prompt, "decoded_tokens": len(decoded),
              "hot_fraction": args.hot_fraction, "tables": {}}
    for part, rows_of in (("prompt", slice(0, n_prompt)), ("decoded", slice(n_prompt, None))):
        x_of = {il: torch.cat(v)[rows_of] for il, v in inputs.items()}
        mid_of = {il: torch.cat(v)[rows_of] for il, v in mids.items()}
        ids_of = {il: np.concatenate(v)[rows_of] for il, v in routed.items()}
        result["tables"][part] = table(model, hot, x_of, mid_of, ids_of, args.candidates)
    print(f"{args.model.name}: {n_prompt} prompt tokens of {args.prompts.name}, {len(decoded)} decoded; hot fraction "
          f"{args.hot_fraction:.0%} (profile {args.profile.name})")
    for part, t in result["tables"].items():
        print(f"\n{part}: {t['tokens']} tokens, {t['layers']} MoE layers with a previous block, "
              f"{t['cold_per_token']:.2f} cold routings a token in them")
        print("| guess | recall of cold routings | copies a token |")
        print("| --- | --- | --- |")
        for r in t["rows"]:
            print(f"| {r['guess']} | {r['recall']:.1%} | {r['copies_per_token']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


def table(model, hot: np.ndarray, inputs: dict[int, torch.Tensor], mids: dict[int, torch.Tensor],
          routed: dict[int, np.ndarray], candidates: list[int]) -> dict:
    """Recall and copies of each guess over the tokens in ``inputs`` (block inputs by layer),
    ``mids`` (residuals after attention by layer) and ``routed`` (the ids each MoE layer chose)."""
    spec, k = model.spec, model.spec.n_expert_used
    layers = [il for il in spec.moe_layers if il - 1 in inputs and il - 1 in mids and il in routed]
    n_tok = len(next(iter(routed.values())))
    sums: dict[str, list[int]] = {}
    cold_total = 0
    for il in layers:
        cold = ~hot[il]
        ids = routed[il]  # [T, k]
        is_cold = cold[ids]
        cold_total += int(is_cold.sum())
        norm = model.w(f"blk.{il}.{model.ffn_norm}.weight").float()
        for name, x in (("same layer", inputs[il]), ("one ahead", inputs[il - 1]),
                        ("after attn", mids[il - 1])):
            logits = model.w.linear(x.to(norm.device) * norm, f"blk.{il}.ffn_gate_inp.weight").float().cpu().numpy()
            order = np.argsort(-logits, axis=1)
            guesses = {"top-k guess, cold part": [set(r[cold[r]]) for r in order[:, :k]]}
            cold_order = [r[cold[r]] for r in order]
            for c in candidates:
                guesses[f"top {c} cold"] = [set(r[:c]) for r in cold_order]
            for g, sets in guesses.items():
                acc = sums.setdefault(f"{name}: {g}", [0, 0])
                acc[0] += sum(int(e in s) for t, s in enumerate(sets) for e, m in zip(ids[t], is_cold[t]) if m)
                acc[1] += sum(len(s) for s in sets)
    rows = [{"guess": g, "recall": found / cold_total if cold_total else 0.0, "copies_per_token": copies / n_tok}
            for g, (found, copies) in sums.items()]
    return {"tokens": n_tok, "layers": len(layers), "cold_per_token": cold_total / n_tok, "rows": rows}


if __name__ == "__main__":
    main()
