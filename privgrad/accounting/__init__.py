"""Privacy accounting: dp-accounting events composed into ε (PLD and RDP)."""

from privgrad.accounting.ledger import (
    ACCOUNTANTS,
    PrivacyLedger,
    calibrate_noise_multiplier,
    epsilon_of,
    gaussian_event,
    poisson_gaussian_event,
    validate_delta,
    validate_epsilon,
)

__all__ = [
    "ACCOUNTANTS",
    "PrivacyLedger",
    "calibrate_noise_multiplier",
    "epsilon_of",
    "gaussian_event",
    "poisson_gaussian_event",
    "validate_delta",
    "validate_epsilon",
]
