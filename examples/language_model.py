"""A language model trained with DP-SGD: a small GPT-2 (Hugging Face's ``GPT2LMHeadModel``,
its output layer tied to the token embedding) on IMDB review text, next-token loss per
example, through ``privgrad.make_private``.

What it shows: tied weights are one unit for clipping (the shared matrix's per-example
gradient is the sum of the embedding's and the output layer's, its norm with their cross
term); a per-example loss of your own (``loss_fn``: each review's next-token cross-entropy
summed over its tokens, padding ignored); inputs as a dict with ``position_ids`` of the
batch's shape (Hugging Face's default, one row for the whole batch, works too since
1036c3a: make_private copies it to each example once it has checked that the model
broadcasts it; explicit positions skip the copy, and the records were made with them). The
model is built from a configuration (random weights: nothing is downloaded). It prints the
held-out perplexity before and after training, beside that of the training reviews' word
frequencies (a unigram model, a non-private reference), and can write the model with its
privacy record (``--save``) and the result (``--record``).

    python examples/language_model.py              # 5,000 reviews, 32 tokens, ε = 3
    python examples/language_model.py --limit 200 --epochs 1 --batch-size 50   # a tiny slice
    python examples/language_model.py --arch mixtral   # a mixture of experts (Mixtral), untied

Needs the Hugging Face extra (``pip install -e ".[hf]"``; the test extra has it) and the IMDB
files of ``../shared/data/imdb`` (or ``--data-dir``). The labels (sentiment) are not used.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

import privgrad
from privgrad.app.data.text import OOV, PAD, load_imdb
from privgrad.records import code_version, git_commit


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each example's next-token cross-entropy, summed over its tokens (padding ignored)."""
    per_token = F.cross_entropy(
        logits[:, :-1].transpose(1, 2), ids[:, 1:], ignore_index=PAD, reduction="none"
    )
    return per_token.sum(1)


def inputs(ids: torch.Tensor) -> dict:
    """The model's keyword arguments: ids, their attention mask and per-example positions."""
    positions = torch.arange(ids.shape[1]).expand(ids.shape)
    return {"input_ids": ids, "attention_mask": (ids != PAD).long(), "position_ids": positions}


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, batch: int = 250) -> float:
    """exp of the mean next-token loss over the non-padding tokens of ``ids``."""
    model.eval()
    total, tokens = 0.0, int((ids[:, 1:] != PAD).sum())
    for start in range(0, len(ids), batch):
        part = ids[start : start + batch]
        total += float(next_token_loss(model(**inputs(part)).logits, part).sum())
    return math.exp(total / tokens)


def unigram_perplexity(train: torch.Tensor, ids: torch.Tensor) -> float:
    """The held-out perplexity of the training tokens' frequencies (add-one smoothed), on the
    tokens :func:`perplexity` scores."""
    counts = Counter(train[:, 1:][train[:, 1:] != PAD].tolist())
    vocab = int(max(train.max(), ids.max())) + 1
    total = sum(counts.values()) + vocab
    targets = ids[:, 1:][ids[:, 1:] != PAD].tolist()
    return math.exp(-sum(math.log((counts[t] + 1) / total) for t in targets) / len(targets))


