"""``python -m sdc_forensics``: the CLI, as ``sdc-forensics`` (and what ``torchrun -m sdc_forensics`` runs)."""

from sdc_forensics.cli.main import main

if __name__ == "__main__":
    main()
