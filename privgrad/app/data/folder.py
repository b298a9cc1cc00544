"""Image folders (the torchvision ImageFolder layout), read lazily with Pillow.

``PATH`` holds one folder per class of PNG/JPEG files; the sorted folder names are the
classes 0…K−1. With ``PATH/train/`` and ``PATH/test/`` (each one folder per class) those are
the splits. Without them each file's split is fixed by its own path relative to ``PATH``
alone (a SHA-256 hash: about 1 file in 5 is a test image), so adding or removing one image
changes one split by that image only, as the accountant assumes.

Images are float32 tensors in [0, 1], channels first: 1 channel if the first test image
(classes and names sorted) is grayscale, else RGB, every image converted to that; all must
have that image's size. Channels and size are read from the test split, which privgrad
treats as public (its accuracy is released without noise), never from a training image.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from privgrad.errors import DataError, PrivgradError

SUFFIXES = (".png", ".jpg", ".jpeg")
TEST_SHARE = 5  # without train/ and test/, about 1 file in TEST_SHARE is a test image


class ImageFolder(Dataset):
    """(image, class) pairs of the listed files, each file opened when it is indexed."""

    def __init__(
        self, files: list[tuple[Path, int]], classes: list[str], mode: str, size: tuple[int, int]
    ):
        self.files, self.classes, self.mode, self.size = files, classes, mode, size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, label = self.files[i]
        with _open(path) as image:
            if image.size != self.size:
                raise PrivgradError(
                    f"{path} is {image.size[0]}×{image.size[1]}; every image must be "
                    f"{self.size[0]}×{self.size[1]} (the first test image's size)"
                )
            try:
                pixels = np.asarray(image.convert(self.mode), dtype=np.float32) / 255
            except (OSError, ValueError, SyntaxError) as err:  # truncated or corrupt pixel data
                raise DataError(f"imagefolder: cannot read {path}: {err}") from None
        x = torch.from_numpy(pixels)
        return (x[None] if x.ndim == 2 else x.permute(2, 0, 1).contiguous()), label


def _open(path: Path):
    """The image at ``path``, opened lazily; an unreadable or non-image file is one line."""
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(path)
    except UnidentifiedImageError:
        raise DataError(
            f"imagefolder: cannot read {path}: not an image Pillow can decode"
        ) from None
    except (OSError, ValueError, SyntaxError) as err:
        raise DataError(f"imagefolder: cannot read {path}: {err}") from None


def _images(folder: Path) -> list[Path]:
    return sorted(
        p for p in folder.iterdir() if p.suffix.lower() in SUFFIXES and not p.name.startswith(".")
    )


def _class_folders(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def is_test_file(relative: Path) -> bool:
    """Whether an image at ``relative`` (to the folder) is a test image: its path alone decides."""
    digest = hashlib.sha256(relative.as_posix().encode()).digest()
    return int.from_bytes(digest[:8], "big") % TEST_SHARE == 0


def _listing(root: Path, classes: list[str]) -> list[list[Path]]:
    return [_images(root / c) if (root / c).is_dir() else [] for c in classes]


def load_image_folder(path: str | Path) -> tuple[ImageFolder, ImageFolder, int]:
    """(train, test, number of classes) of the image folder at ``path``."""
    root = Path(path).expanduser()  # imagefolder:~/pets: no shell expands a ~ after a colon
    if not root.is_dir():
        raise PrivgradError(f"imagefolder: {root} is not a folder")
    if (root / "train").is_dir() or (root / "test").is_dir():
        if not ((root / "train").is_dir() and (root / "test").is_dir()):
            raise PrivgradError(
                f"imagefolder: {root} has only one of train/ and test/; give both or neither"
            )
        classes = _class_folders(root / "train")
        unknown = sorted(set(_class_folders(root / "test")) - set(classes))
        if unknown:
            raise PrivgradError(
                f"imagefolder: test/ has classes that train/ lacks: {', '.join(unknown)}"
            )
        train = _listing(root / "train", classes)
        test = _listing(root / "test", classes)
    else:
        classes = _class_folders(root)
        listing = _listing(root, classes)
        train = [[p for p in files if not is_test_file(p.relative_to(root))] for files in listing]
        test = [[p for p in files if is_test_file(p.relative_to(root))] for files in listing]
    if len(classes) < 2:
        raise PrivgradError(
            f"imagefolder: {root} needs one folder per class (at least 2), found {len(classes)}"
        )
    empty = [c for c, files in zip(classes, train) if not files]
    if empty:
        raise PrivgradError(
            f"imagefolder: no PNG/JPEG training images for class(es) {', '.join(empty)}"
        )
    public = [p for files in test for p in files]
    if not public:
        raise PrivgradError(
            f"imagefolder: {root} has no test images; the first one fixes every image's "
            "channels and size (a training image would make them depend on private data)"
        )
    with _open(public[0]) as first:
        mode, size = ("L" if first.mode in ("L", "1", "I;16", "I") else "RGB"), first.size

    def dataset(listing):
        return ImageFolder(
            [(p, k) for k, files in enumerate(listing) for p in files], classes, mode, size
        )

    return dataset(train), dataset(test), len(classes)