def build_model(arch: str, vocab: int, length: int, width: int, layers: int):
    import transformers

    if arch == "mixtral":  # a mixture of experts: 4 experts of width 2 × width, 2 per token
        config = transformers.MixtralConfig(
            vocab_size=vocab, max_position_embeddings=length, hidden_size=width,
            intermediate_size=2 * width, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
            pad_token_id=PAD, bos_token_id=OOV, eos_token_id=OOV,
        )  # fmt: skip
        return transformers.MixtralForCausalLM(config)
    config = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=length,
        n_embd=width,
        n_layer=layers,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        pad_token_id=PAD,
        bos_token_id=OOV,
        eos_token_id=OOV,
    )
    return transformers.GPT2LMHeadModel(config)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=5_000, help="training reviews")
    p.add_argument("--test-limit", type=int, default=1_000, help="held-out reviews")
    p.add_argument(
        "--held-out",
        choices=["test", "validation"],
        default="test",
        help="score on the test split, or on the training reviews after the first --limit "
        "(a validation split, for choosing hyper-parameters)",
    )
    p.add_argument("--vocab", type=int, default=2_000, help="most frequent training words kept")
    p.add_argument("--length", type=int, default=32, help="tokens per review (first N)")
    p.add_argument(
        "--arch",
        choices=["gpt2", "mixtral"],
        default="gpt2",
        help="GPT-2 (tied output layer) or Mixtral (a mixture of experts, untied)",
    )
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=250, help="expected Poisson batch size")
    p.add_argument("--mechanism", choices=["dpsgd", "non-private"], default="dpsgd")
    p.add_argument("--epsilon", type=float, default=3.0)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-2, help="Adam's learning rate")
    p.add_argument(
        "--seed", type=int, default=None,
        help="for a reproducible run (its ε holds while the seed stays secret); default: a "
        "secret seed drawn from the OS",
    )  # fmt: skip
    p.add_argument("--data-dir", default=None, help="folder holding imdb/")
    p.add_argument("--save", default=None, help="write the model and its privacy record here")
    p.add_argument("--record", default=None, help="also write the result to this JSON file")
    args = p.parse_args(argv)
    started = time.time()
    given = sys.argv[1:] if argv is None else list(argv)
    command = shlex.join(["python", "examples/language_model.py", *given])

    if args.seed is not None:
        torch.manual_seed(args.seed)
    imdb = load_imdb(args.data_dir, vocab_size=args.vocab, max_len=args.length)
    train = imdb.train_x[: args.limit]
    if args.held_out == "validation":
        test = imdb.train_x[args.limit : args.limit + args.test_limit]
    else:
        test = imdb.test_x[torch.randperm(len(imdb.test_x))[: args.test_limit]]
    model = build_model(args.arch, imdb.num_tokens, args.length, args.width, args.layers)
    if args.arch == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight  # tied
    before = perplexity(model, test)
    privacy = (
        {"noise_multiplier": 0.0}
        if args.mechanism == "non-private"
        else {"target_epsilon": args.epsilon}
    )
    private = privgrad.make_private(
        model,
        torch.optim.Adam(model.parameters(), lr=args.lr),
        (inputs(train), train),  # labels: the ids themselves
        mechanism=args.mechanism,
        epochs=args.epochs,
        batch_size=args.batch_size,
        max_grad_norm=args.clip,
        loss_fn=next_token_loss,
        seed=args.seed,
        **privacy,
    )
    for epoch in range(args.epochs):
        model.train()
        for batch in private.batches():
            private.step(batch)
        print(f"epoch {epoch + 1}: {private.steps} steps, ε = {private.epsilon():.3f}")
    result = {
        "steps": private.steps,
        "epsilon": private.epsilon(),
        "delta": private.delta,
        "sampling_rate": private.sampling_rate,
        "noise_multiplier": private.mechanism.noise_multiplier,
        "layers": len(private.grad_sampler.layers),
        "clipping_units": private.n_layers,
        "perplexity_before": before,
        "perplexity_after": perplexity(model, test),
        "perplexity_unigram": unigram_perplexity(train, test),
    }
    if args.save:
        private.save_model(args.save)
    if args.record:
        Path(args.record).parent.mkdir(parents=True, exist_ok=True)
        extra = {"args": vars(args), "wall_time_s": round(time.time() - started, 2)}
        extra.update(git_commit=git_commit(), code_version=code_version(), command=command)
        finite = {"epsilon": result["epsilon"] if math.isfinite(result["epsilon"]) else None}
        Path(args.record).write_text(json.dumps({**result, **finite, **extra}, indent=2) + "\n")
    print(
        f"held-out perplexity {result['perplexity_before']:.1f} → "
        f"{result['perplexity_after']:.1f} on {len(test)} {args.held_out} reviews (word "
        f"frequencies: {result['perplexity_unigram']:.1f}), ε = {result['epsilon']:.3f} "
        f"(δ = {result['delta']:g}) after {result['steps']} steps"
    )
    return result


if __name__ == "__main__":
    main()
