"""``python -m litscale.app.generate <run dir | Hugging Face dir> "prompt"``: try what you trained.

Loads a run's ``model.pt`` (its network rebuilt from the run's ``.hydra/config.yaml``) or a
Hugging Face directory (``export_hf=true`` writes one, with the run's tokenizer and chat
template), renders the prompt as a user turn with the chat template the run trained with
(``--raw``: the prompt as plain text to continue) and writes the answer: greedy by default,
sampled with ``--temperature`` (and ``--top-k``, ``--samples``, ``--seed``).

    python -m litscale.app.generate outputs/sft/2026-12-06_17-00-00 "What is 12 + 30?"
    python -m litscale.app.generate outputs/sft/2026-12-06_17-00-00/hf "What is 12 + 30?" --temperature 0.8 --samples 3

A Hugging Face directory generates with transformers' own ``generate``; litscale's networks are
plain torch modules without one, so a run's ``model.pt`` continues by the loop below (the whole
window recomputed per token: meant for checking a fine-tune, not for serving). Greedy, both give
the same tokens for the same weights.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from litscale.app.preflight import EXIT_BAD_CONFIG
from litscale.checkpoint.export import EXPORT_FILENAME
from litscale.data.chat import ChatTemplate, load_chat_template, prompt_tokens
from litscale.data.tokenizer import TextTokenizer, load_tokenizer
from litscale.errors import ConfigError

ALLOWED_SOURCE = ("a run dir (model.pt and .hydra/config.yaml) or a Hugging Face directory (config.json and "
                  "tokenizer.json: export_hf=true writes <run dir>/hf)")


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy at ``temperature`` 0, else drawn from the softmax of
    the logits over ``temperature``, among the ``top_k`` likeliest (0: all)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0


@dataclass(frozen=True)
class Loaded:
    """A model to prompt: ``continue_ids(prompt ids, sampling, generator) -> new ids`` (stopping
    at the end-of-text token), the tokenizer and the chat template it trained with."""

    continue_ids: Callable[[list[int], Sampling, torch.Generator], list[int]]
    tokenizer: TextTokenizer
    template: ChatTemplate


def load(path: str) -> Loaded:
    """A run dir's ``model.pt`` or a Hugging Face directory; a one-line ``ConfigError`` else."""
    path = os.path.expanduser(path)
    if os.path.isfile(os.path.join(path, EXPORT_FILENAME)) and os.path.isfile(os.path.join(path, ".hydra", "config.yaml")):
        return _load_run(path)
    if os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(os.path.join(path, "tokenizer.json")):
        return _load_hugging_face(path)
    raise ConfigError(f"generate: {path} is not a model to load; allowed: {ALLOWED_SOURCE}")


def _load_run(path: str) -> Loaded:
    from omegaconf import OmegaConf

    from litscale.app.build import build, trusted_targets

    cfg = OmegaConf.load(os.path.join(path, ".hydra", "config.yaml"))
    tokenizer_name = str(cfg.data.get("tokenizer", "byte"))
    tokenizer = load_tokenizer(tokenizer_name)
    torch.manual_seed(0)  # the weights are replaced; a seeded build keeps loading reproducible
    net = build(cfg.model.net, trusted=trusted_targets(cfg))
    state = torch.load(os.path.join(path, EXPORT_FILENAME), map_location="cpu", weights_only=True)
    net.load_state_dict(state)
    net.eval()
    eos = getattr(tokenizer, "eos_token", "")
    template = load_chat_template(tokenizer_name, cfg.data.get("chat_template"), eos)
    context = int(cfg.data.get("seq_len") or getattr(getattr(net, "config", None), "block_size", 1024))
    vocab = tokenizer.vocab_size  # a padded vocabulary's extra logits are no token

    def continue_ids(prompt: list[int], sampling: Sampling, generator: torch.Generator) -> list[int]:
        return continue_tokens(lambda ids: net(ids)[0, -1, :vocab], prompt, sampling, generator,
                               eos_id=getattr(tokenizer, "eos_id", -1), context=context)

    return Loaded(continue_ids, tokenizer, template)


