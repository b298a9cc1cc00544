"""RDP-GAN (Ma et al.) as published, RDP-ANT and its decay baselines, and a sound DP-GAN.

RDP-GAN's noise on the loss gives no DP guarantee (see ``shared/spec/rdp-gan.md``):
privgrad runs it faithfully, records the paper's ε as ``epsilon_claimed`` (Thms 1-4,
not a guarantee) and ``epsilon`` as null (∞). ``dp-gan`` trains the discriminator with
DP-SGD on its real-data gradients and reports an honest ε.
"""

from privgrad.app.gan.claimed import NOT_A_GUARANTEE, TABLE_II_C, PaperAccountant
from privgrad.app.gan.data import GanData, load_gan_data
from privgrad.app.gan.models import Discriminator, Generator, condition
from privgrad.app.gan.schedules import (
    PAPER_DECAY,
    SCHEDULES,
    ClaimedBudget,
    NoiseSchedule,
    iterations_within_budget,
)
from privgrad.app.gan.train import GUARANTEE, GanConfig, GanTrainer, train_gan

__all__ = [
    "GanConfig",
    "GanTrainer",
    "train_gan",
    "GUARANTEE",
    "PaperAccountant",
    "TABLE_II_C",
    "NOT_A_GUARANTEE",
    "NoiseSchedule",
    "ClaimedBudget",
    "SCHEDULES",
    "PAPER_DECAY",
    "iterations_within_budget",
    "Generator",
    "Discriminator",
    "condition",
    "GanData",
    "load_gan_data",
]
