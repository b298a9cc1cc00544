"""What the experiments' table scripts share: reading a folder of run records, and the
target ε a record's command asked for."""
import json
from pathlib import Path


def load_records(folder: Path) -> dict[str, dict]:
    """{file stem: record} for every ``*.json`` in ``folder``, in name order."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(Path(folder).glob("*.json"))}


def target_epsilon(record: dict) -> float | None:
    """The ``--epsilon`` of the record's command (None where it had none)."""
    cmd = record["command"]
    return float(cmd.split("--epsilon ")[1].split()[0]) if "--epsilon " in cmd else None
