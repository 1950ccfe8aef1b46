"""Which vLLM configuration computes fp32 as fp32 on a GPU: each configuration's logprobs of its own
greedy and sampled tokens against an HF fp32 forward of the same tokens on the same GPU (TF32 off).

    python3 ci/vllm_precision_probe.py --out DIR [--model tiny-qwen3-hd32] [--configs NAME,...]

Runs the harness's VLLMEngine (MRH_VLLM_PYTHON / MRH_VLLM_PATH name the vLLM install); one engine
per configuration, started, measured and closed in turn. Writes DIR/vllm-precision.json (one record per
configuration and decoding: the attention backend vLLM picked, max/mean |d logprob|, the engine start
time) and prints a table. The configurations (CONFIGS) differ in the attention backend and in
Triton's default precision for fp32 dot products (TRITON_F32_DEFAULT: "tf32" is Triton's default on
Hopper, "ieee" true fp32).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# name -> (dtype, LLM(...) arguments, environment of the engine's process)
CONFIGS = {
    "bf16-default": ("bf16", {}, {}),
    "fp32-default": ("fp32", {}, {}),
    "fp32-triton-ieee": ("fp32", {"attention_backend": "TRITON_ATTN"}, {"TRITON_F32_DEFAULT": "ieee"}),
    "fp32-flex": ("fp32", {"attention_backend": "FLEX_ATTENTION"}, {}),
    "fp32-flex-ieee": ("fp32", {"attention_backend": "FLEX_ATTENTION"}, {"TRITON_F32_DEFAULT": "ieee"}),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@torch.no_grad()
def hf_logprobs(model, rollouts, temperature: float) -> torch.Tensor:
    batch = rollouts.batch
    mask = batch.attention_mask.long().cuda()
    ids = batch.input_ids.cuda()
    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    logprobs = torch.log_softmax(logits.float()[:, :-1] / temperature, -1).gather(2, ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(logprobs, (1, 0)).cpu() * batch.response_mask


def main() -> int:
    from harness.backends.cuda_precision import pin
    from harness.models import build_hf_model, load_hf_config, resolve_model
    from harness.rollout.check import prompts
    from harness.rollout.engine import Sampling
    from harness.rollout.vllm_engine import VLLMEngine

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="tiny-qwen3-hd32")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    args = parser.parse_args()
    pin()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hf = build_hf_model(resolve_model(args.model), dtype=torch.float32).cuda().eval()
    vocab = load_hf_config(args.model).vocab_size
    records = []
    for name in args.configs.split(","):
        dtype, engine_args, env = CONFIGS[name]
        t0 = time.perf_counter()
        record = {"config": name, "dtype": dtype, "engine_args": engine_args, "env": env, "model": args.model}
        try:
            engine = VLLMEngine(args.model, dtype=DTYPES[dtype], device="cuda", engine_args=engine_args,
                                env={"NVIDIA_TF32_OVERRIDE": "0", **env})
        except Exception as error:  # a backend vLLM refuses for this model: recorded, not fatal
            record["error"] = f"{type(error).__name__}: {str(error)[-600:]}"
            records.append(record)
            print(name, "FAILED", record["error"][:300], flush=True)
            continue
        record["start_s"] = round(time.perf_counter() - t0, 1)
        record["attention_backend"] = engine.attention_backend
        record["versions"] = engine.versions
        try:
            for sampling in (Sampling(n=1, max_tokens=16, temperature=0.0, seed=3),
                             Sampling(n=2, max_tokens=16, temperature=1.0, seed=3)):
                rollouts = engine.generate(prompts(vocab, count=8), sampling)
                d = (rollouts.logprobs - hf_logprobs(hf, rollouts, sampling.logprob_temperature)).abs()
                d = d[rollouts.batch.response_mask]
                key = "greedy" if sampling.greedy else "t1"
                record[key] = {"max_abs": float(d.max()), "mean_abs": float(d.mean()), "tokens": int(d.numel())}
        finally:
            engine.close()
        records.append(record)
        print(json.dumps(record), flush=True)
    (out / "vllm-precision.json").write_text(json.dumps(records, indent=1))
    print(f"\n{'config':<20} {'backend':<28} {'greedy max':>11} {'t1 max':>10} {'t1 mean':>10}")
    for r in records:
        if "error" in r:
            print(f"{r['config']:<20} refused: {r['error'][:80]}")
            continue
        print(f"{r['config']:<20} {str(r['attention_backend']):<28} {r['greedy']['max_abs']:>11.3g} "
              f"{r['t1']['max_abs']:>10.3g} {r['t1']['mean_abs']:>10.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
