"""Toy cases: small inputs and outputs a person can verify on paper, stored in `toy_cases/`."""

import json
from functools import cache

from .loader import ROOT


@cache
def load_toy(stem: str) -> dict:
    return json.loads((ROOT / "toy_cases" / f"{stem}.json").read_text(encoding="utf-8"))
