"""The baseline litscale's GPU throughput is compared with: a plain PyTorch training loop over
the same network litscale builds, with the same batch, sequence length and tricks (bf16
autocast, ``torch.compile``, flash SDPA through ``F.scaled_dot_product_attention``, fused AdamW,
gradient clipping at norm 1.0, the fp32 loss fused by compile) and no framework: random tokens made on the GPU, no data
loader, no callbacks, no logging.

    python experiments/gpu/plain_loop.py --model gpt2_small --steps 200 --warmup 30

Prints one JSON line: tokens/s (steady state, the mean over the timed steps, as litscale's
throughput callback reports it, and the median step), MFU against 989 TFLOP/s (dense bf16,
H100/H200 SXM) with litscale's FLOPs formula (``flops_per_token``: 6N + attention), peak memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from litscale.models.gpt import build_gpt
from litscale.models.llama import build_llama

PEAK_BF16_FLOPS = 989e12
# name -> (network builder, sequence length, micro batch): the experiment configs' numbers
# (conf/experiment/gpt2_small_h100.yaml, llama_1b_h100.yaml).
MODELS = {
    "gpt2_small": (lambda: build_gpt(preset="small", vocab_size=50304, block_size=1024), 1024, 32),
    "llama_1b": (lambda: build_llama(preset="llama3_1b", vocab_size=128256, block_size=2048), 2048, 8),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt2_small")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--batch", type=int, default=None, help="micro batch (default: the config's)")
    parser.add_argument("--float8", choices=["tensorwise", "rowwise"], default=None)
    parser.add_argument("--lr", type=float, default=6e-4)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    build, seq_len, batch = MODELS[args.model]
    batch = args.batch or batch
    torch.manual_seed(0)
    net = build().cuda()
    flops_per_token = net.flops_per_token(seq_len)
    if args.float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        from litscale.callbacks.float8 import converts_to_float8

        convert_to_float8_training(net, config=Float8LinearConfig.from_recipe_name(args.float8),
                                   module_filter_fn=converts_to_float8)
    net.compile()
    loss_fn = torch.compile(lambda logits, targets: F.cross_entropy(logits.flatten(0, 1).float(),
                                                                     targets.flatten()))
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=True)
    vocab = net.config.vocab_size
    events = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
    losses = []
    for step in range(args.steps):
        tokens = torch.randint(vocab, (batch, seq_len + 1), device="cuda")
        if step == args.warmup:
            torch.cuda.synchronize()
            started = time.perf_counter()
        events[step].record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(net(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)  # as the trainer's gradient_clip_val
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 20 == 0:
            losses.append(loss.item())
    events[args.steps].record()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    timed = args.steps - args.warmup
    step_ms = [events[i].elapsed_time(events[i + 1]) for i in range(args.warmup, args.steps)]
    tokens_per_step = batch * seq_len
    tokens_per_sec = timed * tokens_per_step / elapsed
    median_tokens_per_sec = tokens_per_step / (statistics.median(step_ms) / 1e3)
    print(json.dumps({
        "runner": "plain", "model": args.model, "float8": args.float8, "batch": batch, "seq_len": seq_len,
        "params": sum(p.numel() for p in net.parameters()), "flops_per_token": flops_per_token,
        "tokens_per_sec": tokens_per_sec, "median_step_tokens_per_sec": median_tokens_per_sec,
        "mfu": tokens_per_sec * flops_per_token / PEAK_BF16_FLOPS,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30, "losses_every_20": losses,
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
