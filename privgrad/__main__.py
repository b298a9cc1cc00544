"""``python -m privgrad`` (and ``torchrun -m privgrad``): the ``privgrad`` command line."""

from privgrad.app.cli import main

main(prog_name="privgrad")
