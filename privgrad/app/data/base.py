"""The container every dataset loader returns."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from privgrad.errors import DataError


@dataclass
class DatasetSplits:
    """Train and test tensors of one dataset.

    ``train_x``/``test_x`` hold the model inputs (float32 features, or int64 token ids for
    text), ``train_y``/``test_y`` int64 class labels in ``[0, num_classes)``. ``num_tokens``
    is the size of the token-id space (embedding rows) for text data, ``None`` otherwise.
    """

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    name: str
    num_tokens: int | None = None

    def __post_init__(self) -> None:
        for split, x, y in (
            ("train", self.train_x, self.train_y),
            ("test", self.test_x, self.test_y),
        ):
            if len(x) != len(y):
                raise DataError(
                    f"{self.name}: {split} split has {len(x)} inputs but {len(y)} labels"
                )

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one example, e.g. ``(1, 28, 28)`` for MNIST, ``(80,)`` for IMDB."""
        return tuple(self.train_x.shape[1:])