def _load_hugging_face(path: str) -> Loaded:
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    template = load_chat_template(path, None, tokenizer.eos_token)

    def continue_ids(prompt: list[int], sampling: Sampling, generator: torch.Generator) -> list[int]:
        sampled = sampling.temperature > 0
        torch.manual_seed(int(generator.initial_seed()))  # transformers draws from torch's global generator
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=sampling.max_new_tokens,
                             do_sample=sampled, temperature=sampling.temperature if sampled else None,
                             top_k=sampling.top_k if sampled else None, top_p=None,
                             eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.eos_id)
        new = out[0, len(prompt):].tolist()
        return new[:new.index(tokenizer.eos_id)] if tokenizer.eos_id in new else new

    return Loaded(continue_ids, tokenizer, template)


@torch.no_grad()
def continue_tokens(last_logits: Callable[[torch.Tensor], torch.Tensor], prompt: list[int], sampling: Sampling,
                    generator: torch.Generator, *, eos_id: int, context: int) -> list[int]:
    """The tokens after ``prompt`` until ``eos_id`` (left out) or ``sampling.max_new_tokens``;
    ``last_logits(ids [1, T])`` is the next token's logits, over the last ``context`` tokens."""
    tokens = list(prompt)
    for _ in range(sampling.max_new_tokens):
        logits = last_logits(torch.tensor([tokens[-context:]])).float()
        if sampling.temperature == 0:
            chosen = int(logits.argmax())
        else:
            logits = logits / sampling.temperature
            if sampling.top_k:
                kept = torch.topk(logits, min(sampling.top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kept, float("-inf"))
            chosen = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        if chosen == eos_id:
            break
        tokens.append(chosen)
    return tokens[len(prompt):]


def answers(loaded: Loaded, prompt: str, *, sampling: Sampling, samples: int = 1, seed: int = 0,
            system: str | None = None, raw: bool = False) -> list[str]:
    """``samples`` answers to ``prompt`` (a user turn, after ``system``'s where given; ``raw``:
    text to continue), decoded."""
    if raw:
        ids = [int(i) for i in loaded.tokenizer.encode_batch([prompt], add_special_tokens=False)[0]]
    else:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        ids = [int(i) for i in prompt_tokens(loaded.tokenizer, loaded.template, messages)]
    found = []
    for number in range(samples):
        generator = torch.Generator().manual_seed(seed + number)
        found.append(loaded.tokenizer.decode(loaded.continue_ids(ids, sampling, generator)))
    return found


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m litscale.app.generate", description=__doc__.splitlines()[0])
    parser.add_argument("model", help=ALLOWED_SOURCE)
    parser.add_argument("prompt", help="the user's turn (with --raw: text to continue)")
    parser.add_argument("--system", default=None, help="a system turn before it")
    parser.add_argument("--raw", action="store_true", help="no chat template: continue the prompt as text")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above 0: sampled")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    parser.add_argument("--samples", type=int, default=1, help="answers to draw (sampled)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    checks = [
        (args.max_new_tokens >= 1, f"--max-new-tokens={args.max_new_tokens} is not valid; allowed: 1 or more"),
        (args.temperature >= 0, f"--temperature={args.temperature:g} is not valid; allowed: 0 (greedy) or above "
                                "(sampled)"),
        (args.top_k >= 0, f"--top-k={args.top_k} is not valid; allowed: 0 (every token) or more"),
        (args.samples >= 1, f"--samples={args.samples} is not valid; allowed: 1 or more"),
        (args.samples == 1 or args.temperature > 0, f"--samples={args.samples} draws the same greedy answer each "
                                                     "time; allowed: --temperature above 0 to sample"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = _arguments(argv)
        loaded = load(args.model)
    except (ConfigError, ValueError) as error:
        print(f"error: {str(error).splitlines()[0]}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k)
    found = answers(loaded, args.prompt, sampling=sampling, samples=args.samples, seed=args.seed,
                    system=args.system, raw=args.raw)
    for number, answer in enumerate(found):
        print(answer if len(found) == 1 else f"[{number + 1}] {answer}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
