"""fastDP (book-keeping, "BK") as a step-time contender (issue 42).

fastDP is not on PyPI; it comes from its repository, github.com/awslabs/fast-differential-privacy,
at commit ``3d5cc561aa337c72f79873ccc4fe8b900b5493b5`` (2025-05-19, "Update
autograd_grad_sample.py"; version string 2.0.0). Its Python package ``fastDP/`` is copied,
unchanged, to ``.fastdp/fastDP/`` at the repository root (git-ignored; the commit is in
``.fastdp/COMMIT``). To set it up again::

    git clone https://github.com/awslabs/fast-differential-privacy /tmp/fastdp-src
    git -C /tmp/fastdp-src checkout 3d5cc561aa337c72f79873ccc4fe8b900b5493b5
    mkdir -p .fastdp && cp -r /tmp/fastdp-src/fastDP .fastdp/fastDP
    echo 3d5cc561aa337c72f79873ccc4fe8b900b5493b5 > .fastdp/COMMIT

The step: fastDP's hook-based ``PrivacyEngine`` attached to ``torch.optim.SGD`` at ``lr``::

    PrivacyEngine(model, batch_size=B, sample_size=..., epochs=1,
                  noise_multiplier=σ, max_grad_norm=C,
                  clipping_mode="MixOpt",      # hybrid book-keeping: default, fastest BK mode
                  clipping_fn="Abadi",         # min(1, C/‖g_i‖): DP-SGD's (not 'automatic')
                  clipping_style="all-layer",  # one norm over all parameters (flat clipping)
                  loss_reduction="mean",       # fastDP's documented default: F.cross_entropy's mean
                  origin_params=None)          # no ghost-differentiation trick
    engine.attach(opt)
    # step():  opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()

The noise multiplier is given directly (fastDP computes σ from a target ε only when
``noise_multiplier`` is None; ``epochs`` and ``sample_size`` then only feed its accountant,
which the step never calls). fastDP's update is DP-SGD's: the backward hooks compute each
example's gradient norm over all layers, scale each example's contribution by
``min(1, C / (‖g_i‖ + 1e-6))``, sum, add N(0, (σC)²) per coordinate, and ``optimizer.step``
divides by the batch size (``loss_reduction='mean'``; the hooks undo the mean's 1/B first).
tests/test_fastdp_contender.py checks this against a hand-computed clipped-sum step.

BK modes in this commit (``clipping_mode``): ``'ghost'`` (base BK: ghost norm everywhere),
``'MixGhostClip'`` (hybrid ghost/instantiated norms, gradients recomputed) and ``'MixOpt'``
(hybrid BK, per-layer choice between ghost norm and instantiated per-sample gradients,
which it keeps for the clipped sum; the default and the fastest per the paper and README).

What fastDP cannot take: only parameters of ``nn.Linear``, ``nn.Embedding``,
``nn.Conv1d/2d/3d``, ``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.InstanceNorm1d/2d/3d`` (and
two Hugging Face layers) get private gradients; any other trainable parameter (BatchNorm,
``nn.MultiheadAttention``'s in-projection, a bare ``nn.Parameter``) fastDP itself drops
from training with a printed note at the first step. That would not be the same
mechanism, so :func:`fastdp_step` refuses such a model up front with
:class:`FastDPCannotHandle` (and checks after the first step that no parameter was dropped).

Dependencies: fastDP imports ``transformers`` at import time (``transformers_support``,
``lora_utils``, ``supported_layers_grad_samplers``: GPT-2/T5/OPT forward swaps, HF
``Conv1D``, ``T5LayerNorm``), plus numpy and scipy (its RDP accountant): privgrad's ``hf``
and ``test`` extras install it. fastDP's own files are not patched;
``FASTDP_INFO['transformers']`` is the version used.

``origin_params`` (fastDP's optional "ghost differentiation" trick, which freezes all but
the first layer's parameters for autograd) is left off: which layers must be origins
depends on the model, and a wrong choice silently drops parameters.

Checked (issue 42): on CPU (torch 2.13, transformers 5.24) and on an H100 (torch
2.11, transformers 5.17), ``cnn``, ``wrn16-4``, ``model3-gn`` and ``transformer`` run;
``transformer-torch`` (``nn.MultiheadAttention``) is refused with FastDPCannotHandle.

Errors: :class:`FastDPUnavailable` (one line: ``.fastdp/fastDP`` absent or its import fails)
and its subclass :class:`FastDPCannotHandle` (this model); benchmarks/step_time.py turns
either into a Skip.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

FASTDP_COMMIT = "3d5cc561aa337c72f79873ccc4fe8b900b5493b5"
FASTDP_ROOT = Path(__file__).resolve().parent.parent / ".fastdp"
CLIPPING_MODE = "MixOpt"  # hybrid book-keeping
FASTDP_INFO: dict = {}  # after load_fastdp(): {'module', 'commit', 'transformers': version}

# fastDP's hooks are Module.register_backward_hook (non-full): torch warns of them at every
# model's first backward; they are what fastDP uses (and still work in torch 2.11 to 2.13)
warnings.filterwarnings(
    "ignore", message="Using a non-full backward hook when the forward", category=FutureWarning
)


class FastDPUnavailable(Exception):
    """fastDP cannot be used here (not set up in .fastdp/, or its import fails)."""


class FastDPCannotHandle(FastDPUnavailable):
    """fastDP is there but cannot run this model as DP-SGD (an unsupported trainable layer)."""


# --------------------------------------------------------------------------- import


def _import_fastdp():
    root = str(FASTDP_ROOT)
    if root not in sys.path:
        sys.path.insert(0, root)
    # fastDP prints, and torch warns of its @torch.jit.script on import: keep output clean
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return importlib.import_module("fastDP")


def load_fastdp():
    """Imports fastDP from ``.fastdp/fastDP`` (once); raises :class:`FastDPUnavailable`."""
    if "module" in FASTDP_INFO:
        return FASTDP_INFO["module"]
    if not (FASTDP_ROOT / "fastDP" / "__init__.py").is_file():
        raise FastDPUnavailable(
            f"fastDP not set up: {FASTDP_ROOT / 'fastDP'} is absent (it is not on PyPI; copy "
            "fastDP/ from github.com/awslabs/fast-differential-privacy there)"
        )
    try:
        fastdp = _import_fastdp()
        import transformers
    except Exception as e:  # noqa: BLE001 (transformers absent, or a version fastDP does not fit)
        raise FastDPUnavailable(
            f"fastDP import fails: {type(e).__name__}: {e} (fastDP needs transformers: "
            "pip install -e '.[hf]')"
        ) from None
    FASTDP_INFO.update(
        module=fastdp,
        commit=_read_commit(),
        transformers=transformers.__version__,
    )
    return fastdp


def _read_commit():
    try:
        return (FASTDP_ROOT / "COMMIT").read_text().strip()
    except OSError:
        return None


# --------------------------------------------------------------------------- the contender


def unsupported_parameters(model: nn.Module, fastdp=None) -> list[str]:
    """Names (with their module's type) of trainable parameters fastDP gives no private
    gradient: those not held directly by a layer type in fastDP's supported table."""
    fastdp = fastdp or load_fastdp()
    table = sys.modules["fastDP.supported_layers_grad_samplers"]
    supported = table._supported_layers_norm_sample_AND_clipping
    covered = set()
    for module in model.modules():
        if type(module) in supported:
            covered.update(id(p) for p in module.parameters(recurse=False))
    owner = {}
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            owner.setdefault(id(p), (f"{mname}.{pname}" if mname else pname, type(module).__name__))
    return [
        f"{owner[id(p)][0]} ({owner[id(p)][1]})"
        for p in model.parameters()
        if p.requires_grad and id(p) not in covered
    ]


def fastdp_step(model, x, y, noise_multiplier, max_grad_norm, lr, *, clipping_mode=CLIPPING_MODE):
    """A zero-argument callable doing one fastDP DP-SGD step (book-keeping ``clipping_mode``,
    all-layer Abadi clipping at ``max_grad_norm``, noise ``noise_multiplier``, SGD at ``lr``)
    of ``model`` on the fixed batch ``(x, y)``, mean cross-entropy loss. Raises
    :class:`FastDPUnavailable` / :class:`FastDPCannotHandle`."""
    fastdp = load_fastdp()
    bad = unsupported_parameters(model, fastdp)
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise FastDPCannotHandle(
            f"fastDP has no per-sample rule for trainable parameter(s) {', '.join(bad[:3])}{more} "
            "(it would silently leave them untrained)"
        )
    batch = len(x)
    n_params = sum(1 for p in model.parameters() if p.requires_grad)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # fastDP prints its settings
            engine = fastdp.PrivacyEngine(
                model,
                batch_size=batch,
                sample_size=50 * batch,  # only for fastDP's accountant (sample rate), unused here
                epochs=1,  # required by the constructor; only for the accountant
                noise_multiplier=noise_multiplier,
                max_grad_norm=max_grad_norm,
                clipping_mode=clipping_mode,
                clipping_fn="Abadi",
                clipping_style="all-layer",
                loss_reduction="mean",
                origin_params=None,
            )
        engine.attach(opt)
    except FastDPUnavailable:
        raise
    except Exception as e:
        raise FastDPCannotHandle(f"fastDP's PrivacyEngine fails: {type(e).__name__}: {e}") from None
    checked = False

    def step():
        nonlocal checked
        if checked:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            return
        try:  # the first step: fastDP's hooks and step on this model for the first time
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            with contextlib.redirect_stdout(io.StringIO()):  # its note on dropped parameters
                opt.step()
        except Exception as e:
            raise FastDPCannotHandle(f"fastDP's step fails: {type(e).__name__}: {e}") from None
        if len(engine.named_params) != n_params:  # fastDP dropped parameters without a rule
            raise FastDPCannotHandle(
                f"fastDP computed private gradients for only {len(engine.named_params)} of "
                f"{n_params} trainable parameters"
            )
        checked = True

    step.engine, step.optimizer = engine, opt
    return step
