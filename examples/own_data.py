"""Bring your own data and model: a GroupNorm CNN on an image folder, trained privately
from a DataLoader, checkpointed, and resumed in a fresh trainer. Runs from a fresh clone:
the images come from the MNIST files the repository ships (data/mnist/).

1. Writes an ImageFolder (train/<digit>/*.png, test/<digit>/*.png) from MNIST's raw bytes
   (read with privgrad's IDX reader, written with Pillow): the first ``--per-class`` training
   images of each digit and the first ``--per-class // 5`` test images.
2. Trains ``SmallNet`` (the user's own nn.Module) with ``privgrad.make_private`` from a
   ``DataLoader`` over that folder: images are read lazily, batch by batch; privgrad replaces
   the loader's sampler with Poisson sampling and calibrates σ for the target ε.
3. After half the epochs, saves ``private.state_dict()`` as a checkpoint (SHA-256 checked),
   builds everything anew as a restarted process would, loads the checkpoint and finishes.

    python examples/own_data.py                       # 3,000 images per digit, 4 epochs, ε = 1
    python examples/own_data.py --per-class 10 --epochs 2 --batch-size 16   # a tiny slice

With its defaults (30,000 training images, expected batch 750, 4 epochs, honest ε = 1 at
δ = 1e-5, privgrad's DP-SGD defaults lr 2, momentum 0.9, C = 0.1) examples/README.md has its
test accuracy on its 6,000 test images (seeds 0, 1, 2; a minute or two a run on one CPU
core), the commands and how the defaults were chosen.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader

import privgrad
from privgrad.app.checkpoint import load_checkpoint, save_checkpoint
from privgrad.app.data.folder import load_image_folder
from privgrad.app.data.images import IDX_FILES, read_idx
from privgrad.app.data.locate import find_dataset_dir
from privgrad.records import code_version, git_commit

CLASSES = tuple(str(d) for d in range(10))


class SmallNet(nn.Module):
    """A user's own model: GroupNorm (per-example) instead of BatchNorm (which mixes examples)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.GroupNorm(4, 16),
            nn.Tanh(),
            nn.AvgPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.GroupNorm(4, 32),
            nn.Tanh(),
            nn.AvgPool2d(2),
        )
        self.head = nn.Linear(32 * 7 * 7, num_classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def write_image_folder(out: Path, per_class: int, data_dir: str | None) -> Path:
    """PNGs of the first ``per_class`` training (and per_class // 5 test) images of each digit."""
    mnist = find_dataset_dir("mnist", IDX_FILES, data_dir)
    for split, prefix, n in (
        ("train", "train", per_class),
        ("test", "t10k", max(1, per_class // 5)),
    ):
        pixels = read_idx(mnist / f"{prefix}-images-idx3-ubyte.gz")  # uint8, N x 28 x 28
        labels = read_idx(mnist / f"{prefix}-labels-idx1-ubyte.gz")
        for k, name in enumerate(CLASSES):
            folder = out / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i, idx in enumerate((labels == k).nonzero()[0][:n]):
                Image.fromarray(pixels[idx], mode="L").save(folder / f"{i:05d}.png")
    return out


def build(train_set, args):
    """Model, optimizer and private trainer, as a (re)started process builds them."""
    if args.seed is not None:
        torch.manual_seed(args.seed)
    model = SmallNet(len(CLASSES))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loader = DataLoader(
        train_set, batch_size=args.batch_size, shuffle=True, num_workers=args.workers
    )
    return privgrad.make_private(
        model,
        optimizer,
        loader,
        target_epsilon=args.epsilon,
        epochs=args.epochs,
        max_grad_norm=args.clip,
        seed=args.seed,
        device=args.device,
    )


def train_epochs(private, epochs: int) -> None:
    for _ in range(epochs):
        for batch in private.batches():
            private.step(batch)


@torch.no_grad()
def accuracy(model, test_set, device) -> float:
    model.eval()
    loader = DataLoader(test_set, batch_size=256)
    correct = sum(int((model(x.to(device)).argmax(1) == y.to(device)).sum()) for x, y in loader)
    return correct / len(test_set)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", default="runs/own_data", help="where the image folder and the checkpoint go"
    )
    p.add_argument(
        "--data-dir", default=None, help="folder holding mnist/ (default: the repository's data/)"
    )
    p.add_argument("--per-class", type=int, default=3000, help="training images per digit")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=750, help="expected Poisson batch size")
    p.add_argument("--epsilon", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=2.0)
    p.add_argument("--clip", type=float, default=0.1)
    p.add_argument(
        "--seed", type=int, default=None,
        help="for a reproducible run (its ε holds while the seed stays secret); default: a "
        "secret seed drawn from the OS",
    )  # fmt: skip
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument(
        "--record", default=None, help="also write the result (and the arguments) to this JSON file"
    )
    args = p.parse_args(argv)
    started = time.time()
    given = sys.argv[1:] if argv is None else list(argv)
    command = shlex.join(["python", "examples/own_data.py", *given])

    out = Path(args.out)
    train_set, test_set, _ = load_image_folder(
        write_image_folder(out / "images", args.per_class, args.data_dir)
    )
    print(f"image folder {out / 'images'}: {len(train_set)} training, {len(test_set)} test images")

    private = build(train_set, args)
    first = args.epochs // 2
    train_epochs(private, first)
    save_checkpoint(out / "checkpoint", private.state_dict())
    print(f"checkpoint after {first} epoch(s), {private.steps} steps: ε = {private.epsilon():.3f}")

    resumed = build(train_set, args)  # a fresh process would start here
    resumed.load_state_dict(load_checkpoint(out / "checkpoint"))
    train_epochs(resumed, args.epochs - first)
    result = {
        "steps": resumed.steps,
        "epsilon": resumed.epsilon(),
        "sampling_rate": resumed.sampling_rate,
        "noise_multiplier": resumed.mechanism.noise_multiplier,
        "test_accuracy": accuracy(resumed.model, test_set, resumed.device),
    }
    print(
        f"resumed and finished: {result['steps']} steps, q = {result['sampling_rate']:.4f}, "
        f"σ = {result['noise_multiplier']:.3f}, test accuracy {result['test_accuracy']:.3f}, "
        f"ε = {result['epsilon']:.3f} at δ = {resumed.delta:g}"
    )
    if args.record:
        Path(args.record).parent.mkdir(parents=True, exist_ok=True)
        Path(args.record).write_text(
            json.dumps(
                {
                    **result,
                    "test_images": len(test_set),
                    "train_images": len(train_set),
                    "args": vars(args),
                    "wall_time_s": round(time.time() - started, 2),
                    "git_commit": git_commit(),
                    "code_version": code_version(),
                    "command": command,
                },
                indent=2,
            )
            + "\n"
        )
    return result


if __name__ == "__main__":
    main()
