"""Hugging Face models from a folder on disk: ``--model hf:PATH``.

``PATH`` is a folder written by ``save_pretrained`` (``config.json`` and the weights); it is
read with ``local_files_only=True``, so nothing is downloaded. An image model (its
``model_type`` has an image-classification class: ViT, …) is loaded as
``AutoModelForImageClassification``, any other as ``AutoModelForSequenceClassification``,
with ``num_labels`` set to the data's number of classes (a head of another size is
initialised anew, as ``ignore_mismatched_sizes=True`` does).

The command line's batches reach the model through :class:`HFClassifier`: images (B, C, H,
W) as ``pixel_values``; token ids (B, T), padded with 0 as the built-in text data is, as
``input_ids`` with ``attention_mask = ids != 0`` (the model's ``pad_token_id`` is set to 0
to match); a dict (a ``python:`` dataset's examples) as the model's keyword arguments (a
model without a ``pad_token_id``, GPT-2's own config, gets 0, which GPT-2's classifier
needs to find each example's last token). A
text model that takes ``position_ids`` is given them with the batch's shape (B, T), the
positions Hugging Face would use (0 … T−1), instead of its default, one (1, T) row
broadcast over the batch, which the engine would copy to each example after make_private's
check (``independence.check_gradients``).

A classifier that reads each example at its end-of-sequence token (BART, mBART, PLBart, MVP,
BigBird-Pegasus, T5, mT5, UMT5: they require exactly as many ``eos_token_id`` in every
example) gets the token ids as its tokenizer would give them: every id but padding moved up
by ``eos_token_id``, so no word of the data reads as the end, and one end token after each
example's last token (the batch one column longer). An encoder-decoder config without a
``decoder_start_token_id`` gets the padding id, T5's convention.

Needs the optional extra: ``pip install -e '.[hf]'``.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch import nn

from privgrad.errors import PrivgradError

PREFIX = "hf:"
INSTALL = "pip install -e '.[hf]'"
PAD = 0  # the padding id of the command line's token data (privgrad.app.data.text)


class HFClassifier(nn.Module):
    """A Hugging Face classifier called on the command line's batches; returns its logits."""

    def __init__(self, model: nn.Module, pad_token_id: int = PAD, eos_token_id: int | None = None):
        super().__init__()
        self.model, self.pad_token_id, self.eos_token_id = model, pad_token_id, eos_token_id
        self.takes_positions = "position_ids" in inspect.signature(model.forward).parameters

    @property
    def wrapped_pretrained(self) -> nn.Module:
        """The Hugging Face model inside, which ``from_pretrained`` gives back from the folder
        :meth:`save_pretrained` writes (:func:`privgrad.model_file.save_model`)."""
        return self.model

    def save_pretrained(self, folder) -> None:
        """The Hugging Face model inside, as its ``save_pretrained`` writes it: its config
        holds the data's ``num_labels`` and the loader's overrides (padding id 0, no cache);
        ``from_pretrained`` reads it. (:func:`privgrad.model_file.save_model` calls it.)"""
        self.model.save_pretrained(folder)

    def _end_each(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` moved clear of the end token, with one end token after each example's
        last non-padding token."""
        pad, eos = self.pad_token_id, self.eos_token_id
        moved = torch.where(ids == pad, ids, ids + eos)
        out = torch.cat([moved, moved.new_full((len(ids), 1), pad)], 1)
        T = ids.shape[1]
        ends = torch.where(ids != pad, torch.arange(1, T + 1, device=ids.device), 0).amax(1)
        return out.scatter(1, ends[:, None], eos)

    def forward(self, x: torch.Tensor | None = None, **inputs) -> torch.Tensor:
        if x is not None:
            if x.is_floating_point():
                inputs = {"pixel_values": x}
            else:
                if self.eos_token_id is not None:
                    x = self._end_each(x)
                inputs = {"input_ids": x, "attention_mask": (x != self.pad_token_id).long()}
        ids = inputs.get("input_ids")
        if self.takes_positions and ids is not None and inputs.get("position_ids") is None:
            B, T = ids.shape
            inputs["position_ids"] = torch.arange(T, device=ids.device).expand(B, T)
        return self.model(**inputs).logits


def _image_types() -> set[str]:
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
    )

    return set(MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES)


def _pools_at_eos(config) -> bool:
    """Whether the sequence classifier of ``config`` reads each example at its end token."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    )

    name = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(config.model_type)
    try:
        source = inspect.getsource(getattr(transformers, name).forward)
    except (AttributeError, TypeError, OSError):
        return False
    return "same number of <eos> tokens" in source


def _check_shape(
    spec: str, config, image: bool, input_shape, num_tokens: int | None, eos: int | None
) -> None:
    """One line if the data cannot feed the model: image channels and size, token ids
    beyond the vocabulary, sequences longer than the position embeddings (counting, for a
    model read at its end token ``eos``, the ids moved up by ``eos`` and the end token)."""
    if isinstance(input_shape, dict):  # a python: dataset's dicts: the model's own keywords
        return
    shape = tuple(input_shape)
    if image:
        size = config.image_size
        size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
        want = (config.num_channels, *size)
        if shape != want:
            raise PrivgradError(
                f"--model '{spec}' takes images of shape {want} (channels, height, width); "
                f"the data's are {shape}"
            )
        return
    if len(shape) != 1:
        raise PrivgradError(
            f"--model '{spec}' is a text model (token ids of shape (length,)); the data's "
            f"examples have shape {shape}"
        )
    vocab = getattr(config, "vocab_size", None)
    if num_tokens is not None and vocab is not None and num_tokens + (eos or 0) > vocab:
        moved = f" ({num_tokens - 1 + eos} moved clear of its end token {eos})" if eos else ""
        raise PrivgradError(
            f"--model '{spec}' has a vocabulary of {vocab} tokens; the data's ids go up to "
            f"{num_tokens - 1}{moved} (IMDB's: --vocab-size + 1; a smaller --vocab-size fits)"
        )
    positions = getattr(config, "max_position_embeddings", None)
    length = shape[0] + (eos is not None)
    if positions is not None and length > positions:
        ended = " with its end token" if eos is not None else ""
        raise PrivgradError(
            f"--model '{spec}' takes sequences of at most {positions} tokens; the data's "
            f"are {length} long{ended} (IMDB's: --max-len; a smaller one fits)"
        )


def load_hf_model(
    spec: str, input_shape, num_classes: int, num_tokens: int | None = None
) -> HFClassifier:
    """The model of ``hf:PATH``, for data of ``input_shape`` with ``num_classes`` classes (and
    token ids below ``num_tokens``); every failure is one line."""
    if not spec.startswith(PREFIX) or not spec[len(PREFIX) :]:
        raise PrivgradError(f"--model '{spec}': write hf:PATH (a folder saved by save_pretrained)")
    path = Path(spec[len(PREFIX) :]).expanduser()
    try:
        import transformers
    except ImportError:
        raise PrivgradError(
            f"--model '{spec}' needs Hugging Face transformers, an optional extra: {INSTALL}"
        ) from None
    if not path.is_dir():
        raise PrivgradError(f"--model '{spec}': no folder {path}")
    if not (path / "config.json").is_file():
        raise PrivgradError(
            f"--model '{spec}': {path} holds no config.json (write the folder with save_pretrained)"
        )
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as err:  # transformers' own errors: one line
        text = " ".join(str(err).split())
        raise PrivgradError(f"--model '{spec}': its config.json cannot be read: {text}") from None
    image = config.model_type in _image_types()
    tokens = not image and not isinstance(input_shape, dict)  # the command line's token ids
    pools_at_eos = tokens and _pools_at_eos(config)
    eos = getattr(config, "eos_token_id", None) if pools_at_eos else None
    if pools_at_eos and (not isinstance(eos, int) or eos == PAD):
        raise PrivgradError(
            f"--model '{spec}' reads each example at its end token, and its config's "
            f"eos_token_id ({eos}) is not a token id other than the padding id {PAD}"
        )
    _check_shape(spec, config, image, input_shape, num_tokens, eos)
    auto = (
        transformers.AutoModelForImageClassification
        if image
        else transformers.AutoModelForSequenceClassification
    )
    overrides = {}
    pad = getattr(config, "pad_token_id", None)
    if not image and (not isinstance(input_shape, dict) or pad is None):
        overrides["pad_token_id"] = PAD  # the command line's token data pads with 0
    if getattr(config, "is_encoder_decoder", False) and (
        getattr(config, "decoder_start_token_id", None) is None
    ):
        overrides["decoder_start_token_id"] = overrides.get("pad_token_id", pad)  # T5's way
    if getattr(config, "use_cache", False):
        # a classifier generates nothing; with a cache, make_private's check (in eval mode)
        # would have a state-space model keep the batch's state, which its replay refuses
        overrides["use_cache"] = False
    config.update(overrides)  # on the config: T5's has no decoder_start_token_id to override
    config.num_labels = num_classes
    try:
        model = auto.from_pretrained(
            path, config=config, local_files_only=True, ignore_mismatched_sizes=True
        )
    except Exception as err:
        text = " ".join(str(err).split())
        raise PrivgradError(f"--model '{spec}' cannot be loaded: {text}") from None
    return HFClassifier(model, overrides.get("pad_token_id", PAD), eos)
